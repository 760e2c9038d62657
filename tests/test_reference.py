"""Reference backend against the test-side float64 attention: out, lse, dq, dk, dv."""

import math

import pytest
import torch
from helpers import attention64, random_cu_seqlens, random_qkv, reference_grads, rel_err

from ringfa4.kernels import AttnSpec, get_backend

TOL32 = 1e-5  # CPU float32 against float64

CASES = [
    # (s_q, s_k, h, h_kv, d, spec kwargs)
    (33, 33, 4, 4, 16, {}),
    (33, 33, 4, 1, 16, {"causal": True}),  # MQA
    (17, 45, 6, 2, 32, {"causal": True}),  # s_q < s_k: bottom-right
    (45, 17, 6, 3, 8, {"causal": True}),  # s_q > s_k: first rows see nothing
    (40, 40, 4, 2, 16, {"window": (7, 3)}),
    (40, 52, 4, 2, 16, {"causal": True, "window": (5, None)}),
    (40, 40, 4, 4, 16, {"window": (0, None)}),
    (40, 40, 4, 2, 16, {"softcap": 3.0, "causal": True}),
    (31, 29, 2, 2, 24, {"softmax_scale": 0.3, "window": (None, 4)}),
]


@pytest.mark.parametrize("s_q,s_k,h,h_kv,d,kw", CASES)
def test_reference_dense_matches_float64(s_q, s_k, h, h_kv, d, kw):
    q, k, v, do = random_qkv(2, s_q, s_k, h, h_kv, d, seed=s_q * 7 + s_k)
    spec = AttnSpec(**kw)
    be = get_backend("reference")
    out, lse = be.forward(q, k, v, spec)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (2, h, s_q)
    dq, dk, dv = be.backward(do, q, k, v, out, lse, spec)
    ref = reference_grads(q, k, v, do, **kw)
    for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert rel_err(x, r) < TOL32, (name, rel_err(x, r))


def test_fully_masked_rows_are_zero_and_minus_inf():
    q, k, v, do = random_qkv(1, 12, 5, 2, 2, 8)
    be = get_backend("reference")
    spec = AttnSpec(causal=True)
    out, lse = be.forward(q, k, v, spec)
    assert torch.isneginf(lse[:, :, :7]).all() and torch.isfinite(lse[:, :, 7:]).all()
    assert (out[:, :7] == 0).all()
    dq, dk, dv = be.backward(do, q, k, v, out, lse, spec)
    assert (dq[:, :7] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_reference_float64_mode():
    q, k, v, do = random_qkv(1, 20, 20, 2, 1, 8, dtype=torch.float64)
    be = get_backend("reference", compute_dtype=torch.float64)
    out, lse = be.forward(q, k, v, AttnSpec(causal=True))
    assert lse.dtype == torch.float64
    ro, rl = attention64(q, k, v, causal=True)
    assert rel_err(out, ro) < 1e-13 and rel_err(lse, rl) < 1e-13
    # float32 inputs computed in float64 when asked
    o32, l32 = be.forward(q.float(), k.float(), v.float(), AttnSpec(causal=True))
    assert o32.dtype == torch.float32 and l32.dtype == torch.float64


@pytest.mark.parametrize("lengths", [[5, 0, 17, 1, 9], [0, 0, 30], [12]])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_varlen_with_empty_documents(lengths, causal):
    total = sum(lengths)
    cu = random_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v, do = (torch.randn(total, 4, 16, generator=g) for _ in range(4))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    spec = AttnSpec(causal=causal, window=(4, None), cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    be = get_backend("reference")
    out, lse = be.forward(q, k, v, spec)
    assert lse.shape == (4, total)
    dq, dk, dv = be.backward(do, q, k, v, out, lse, spec)
    ref = reference_grads(q, k, v, do, causal=causal, window=(4, None), cu_seqlens_q=cu, cu_seqlens_k=cu)
    for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert rel_err(x, r) < TOL32, (name, rel_err(x, r))


def test_reference_writes_into_strided_views():
    q, k, v, _ = random_qkv(1, 16, 16, 2, 2, 8)
    buf = torch.full((1, 32, 2, 8), math.nan)
    lbuf = torch.full((1, 2, 32), math.nan)
    out, lse = get_backend("reference").forward(q, k, v, AttnSpec(), out=buf[:, 8:24], lse=lbuf[:, :, 8:24])
    ro, rl = attention64(q, k, v)
    assert rel_err(buf[:, 8:24], ro) < TOL32 and rel_err(lbuf[:, :, 8:24], rl) < TOL32
    assert out.data_ptr() == buf[:, 8:24].data_ptr()
