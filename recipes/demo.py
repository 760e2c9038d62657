"""ringfa4 demo (CPU): one causal attention computed whole, as merged K/V blocks, and as a
simulated 4-rank zigzag ring, each compared with float64 math.

    make demo-kernels
"""

from __future__ import annotations

import math
import time

import torch

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend, merge_lse_


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    return (torch.linalg.vector_norm(x[fin] - ref[fin]) / torch.linalg.vector_norm(ref[fin])).item()


def main() -> None:
    torch.manual_seed(0)
    b, s, h, h_kv, d = 2, 512, 8, 2, 64
    q, k, v, dout = (torch.randn(b, s, n, d) for n in (h, h_kv, h_kv, h))
    spec = AttnSpec(causal=True)
    exact = get_backend("reference", compute_dtype=torch.float64)
    ref_out, ref_lse = exact.forward(q.double(), k.double(), v.double(), spec)
    be = get_backend("reference")  # float32: the CPU backend

    t0 = time.perf_counter()
    whole, whole_lse = be.forward(q, k, v, spec)
    t_whole = time.perf_counter() - t0

    # the same attention as 4 K/V blocks merged with the online softmax (the ring's inner step):
    # query i sees key j <= i; for keys [k0, k1) that is rows [k0, s) with window right = s - k1.
    t0 = time.perf_counter()
    acc = torch.zeros(b, s, h, d)
    acc_lse = torch.full((b, h, s), -math.inf)
    for k0 in range(0, s, s // 4):
        k1 = k0 + s // 4
        blk = AttnSpec(window=(None, s - k1))
        o, l = be.forward(q[:, k0:], k[:, k0:k1], v[:, k0:k1], blk)
        merge_lse_(acc[:, k0:], acc_lse[:, :, k0:], o, l)
    t_blocks = time.perf_counter() - t0

    # a simulated 4-rank zigzag ring, forward and backward
    cp = ringfa4.ContextParallel.simulated(world_size=4, layout="zigzag", backend="reference")
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    ring_out, ring_lse = ringfa4.attention(qr, kr, vr, cp=cp, causal=True, return_lse=True)
    ring_out.backward(dout)
    t_ring = time.perf_counter() - t0
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, _ = ringfa4.attention(q64, k64, v64, causal=True, return_lse=True, backend="reference")
    o64.backward(dout.double())

    print(f"causal attention, b={b} s={s} h={h} h_kv={h_kv} d={d}, float32 on CPU; error vs float64")
    print(f"{'method':<34}{'out':>10}{'lse':>10}{'dq':>10}{'dk':>10}{'dv':>10}{'ms':>9}")
    print(f"{'whole (one call)':<34}{rel(whole, ref_out):>10.1e}{rel(whole_lse, ref_lse):>10.1e}"
          f"{'':>30}{t_whole * 1e3:>9.1f}")
    print(f"{'4 K/V blocks + merge_lse_':<34}{rel(acc, ref_out):>10.1e}{rel(acc_lse, ref_lse):>10.1e}"
          f"{'':>30}{t_blocks * 1e3:>9.1f}")
    print(f"{'simulated ring, P=4 zigzag (+bwd)':<34}{rel(ring_out, ref_out):>10.1e}{rel(ring_lse, ref_lse):>10.1e}"
          f"{rel(qr.grad, q64.grad):>10.1e}{rel(kr.grad, k64.grad):>10.1e}{rel(vr.grad, v64.grad):>10.1e}"
          f"{t_ring * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
