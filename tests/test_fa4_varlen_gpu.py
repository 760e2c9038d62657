"""The packed (varlen) fp32 FA4 kernels on the GPU (sm90 / H200) against float64 attention.

* ``fa4.varlen_fwd``: the fp32 block output is at least as close to float64 as FA4's own bf16
  varlen output, rounds to it, its lse matches FA4's (and -inf where a row sees no key, out 0);
  written into a row slice of a bigger out buffer and a column slice of an lse buffer; and it is
  what ``Fa4Backend.forward`` returns for a varlen call with an fp32 ``out`` (no widening).
* ``Fa4Backend.backward_accumulate`` on varlen blocks: one call's gradients, added into row-slice
  views of pre-filled fp32 buffers, are within 1.1x of FA4's own bf16 varlen backward's error (the
  yardstick of ``test_fa4_bwd_accum.py``) and no worse than it; two kv blocks (each document's keys
  split in two, ring-like) accumulate to the one-call sum.

Documents of mixed lengths, one-token ones, ``len_q != len_k`` (causal bottom-right per document:
rows that see no key), GQA / MHA, windows, softcap, d = 64 / 128.
"""

import importlib.util

import pytest
import torch
from helpers import random_cu_seqlens, reference_grads, rel_err

from ringfa4.kernels import AttnSpec

pytestmark = pytest.mark.gpu

DOCS = [(300, 200), (1, 1), (1, 7), (9, 1), (640, 640), (129, 500), (64, 63), (1000, 1000)]
CASES = [  # (name, h, h_kv, d, AttnSpec kwargs)
    ("gqa_causal", 8, 2, 128, dict(causal=True)),
    ("mha_full", 4, 4, 128, dict()),
    ("gqa_window", 8, 2, 128, dict(window=(96, 32))),
    ("mha_causal_window", 4, 4, 128, dict(causal=True, window=(128, None))),
    ("gqa_softcap_causal", 4, 2, 128, dict(causal=True, softcap=30.0, softmax_scale=0.1)),
    ("d64_gqa_causal", 8, 2, 64, dict(causal=True)),
]


@pytest.fixture(scope="module")
def fa4():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fp32 varlen kernels run on sm90 (Hopper); sm100 uses FA4's own, widened")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed")
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    return _flash_attn_fwd, _flash_attn_bwd


def _pack(h, h_kv, d, kw, docs=DOCS, seed=0):
    lq, lk = [a for a, _ in docs], [b for _, b in docs]
    cu_q, cu_k = random_cu_seqlens(lq, device="cuda"), random_cu_seqlens(lk, device="cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(sum(lq), h, d), mk(sum(lk), h_kv, d), mk(sum(lk), h_kv, d), mk(sum(lq), h, d)
    spec = AttnSpec(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk), **kw)
    return q, k, v, do, spec


def _fa4_kw(spec: AttnSpec, d: int) -> dict:
    return dict(softmax_scale=spec.scale(d), causal=spec.causal, softcap=spec.softcap,
                window_size_left=spec.window_left, window_size_right=spec.window_right,
                cu_seqlens_q=spec.cu_seqlens_q, cu_seqlens_k=spec.cu_seqlens_k,
                max_seqlen_q=spec.max_seqlen_q, max_seqlen_k=spec.max_seqlen_k)


def _ref_kw(spec: AttnSpec) -> dict:
    return dict(causal=spec.causal, window=spec.window, softcap=spec.softcap, softmax_scale=spec.softmax_scale,
                cu_seqlens_q=spec.cu_seqlens_q, cu_seqlens_k=spec.cu_seqlens_k)


