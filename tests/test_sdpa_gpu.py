"""SdpaBackend (torch's fused SDPA ops) against float64 attention.

GPU tests (bf16 on the device machine): error of out, lse, dq, dk, dv against float64 must be at
most 2x the error of torch float32 math on the same bf16 inputs (results rounded to bf16 like the
backend's) plus a 1e-3 relative floor, for every op set (cuDNN first, flash only, efficient only,
cuDNN only), with GQA, causal s_q < s_k (bottom-right), causal s_q > s_k (keyless rows) and
non-causal ragged lengths.

CPU tests: on CPU tensors the backend raises SdpaUnsupported, a NotImplementedError (the input is
valid, this backend just cannot run it: ``auto`` falls back to reference), while malformed input
raises ValueError first. The piece / merge / keyless-row / GQA logic also runs on CPU in float64
with the three ops replaced by emulators that behave as the real ones were measured to (flash:
bottom-right causal and lse = +inf on keyless rows; cuDNN and efficient: top-left causal, so they
must only ever get square causal blocks; efficient: LSE padded to 32 rows).
"""

from __future__ import annotations

import math

import helpers
import pytest
import torch
from helpers import random_cu_seqlens, random_qkv, reference_grads, rel_err

from ringfa4.kernels import AttnSpec, BlockBackend, get_backend, sdpa
from ringfa4.kernels.sdpa import SdpaBackend, SdpaUnsupported

NAMES = ("out", "lse", "dq", "dk", "dv")
# b, s_q, s_k, h, h_kv, d, causal
CASES = [
    (2, 256, 256, 8, 2, 128, True),  # GQA, square causal
    (2, 256, 256, 4, 4, 64, False),
    (1, 192, 448, 8, 2, 128, True),  # causal s_q < s_k: bottom-right
    (1, 448, 192, 4, 1, 64, True),  # causal s_q > s_k: the first 256 rows see no key
    (2, 200, 333, 4, 2, 128, False),  # ragged lengths
]
OP_SETS = [sdpa.OPS, ("flash",), ("efficient",), ("cudnn",)]


def _case_id(case) -> str:
    b, s_q, s_k, h, h_kv, d, causal = case
    return f"b{b}-q{s_q}-k{s_k}-h{h}/{h_kv}-d{d}-{'causal' if causal else 'full'}"


