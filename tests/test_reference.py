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


# -- backward_accumulate: block gradients added into fp32 / fp64 accumulators ---------------------

def _two_blocks(dtype, varlen: bool):
    """Two kv blocks of one q block (a ring's two steps) with the globally merged out / lse."""
    torch.manual_seed(3)
    h, h_kv, d = 4, 2, 16
    if varlen:
        lq, lk = [5, 1, 9, 3], [7, 1, 4, 6]
        cq, ck = random_cu_seqlens(lq), random_cu_seqlens(lk)
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        q, do = (torch.randn(sum(lq), h, d, dtype=dtype) for _ in range(2))
        kv = [tuple(torch.randn(sum(lk), h_kv, d, dtype=dtype) for _ in range(2)) for _ in range(2)]
        out, lse = torch.randn(sum(lq), h, d, dtype=dtype), torch.randn(h, sum(lq), dtype=dtype)
    else:
        kw = {}
        q, do = (torch.randn(2, 11, h, d, dtype=dtype) for _ in range(2))
        kv = [tuple(torch.randn(2, 13, h_kv, d, dtype=dtype) for _ in range(2)) for _ in range(2)]
        out, lse = torch.randn(2, 11, h, d, dtype=dtype), torch.randn(2, h, 11, dtype=dtype)
    specs = [AttnSpec(causal=True, **kw), AttnSpec(window=(3, 2), softcap=2.0, **kw)]
    return q, do, out, lse, kv, specs


@pytest.mark.parametrize("varlen", [False, True])
def test_reference_backward_accumulate_float64_sums_blocks(varlen):
    q, do, out, lse, kv, specs = _two_blocks(torch.float64, varlen)
    be = get_backend("reference", compute_dtype=torch.float64)
    acc = tuple(torch.zeros_like(t, dtype=torch.float64) for t in (q, kv[0][0], kv[0][1]))
    want = [torch.zeros_like(a) for a in acc]
    for (k, v), spec in zip(kv, specs):
        assert be.backward_accumulate(do, q, k, v, out, lse, spec, acc) is True
        for w, g in zip(want, be.backward(do, q, k, v, out, lse, spec)):
            w += g
    for name, a, w in zip(("dq", "dk", "dv"), acc, want):
        assert a.abs().max() > 0, name
        assert torch.allclose(a, w, rtol=1e-13, atol=1e-13), (name, (a - w).abs().max())


@pytest.mark.parametrize("varlen", [False, True])
def test_reference_backward_accumulate_float32_exact_into_views(varlen):
    """float32 inputs: the accumulators (row-slice views of a bigger buffer) end up bit-identical to
    the float32 sum of ``backward``'s results; nothing outside the views is touched."""
    q, do, out, lse, kv, specs = _two_blocks(torch.float32, varlen)
    be = get_backend("reference")
    bufs = [torch.full((t.shape[0] + 3,) + tuple(t.shape[1:]), 7.0) for t in (q, kv[0][0], kv[0][1])]
    acc = tuple(b.narrow(0, 2, t.shape[0]).zero_() for b, t in zip(bufs, (q, kv[0][0], kv[0][1])))
    want = None
    for (k, v), spec in zip(kv, specs):
        assert be.backward_accumulate(do, q, k, v, out, lse, spec, acc)
        g = be.backward(do, q, k, v, out, lse, spec)
        want = list(g) if want is None else [w + x for w, x in zip(want, g)]
    for a, w, b in zip(acc, want, bufs):
        assert a.dtype == torch.float32 and torch.equal(a, w)
        assert (b[:2] == 7).all() and (b[2 + a.shape[0]:] == 7).all()


def test_reference_backward_accumulate_bad_accumulator():
    q, do, out, lse, kv, specs = _two_blocks(torch.float32, False)
    be = get_backend("reference")
    k, v = kv[0]
    good = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    with pytest.raises(ValueError, match="dk_acc must be"):
        be.backward_accumulate(do, q, k, v, out, lse, specs[0], (good[0], good[1][:, :3], good[2]))
    with pytest.raises(ValueError, match="dv_acc must be"):
        be.backward_accumulate(do, q, k, v, out, lse, specs[0], (good[0], good[1], good[2].half()))
    with pytest.raises(ValueError, match="grads must be"):
        be.backward_accumulate(do, q, k, v, out, lse, specs[0], good[:2])


def test_plain_backends_do_not_accumulate():
    """sdpa (a PlainBackend) answers False; ``auto`` asks its first backend."""
    from ringfa4.kernels import PlainBackend

    q, do, out, lse, kv, specs = _two_blocks(torch.float32, False)
    acc = (torch.zeros_like(q), torch.zeros_like(kv[0][0]), torch.zeros_like(kv[0][1]))
    assert PlainBackend().backward_accumulate(do, q, *kv[0], out, lse, specs[0], acc) is False
    assert all((a == 0).all() for a in acc)