@pytest.mark.parametrize("name,h,h_kv,d,kw", CASES, ids=[c[0] for c in CASES])
def test_varlen_fp32_forward_vs_float64(fa4, name, h, h_kv, d, kw):
    from ringfa4.kernels.fa4.backend import Fa4Backend
    from ringfa4.kernels.fa4.varlen_fwd import fa4_forward_fp32_varlen

    fwd, _ = fa4
    q, k, v, do, spec = _pack(h, h_kv, d, kw)
    total = q.shape[0]
    out_buf = torch.full((total + 5, h, d), 7.0, device="cuda")
    lse_buf = torch.full((h, total + 9), 7.0, device="cuda")
    out, lse, key = fa4_forward_fp32_varlen(q, k, v, spec, out=out_buf[3:3 + total], lse=lse_buf[:, 4:4 + total])
    assert key.varlen and out.data_ptr() == out_buf[3].data_ptr()
    assert (out_buf[:3] == 7).all() and (out_buf[3 + total:] == 7).all()
    assert (lse_buf[:, :4] == 7).all() and (lse_buf[:, 4 + total:] == 7).all()
    out16, lse16 = fwd(q, k, v, return_lse=True, **_fa4_kw(spec, d))[:2]
    ref, ref_lse = reference_grads(q, k, v, do, **_ref_kw(spec))[:2]
    err32, err16 = (out.double() - ref).abs(), (out16.double() - ref).abs()
    report = (f"{name}: mean err fp32 {err32.mean():.3g} vs bf16 {err16.mean():.3g}, "
              f"max {err32.max():.3g} vs {err16.max():.3g}")
    print(report)
    assert torch.isfinite(out).all() and err32.mean() <= err16.mean() and err32.max() <= err16.max(), report
    torch.testing.assert_close(out.to(torch.bfloat16), out16, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(lse, lse16, rtol=1e-5, atol=1e-5)  # -inf rows must match too
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    empty = torch.isinf(ref_lse).t()  # (total, h) rows that see no key: out exactly 0
    if spec.causal:
        assert empty.any(), "no row without keys: the DOCS lost their len_q > len_k document"
    assert (out[empty] == 0).all(), name
    # the backend serves an fp32-out varlen call with this kernel (no bf16 result widened)
    o2 = torch.empty(total, h, d, device="cuda")
    o2, l2 = Fa4Backend().forward(q, k, v, spec, out=o2)
    assert torch.equal(o2, out) and torch.equal(l2, lse), name


@pytest.mark.parametrize("name,h,h_kv,d,kw", CASES, ids=[c[0] for c in CASES])
def test_varlen_backward_accumulate_vs_float64(fa4, name, h, h_kv, d, kw):
    from ringfa4.kernels.fa4.backend import Fa4Backend

    fwd, bwd = fa4
    q, k, v, do, spec = _pack(h, h_kv, d, kw, seed=1)
    be = Fa4Backend()
    out = torch.empty(q.shape, device="cuda")
    out, lse = be.forward(q, k, v, spec, out=out)  # fp32 out, as a ring's merged one
    stock = bwd(q, k, v, out.to(q.dtype), do, lse, **_fa4_kw(spec, d), deterministic=False)[:3]
    ref = reference_grads(q, k, v, do, **_ref_kw(spec))[2:]
    bufs, views, init = [], [], []
    for t in (q, k, v):
        buf = torch.full((t.shape[0] + 4,) + tuple(t.shape[1:]), 7.0, device="cuda")
        view = buf[1:1 + t.shape[0]]
        view.copy_(torch.rand(view.shape, device="cuda"))  # accumulators already hold earlier steps' sums
        bufs.append(buf)
        views.append(view)
        init.append(view.clone())
    assert be.backward_accumulate(do, q, k, v, out, lse, spec, tuple(views)) is True
    report = []
    for gname, buf, view, i0, st, r64, t in zip("qkv", bufs, views, init, stock, ref, (q, k, v)):
        assert (buf[0] == 7).all() and (buf[1 + t.shape[0]:] == 7).all(), gname
        ours = view - i0
        e_ours, e_stock = rel_err(ours, r64), rel_err(st, r64)
        report.append(f"d{gname}: fp32 accum {e_ours:.3g}, FA4 bf16 {e_stock:.3g}")
        assert e_ours <= 1.1 * e_stock + 1e-5, (name, report[-1])
    print(f"{name}: " + "; ".join(report))


@pytest.mark.parametrize("h,h_kv", [(8, 2), (4, 4)])
def test_two_kv_blocks_accumulate_to_one_call(fa4, h, h_kv):
    """Non-causal documents whose keys are cut in two (two ring steps with the merged out / lse):
    the two blocks' sums equal one call's up to fp32 atomics order."""
    from ringfa4.kernels.fa4.backend import Fa4Backend

    d = 128
    docs = [(200, 300), (1, 2), (5, 9), (700, 700), (64, 2)]
    q, k, v, do, spec = _pack(h, h_kv, d, {}, docs=docs, seed=2)
    be = Fa4Backend()
    out, lse = be.forward(q, k, v, spec, out=torch.empty(q.shape, device="cuda"))
    one = tuple(torch.zeros(t.shape, device="cuda") for t in (q, k, v))
    assert be.backward_accumulate(do, q, k, v, out, lse, spec, one)
    two = tuple(torch.zeros(t.shape, device="cuda") for t in (q, k, v))
    starts = spec.cu_seqlens_k.tolist()
    for part in range(2):  # every document's first half of keys, then its second half
        pieces = [(s, b // 2) if part == 0 else (s + b // 2, b - b // 2) for s, (_, b) in zip(starts, docs)]
        rows = torch.cat([torch.arange(a, a + n) for a, n in pieces]).cuda()
        lens = [n for _, n in pieces]
        blk = spec.replace(cu_seqlens_k=random_cu_seqlens(lens, device="cuda"), max_seqlen_k=max(lens))
        dk, dv = (torch.zeros(rows.numel(), h_kv, d, device="cuda") for _ in "kv")
        assert be.backward_accumulate(do, q, k[rows], v[rows], out, lse, blk, (two[0], dk, dv))
        two[1].index_add_(0, rows, dk)
        two[2].index_add_(0, rows, dv)
    for gname, a, b in zip("qkv", one, two):
        assert rel_err(b, a) < 1e-5, (gname, rel_err(b, a))
