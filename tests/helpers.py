"""Test-side ground truth: float64 attention written independently of ringfa4's code, with
autograd for the gradients, plus error metrics and random inputs."""

from __future__ import annotations

import math

import torch

TAIL_256K = (24830, 14478, 1764, 643, 3107, 1600, 17011, 849, 2502, 4872, 36943, 2982, 742, 14285, 6060, 610,
             37321, 58862, 20058, 12625)  # benchmarks/varlen_sim.py's long-tail mix


def _visible(s_q: int, s_k: int, causal: bool, window, device) -> torch.Tensor:
    left, right = window
    if left == -1:
        left = None
    if right == -1:
        right = None
    if causal:
        right = 0
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_k, device=device)[None, :]
    d = j - i - (s_k - s_q)
    ok = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if left is not None:
        ok &= d >= -left
    if right is not None:
        ok &= d <= right
    return ok


def _dense64(q, k, v, causal, window, softcap, scale, sinks=None):
    """q (b, s_q, h, d), k/v (b, s_k, h_kv, d) float64 -> out (b, s_q, h, d), lse (b, h, s_q).
    ``sinks (h,)``: one more softmax column per head with that logit and no value (gpt-oss)."""
    h, h_kv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // h_kv, dim=2)
    v = v.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = _visible(q.shape[1], k.shape[1], causal, window, q.device)
    s = s.masked_fill(~ok, -math.inf)
    if sinks is None:
        lse = torch.logsumexp(s, dim=-1)
    else:  # the sink column, then the value-less column dropped
        col = sinks.to(torch.float64).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = torch.where(ok, p, torch.zeros_like(p))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def attention64(q, k, v, causal=False, window=(None, None), softcap=0.0, softmax_scale=None,
                cu_seqlens_q=None, cu_seqlens_k=None, sinks=None):
    """Float64 attention (differentiable). Dense or varlen (FA layouts and lse conventions);
    ``sinks (h,)``: learnable sink logits."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is None:
        return _dense64(q, k, v, causal, window, softcap, scale, sinks)
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, l = _dense64(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                        causal, window, softcap, scale, sinks)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


def reference_grads(q, k, v, dout, **kw):
    """(out, lse, dq, dk, dv) in float64 via autograd of :func:`attention64`."""
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    out, lse = attention64(q64, k64, v64, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.to(torch.float64))
    return out.detach(), lse.detach(), dq, dk, dv


def sink_reference_grads(q, k, v, dout, sinks, **kw):
    """(out, lse, dq, dk, dv, dsinks) in float64 via autograd of :func:`attention64` with sinks."""
    x = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v, sinks)]
    out, lse = attention64(*x[:3], sinks=x[3], **kw)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, x, dout.to(torch.float64)))


def sink_attention_grads(q, k, v, dout, sinks, **kw):
    """ringfa4.attention with ``sinks``: (out, lse, dq, dk, dv, dsinks) for ``dout``."""
    import ringfa4

    x = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = ringfa4.attention(*x[:3], sinks=x[3], return_lse=True, **kw)
    out.backward(dout)
    return (out.detach(), lse, *(t.grad for t in x))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over finite reference entries; infinite entries must match exactly
    (an lse of -inf must be -inf), else the error is inf. NaN anywhere gives inf."""
    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}")
    if torch.isnan(x).any():
        return math.inf
    fin = torch.isfinite(ref)
    if not torch.equal(x[~fin], ref[~fin]):
        return math.inf
    num = torch.linalg.vector_norm(x[fin] - ref[fin]).item()
    den = torch.linalg.vector_norm(ref[fin]).item()
    if den == 0:
        return num
    return num / den


def random_qkv(b, s_q, s_k, h, h_kv, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    return mk(b, s_q, h, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d), mk(b, s_q, h, d)


def random_cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


class HeadMajorGrads:
    """A backend-native dK/dV layout for executor tests (an AccumBackward's ``kv_layout``):
    ``(b, h_kv, cap, d)`` per tensor, blocks addressable at multiples of ``align``."""

    dtype = torch.float32  # the travelling buffers' dtype

    def __init__(self, k, cap, align):
        self.shape = (k.shape[0], k.shape[2], cap, k.shape[3])
        self.numel, self.align, self.dense_calls, self.group_writes = 2 * math.prod(self.shape), align, 0, 0

    def _halves(self, buf):
        return buf[: self.numel // 2].view(self.shape), buf[self.numel // 2:].view(self.shape)

    def cols(self, buf, rows, k0, k1):
        assert k0 % self.align == 0, (k0, self.align)
        return tuple(t[:, :, k0:k1].permute(0, 2, 1, 3) for t in self._halves(buf))

    def dense(self, buf, rows):
        self.dense_calls += 1
        return tuple(t[:, :, :rows].permute(0, 2, 1, 3) for t in self._halves(buf))

    def write(self, buf, rows, dk, dv):
        dk_f, dv_f = self.dense(buf, rows)
        dk.copy_(dk_f)
        dv.copy_(dv_f)

    def write_groups(self, bufs, rows, dk, dv):
        """One copy a tensor for all groups where they are evenly spaced in one buffer (b = 1), as FA4's
        tile layout does it (counted in ``group_writes``); else a write a group."""
        from ringfa4.kernels.spec import group_stride, write_each_group

        step = group_stride(bufs, self.numel) if self.shape[0] == 1 else None
        if step is None:
            write_each_group(self, bufs, rows, dk, dv)
            return
        self.group_writes += 1
        G, (_, h, cap, d) = len(bufs), self.shape
        for i, out in enumerate((dk, dv)):
            offset = bufs[0].storage_offset() + i * self.numel // 2
            acc = bufs[0].as_strided((G, h, cap, d), (step, cap * d, d, 1), offset)
            out.view(out.shape[1], G, h, d).permute(1, 2, 0, 3).copy_(acc[:, :, :rows])


def run_triton_script(script: str, interpret: bool):
    """``script`` in a fresh Python (Triton reads TRITON_INTERPRET at import): through Triton's
    interpreter on the CPU, or natively on the GPU. Returns the CompletedProcess."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""} if interpret else {}))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