def _math32(q, k, v, dout, causal):
    """torch float32 math on the (bf16) inputs; out and grads rounded to q's dtype, lse float32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        out, lse = helpers._dense64(q32, k32, v32, causal, (None, None), 0.0, 1.0 / math.sqrt(q.shape[-1]))
        grads = torch.autograd.grad(out, (q32, k32, v32), dout.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return (out.detach().to(q.dtype), lse.detach()) + tuple(g.to(q.dtype) for g in grads)


def _run(backend, q, k, v, dout, spec):
    out, lse = backend.forward(q, k, v, spec)
    return (out, lse) + tuple(backend.backward(dout, q, k, v, out, lse, spec))


def _check_shapes(res, q, k, v):
    out, lse, dq, dk, dv = res
    b, s_q, h, _ = q.shape
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    assert lse.shape == (b, h, s_q) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("ops", OP_SETS, ids=lambda o: "+".join(o))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bf16_within_2x_of_fp32_math(case, ops):
    b, s_q, s_k, h, h_kv, d, causal = case
    q, k, v, dout = random_qkv(b, s_q, s_k, h, h_kv, d, dtype=torch.bfloat16, device="cuda", seed=s_q + s_k)
    spec = AttnSpec(causal=causal)
    res = _run(SdpaBackend(ops=ops), q, k, v, dout, spec)
    _check_shapes(res, q, k, v)
    ref = reference_grads(q, k, v, dout, causal=causal)
    base = _math32(q, k, v, dout, causal)
    errors = {n: (rel_err(x, r), rel_err(m, r)) for n, x, r, m in zip(NAMES, res, ref, base)}
    bad = {n: e for n, e in errors.items() if not e[0] <= 2 * e[1] + 1e-3}
    assert not bad, f"(sdpa error, fp32-math error) over the bound: {bad}; all: {errors}"
    if causal and s_q > s_k:  # keyless rows: exactly out 0, lse -inf, dq 0
        n = s_q - s_k
        assert torch.all(res[1][..., :n] == -math.inf) and torch.all(res[0][:, :n] == 0)
        assert torch.all(res[2][:, :n] == 0)
    assert torch.isfinite(res[1][..., max(0, s_q - s_k) if causal else 0:]).all()


@pytest.mark.gpu
def test_fp32_uses_efficient_op():
    q, k, v, dout = random_qkv(2, 160, 224, 4, 2, 64, dtype=torch.float32, device="cuda", seed=3)
    for causal in (False, True):
        res = _run(get_backend("sdpa"), q, k, v, dout, AttnSpec(causal=causal))
        _check_shapes(res, q, k, v)
        ref = reference_grads(q, k, v, dout, causal=causal)
        base = _math32(q, k, v, dout, causal)
        errors = {n: (rel_err(x, r), rel_err(m, r)) for n, x, r, m in zip(NAMES, res, ref, base)}
        assert all(e <= 2 * e32 + 1e-5 for e, e32 in errors.values()), errors


@pytest.mark.gpu
def test_out_lse_buffers_and_deterministic():
    q, k, v, dout = random_qkv(1, 128, 256, 4, 2, 64, dtype=torch.bfloat16, device="cuda", seed=5)
    spec = AttnSpec(causal=True, deterministic=True)
    be = SdpaBackend()
    out_ref, lse_ref = be.forward(q, k, v, spec)
    out_buf = torch.zeros(3, 1, 128, 4, 64, dtype=q.dtype, device="cuda")
    lse_buf = torch.zeros(1, 4, 3, 128, device="cuda")  # sequence-contiguous lse views
    out, lse = be.forward(q, k, v, spec, out=out_buf[1], lse=lse_buf[:, :, 1])
    assert out.data_ptr() == out_buf[1].data_ptr() and lse.data_ptr() == lse_buf[:, :, 1].data_ptr()
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert torch.all(out_buf[0] == 0) and torch.all(lse_buf[:, :, 2] == 0)
    flag = torch.are_deterministic_algorithms_enabled()
    g1 = be.backward(dout, q, k, v, out, lse, spec)
    g2 = be.backward(dout, q, k, v, out.float(), lse, spec)  # an fp32 merged out is accepted
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert torch.are_deterministic_algorithms_enabled() == flag


def _unsupported():
    return [
        ("softcap", dict(softcap=30.0)),
        ("sliding window", dict(window=(16, 0))),
        ("sliding window", dict(window=(None, 4))),
        ("varlen", dict(cu_seqlens_q=random_cu_seqlens([3, 5]), cu_seqlens_k=random_cu_seqlens([3, 5]),
                        max_seqlen_q=5, max_seqlen_k=5)),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("what,kw", _unsupported(), ids=lambda x: x if isinstance(x, str) else "")
def test_unsupported_features_raise_not_implemented(device, what, kw):
    if "cu_seqlens_q" in kw:
        kw = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        q = torch.randn(8, 4, 64, dtype=torch.bfloat16, device=device)
    else:
        q = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16, device=device)
    spec = AttnSpec(**kw)
    be = SdpaBackend()
    with pytest.raises(NotImplementedError, match=what):
        be.forward(q, q, q, spec)
    lse = torch.zeros(q.shape[-2], *q.shape[:-2]) if spec.varlen else torch.zeros(1, 4, 8)
    with pytest.raises(NotImplementedError, match=what):
        be.backward(q, q, q, q, q, lse.to(device), spec)


def test_cpu_tensors_raise_not_implemented():
    """On CPU the input is valid but this backend cannot run it: NotImplementedError (so auto falls
    back); malformed input is still a ValueError, checked first."""
    be = get_backend("sdpa")
    assert isinstance(be, BlockBackend) and be.name == "sdpa"
    q, k, v, dout = random_qkv(1, 8, 8, 4, 2, 64)
    with pytest.raises(SdpaUnsupported, match="CUDA"):
        be.forward(q, k, v, AttnSpec(causal=True))
    with pytest.raises(NotImplementedError, match="CUDA"):
        be.backward(dout, q, k, v, dout, torch.zeros(1, 4, 8), AttnSpec())
    with pytest.raises(NotImplementedError, match="float64"):
        be.forward(q.double(), k.double(), v.double(), AttnSpec())
    with pytest.raises(ValueError, match="heads"):
        be.forward(q, k[:, :, :1].expand(1, 8, 3, 64), v[:, :, :1].expand(1, 8, 3, 64), AttnSpec())
    with pytest.raises(ValueError, match="ops"):
        SdpaBackend(ops=("math",))


# -- CPU emulation of the three aten ops (float64, (b, h, s, d) like the real ones) ------------------

def _attend(op, q, k, v, causal, scale):
    s_q, s_k = q.shape[2], k.shape[2]
    assert op == "flash" or not causal or s_q == s_k, f"{op} is top-left: got a {s_q}x{s_k} causal block"
    out, lse = helpers._dense64(*(t.transpose(1, 2) for t in (q, k, v)), causal, (None, None), 0.0, scale)
    return out.transpose(1, 2).to(q.dtype), lse


def _grads(op, dout, q, k, v, out, lse, causal, scale):
    """(b, h, s, d) gradients from the given out and lse, as the ops compute them."""
    s_q, s_k = q.shape[2], k.shape[2]
    assert op == "flash" or not causal or s_q == s_k, f"{op} is top-left: got a {s_q}x{s_k} causal block"
    assert not torch.any(lse == -math.inf), "keyless rows must reach the ops as lse = +inf"
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.arange(s_k)[None] > torch.arange(s_q)[:, None] + (s_k - s_q), -math.inf)
    p = torch.exp(s - lse[..., :s_q, None])
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout


class _FakeAten:
    """The six aten ops with the behaviour measured on the H200 (torch 2.11)."""

    @staticmethod
    def _scaled_dot_product_cudnn_attention(q, k, v, bias, lse_flag, p, causal, debug, *, scale):
        assert bias is None and lse_flag and p == 0.0
        out, lse = _attend("cudnn", q, k, v, causal, scale)
        return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None

    @staticmethod
    def _scaled_dot_product_flash_attention(q, k, v, p, causal, debug, *, scale):
        out, lse = _attend("flash", q, k, v, causal, scale)
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # FA2 writes +inf on keyless rows
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    @staticmethod
    def _scaled_dot_product_efficient_attention(q, k, v, bias, lse_flag, p, causal, *, scale):
        out, lse = _attend("efficient", q, k, v, causal, scale)
        return out, torch.cat([lse, lse.new_full((*lse.shape[:2], -q.shape[2] % 32), 7.0)], -1), None, None

    @staticmethod
    def _scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, seed, off, bias, cq, ck, mq, mk, p,
                                                     causal, *, scale):
        assert lse.shape == q.shape[:3] + (1,) and lse.is_contiguous()
        return _grads("cudnn", do, q, k, v, o, lse[..., 0], causal, scale)

    @staticmethod
    def _scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, cq, ck, mq, mk, p, causal, seed, off,
                                                     *, scale):
        assert lse.shape == q.shape[:3] and lse.is_contiguous()
        return _grads("flash", do, q, k, v, o, lse, causal, scale)

    @staticmethod
    def _scaled_dot_product_efficient_attention_backward(do, q, k, v, bias, o, lse, seed, off, p, mask, causal,
                                                         *, scale):
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2] and mask == [True, True, True, False]
        return _grads("efficient", do, q, k, v, o, lse, causal, scale) + (None,)


@pytest.mark.parametrize("ops", OP_SETS, ids=lambda o: "+".join(o))
@pytest.mark.parametrize("case", [(2, 6, 6, 4, 2, 8, True), (1, 5, 11, 4, 1, 8, True), (1, 11, 5, 2, 2, 8, True),
                                  (2, 7, 9, 4, 2, 8, False)], ids=_case_id)
def test_piece_logic_with_emulated_ops(monkeypatch, case, ops):
    """Everything but the kernels, on CPU: pieces, LSE merge, keyless rows, GQA, layouts."""
    monkeypatch.setattr(sdpa, "_check_device", lambda q: None)
    monkeypatch.setattr(sdpa, "_HALF", (torch.float16, torch.bfloat16, torch.float64))
    monkeypatch.setattr(sdpa, "_aten", _FakeAten)
    b, s_q, s_k, h, h_kv, d, causal = case
    q, k, v, dout = random_qkv(b, s_q, s_k, h, h_kv, d, dtype=torch.float64, seed=1)
    res = _run(SdpaBackend(ops=ops), q, k, v, dout, AttnSpec(causal=causal))
    _check_shapes(res, q, k, v)
    for name, x, r in zip(NAMES, res, reference_grads(q, k, v, dout, causal=causal)):
        assert rel_err(x, r) < 1e-6, name  # exact math; the lse travels in float32
