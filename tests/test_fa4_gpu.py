"""The fa4 backend on a real GPU (Hopper / Blackwell), bf16, against float64 ground truth.

Criterion (DESIGN.md): each of out, lse, dq, dk, dv has a relative L2 error against float64 of at
most 2x the error of torch float32 math on the same bf16 inputs, plus 1e-3. The float32 baseline's
out/dq/dk/dv are rounded to bf16 like any bf16 kernel's results (its lse stays float32).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import _dense64, random_cu_seqlens, random_qkv, reference_grads, rel_err

from ringfa4.kernels import AttnSpec

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def fa4():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("fa4 needs a Hopper (sm90) or Blackwell (sm100) GPU")
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
    from ringfa4.kernels.fa4.backend import Fa4Backend
    return Fa4Backend()


def _math(q, k, v, dout, dtype, causal=False, window=(None, None), softcap=0.0, softmax_scale=None,
          cu_seqlens_q=None, cu_seqlens_k=None):
    """(out, lse, dq, dk, dv) of the helpers' attention math run in ``dtype`` (autograd)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is None:
        out, lse = _dense64(q, k, v, causal, window, softcap, scale)
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        parts = [_dense64(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
                          causal, window, softcap, scale) for i in range(len(cq) - 1)]
        out = torch.cat([o[0] for o, _ in parts], 0)
        lse = torch.cat([l[0] for _, l in parts], -1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return out.detach(), lse.detach(), dq, dk, dv


def _assert_close(got: dict, q, k, v, dout, kw: dict, grads: bool = True) -> None:
    """Check FA4's results against float64, with float32 math as the yardstick."""
    ref = dict(zip(("out", "lse", "dq", "dk", "dv"), reference_grads(q, k, v, dout, **kw)))
    base = dict(zip(("out", "lse", "dq", "dk", "dv"), _math(q, k, v, dout, torch.float32, **kw)))
    report = {}
    for name, x in got.items():
        b = base[name] if name == "lse" else base[name].to(BF16)
        err, err32 = rel_err(x, ref[name]), rel_err(b, ref[name])
        report[name] = (err, err32)
        assert x.dtype == (torch.float32 if name == "lse" else BF16), (name, x.dtype)
        assert err <= 2 * err32 + 1e-3, f"{name}: error {err:.3g} vs float32 math {err32:.3g}; all: {report}"
    if grads:
        assert set(got) == set(ref)
    print("error vs float64 (fa4, float32 math):", {n: f"{e:.2e}, {b:.2e}" for n, (e, b) in report.items()})


def _run(fa4, q, k, v, dout, kw: dict, grads: bool = True) -> dict:
    spec = AttnSpec(**kw)
    out, lse = fa4.forward(q, k, v, spec)
    got = {"out": out, "lse": lse}
    if grads:
        got.update(zip(("dq", "dk", "dv"), fa4.backward(dout, q, k, v, out, lse, spec)))
    math_kw = {n: x for n, x in kw.items() if n not in ("deterministic", "max_seqlen_q", "max_seqlen_k")}
    _assert_close(got, q, k, v, dout, math_kw, grads)
    return got


DENSE = [  # (b, s_q, s_k, h, h_kv, d, AttnSpec kwargs)
    (2, 200, 333, 8, 2, 128, dict(causal=True)),  # GQA, causal with s_q < s_k (bottom-right)
    (2, 300, 170, 4, 4, 64, dict(causal=True)),  # s_q > s_k: the first 130 rows see no key
    (1, 256, 192, 6, 1, 64, dict()),  # MQA, no mask
    (2, 300, 300, 4, 2, 128, dict(window=(64, 16))),
    (1, 257, 513, 4, 4, 128, dict(causal=True, window=(50, None))),
    (2, 200, 300, 4, 4, 64, dict(window=(0, None))),  # anti-causal: keys at or after the diagonal
    (1, 128, 128, 4, 4, 128, dict(window=(0, 0))),  # the diagonal only
    (1, 300, 100, 4, 2, 128, dict(window=(10, 5))),  # window with rows that see no key
    (2, 256, 256, 8, 4, 128, dict(causal=True, softcap=20.0, softmax_scale=0.2)),
    (1, 384, 384, 8, 2, 128, dict(causal=True, deterministic=True)),
]


def _id(kw: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in kw.items()).replace(" ", "") or "full"


@pytest.mark.parametrize("case", DENSE, ids=[f"{_id(c[-1])}-{c[1]}x{c[2]}-h{c[3]}:{c[4]}-d{c[5]}" for c in DENSE])
def test_dense_matches_reference(fa4, case):
    b, s_q, s_k, h, h_kv, d, kw = case
    q, k, v, dout = random_qkv(b, s_q, s_k, h, h_kv, d, dtype=BF16, device="cuda", seed=s_q + s_k)
    got = _run(fa4, q, k, v, dout, kw)
    if kw.get("deterministic"):
        again = fa4.backward(dout, q, k, v, got["out"], got["lse"], AttnSpec(**kw))
        for name, x in zip(("dq", "dk", "dv"), again):
            assert torch.equal(x, got[name]), f"deterministic backward changed {name}"


def _single_forward(fa4, call: tuple, want: tuple, replay: bool, monkeypatch) -> tuple:
    """``fa4.forward(q, k, v, spec)`` of ``call`` without given outputs, checked bit for bit against
    FA4's own ``want = (out, lse)``; ``replay``: the call must replay a prepared plan (neither the
    checked path nor FA4's entry point runs, nothing compiles)."""
    from ringfa4.kernels.fa4 import compile_count

    before = compile_count()
    if replay:
        monkeypatch.setattr(fa4, "_forward_plain", lambda *a: pytest.fail("the checked path ran again"))
    out, lse = fa4.forward(*call)
    monkeypatch.undo()
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), (replay, (out - want[0]).abs().max())
    assert out.dtype == BF16 and out.is_contiguous()
    assert not replay or compile_count() == before
    return out, lse


@pytest.mark.parametrize("case", DENSE[:9], ids=[f"{_id(c[-1])}-h{c[3]}:{c[4]}-d{c[5]}" for c in DENSE[:9]])
def test_single_call_forward_is_fa4s_own_and_replays(fa4, case, monkeypatch):
    """A call without given outputs (``cp=None``) runs FA4's own sm90 forward kernel through a
    prepared plan (:func:`~ringfa4.kernels.fa4.fp32_forward.prepare_plain`): bit for bit FA4's
    ``flash_attn_func`` (its tile config and pack-GQA default); the second call of the same
    signature, on other tensors, replays the launch: no checked path, no compile."""
    from flash_attn.cute import interface

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the prepared single-call forward is sm90's (sm100 keeps FA4's entry point)")
    b, s_q, s_k, h, h_kv, d, kw = case
    spec = AttnSpec(**kw)
    fa4_kw = dict(causal=spec.causal, softmax_scale=spec.scale(d), softcap=float(spec.softcap),
                  window_size=(spec.window_left, spec.window_right), return_lse=True)
    for rep in range(2):
        q, k, v, _ = random_qkv(b, s_q, s_k, h, h_kv, d, dtype=BF16, device="cuda", seed=rep * 31 + s_q)
        want = interface.flash_attn_func(q, k, v, **fa4_kw)
        out, lse = _single_forward(fa4, (q, k, v, spec), want, replay=rep > 0, monkeypatch=monkeypatch)
        assert lse.shape == (b, h, s_q)


# (q lengths, k lengths, h, h_kv, d, AttnSpec kwargs): packed single calls (cp=None, Ulysses' one call)
PLAIN_VARLEN = [
    ([37, 0, 250, 3, 0, 90], [50, 20, 250, 0, 0, 128], 8, 2, 128, dict(causal=True)),  # empty documents
    ([300, 129, 1000], [300, 129, 1000], 4, 4, 128, dict()),
    ([200, 700, 64], [200, 700, 64], 8, 2, 64, dict(window=(40, 8))),
    ([513, 77, 400], [513, 77, 400], 8, 4, 128, dict(causal=True, softcap=15.0, softmax_scale=0.2)),
    ([40] * 300, [40] * 300, 8, 2, 128, dict(causal=True)),  # > 256 documents: FA4 adds its batch-lookup hint
]


@pytest.mark.parametrize("case", PLAIN_VARLEN, ids=[f"{_id(c[-1])}-{len(c[0])}docs-h{c[2]}:{c[3]}-d{c[4]}"
                                                    for c in PLAIN_VARLEN])
def test_single_call_varlen_forward_is_fa4s_own_and_replays(fa4, case, monkeypatch):
    """A packed call without given outputs (``cp=None``, Ulysses on packed documents) runs FA4's own
    sm90 forward kernel through a prepared plan (:func:`~ringfa4.kernels.fa4.varlen_fwd.prepare_plain_varlen`):
    bit for bit FA4's ``flash_attn_varlen_func``; a second call of the same signature (other values,
    other cu_seqlens of the same count and longest document) replays the launch: no checked path,
    no compile."""
    from flash_attn.cute import interface

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the prepared single-call forward is sm90's (sm100 keeps FA4's entry point)")
    lq, lk, h, h_kv, d, kw = case
    for rep in range(2):
        lq_r, lk_r = (lq, lk) if rep == 0 else (lq[::-1], lk[::-1])  # the same documents, another order
        q, k, v, _, cu_kw = _varlen(lq_r, lk_r, h, h_kv, d, seed=rep * 17 + len(lq))
        spec = AttnSpec(**kw, **cu_kw)
        want = interface.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_kw["cu_seqlens_q"], cu_seqlens_k=cu_kw["cu_seqlens_k"],
            max_seqlen_q=cu_kw["max_seqlen_q"], max_seqlen_k=cu_kw["max_seqlen_k"], causal=spec.causal,
            softmax_scale=spec.scale(d), window_size=(spec.window_left, spec.window_right),
            softcap=float(spec.softcap), return_lse=True)
        out, lse = _single_forward(fa4, (q, k, v, spec), want, replay=rep > 0, monkeypatch=monkeypatch)
        assert lse.shape == (h, sum(lq))
    _run(fa4, q, k, v, torch.randn_like(q), {**kw, **cu_kw}, grads=False)  # and against float64


def _single_backward(fa4, call: tuple, want: tuple, exact: dict, replay: bool, monkeypatch) -> None:
    """``fa4.backward(*call)`` (``call = (dout, q, k, v, out, lse, spec)``) against FA4's own ``want
    = (dq, dk, dv)``: bit for bit where ``exact[name]``, else as close to float64 as FA4's (1.05x);
    ``replay``: the call must replay a prepared plan (no checked path, no compile, no host sync)."""
    from ringfa4.kernels.fa4 import compile_count

    dout, q, k, v, out, lse, spec = call
    before = compile_count()
    if replay:
        monkeypatch.setattr(fa4, "_backward_plain", lambda *a: pytest.fail("the checked path ran again"))
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = fa4.backward(*call)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    monkeypatch.undo()
    cu = dict(cu_seqlens_q=spec.cu_seqlens_q, cu_seqlens_k=spec.cu_seqlens_k) if spec.varlen else {}
    ref = reference_grads(q, k, v, dout, causal=spec.causal, window=spec.window, softcap=spec.softcap,
                          softmax_scale=spec.softmax_scale, **cu)[2:]
    for name, x, y, r, t in zip(("dq", "dk", "dv"), got, want, ref, (q, k, v)):
        assert x.dtype == BF16 and x.shape == t.shape and x.is_contiguous(), name
        if exact[name]:
            assert torch.equal(x, y), (replay, name, (x.float() - y.float()).abs().max())
        else:
            assert rel_err(x, r) <= 1.05 * rel_err(y, r) + 1e-6, (replay, name, rel_err(x, r), rel_err(y, r))
    assert not replay or compile_count() == before


PLAIN_BWD = DENSE + [(2, 300, 500, 4, 4, 64, dict(causal=True, deterministic=True))]  # MHA: a dQ semaphore only


@pytest.mark.parametrize("case", PLAIN_BWD, ids=[f"{_id(c[-1])}-h{c[3]}:{c[4]}-d{c[5]}" for c in PLAIN_BWD])
def test_single_call_backward_is_fa4s_own_and_replays(fa4, case, monkeypatch):
    """A dense backward (``cp=None``, Ulysses) runs FA4's own sm90 kernels from a prepared plan
    (:mod:`~ringfa4.kernels.fa4.plain_backward`): FA4's ``_flash_attn_bwd`` results, bit for bit
    where FA4's fp32 atomics cannot reorder (dQ of at most two kv tiles, dK / dV of at most two q
    heads a kv head) and always for deterministic specs (FA4's semaphore-ordered kernel, its
    semaphores zeroed per call), elsewhere as close to float64 as FA4's own (1.05x); the second call
    of the same signature, on other tensors, replays the launches: no checked path, no compile, no
    host sync."""
    from flash_attn.cute import interface

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the prepared single-call backward is sm90's (sm100 keeps FA4's entry point)")
    b, s_q, s_k, h, h_kv, d, kw = case
    spec = AttnSpec(**kw)
    fa4_kw = dict(causal=spec.causal, softmax_scale=spec.scale(d), softcap=float(spec.softcap),
                  window_size_left=spec.window_left, window_size_right=spec.window_right)
    exact = {"dq": math.ceil(s_k / 128) <= 2, "dk": h // h_kv <= 2, "dv": h // h_kv <= 2}
    if spec.deterministic:
        exact = dict.fromkeys(exact, True)
    for rep in range(2):
        q, k, v, dout = random_qkv(b, s_q, s_k, h, h_kv, d, dtype=BF16, device="cuda", seed=rep * 17 + s_k)
        out, lse = fa4.forward(q, k, v, spec)
        want = interface._flash_attn_bwd(q, k, v, out, dout, lse, **fa4_kw, deterministic=spec.deterministic)
        _single_backward(fa4, (dout, q, k, v, out, lse, spec), want, exact, rep > 0, monkeypatch)


PLAIN_VARLEN_BWD = PLAIN_VARLEN[1:] + [  # FA4's varlen backward takes no empty query documents here
    ([37, 128, 250, 5, 90], [60, 128, 200, 5, 1], 8, 2, 128, dict(causal=True, deterministic=True)),
    ([300, 129, 700], [300, 129, 700], 4, 4, 64, dict(causal=True, deterministic=True)),
]


@pytest.mark.parametrize("case", PLAIN_VARLEN_BWD, ids=[f"{_id(c[-1])}-{len(c[0])}docs-h{c[2]}:{c[3]}-d{c[4]}"
                                                        for c in PLAIN_VARLEN_BWD])
def test_single_call_varlen_backward_is_fa4s_own_and_replays(fa4, case, monkeypatch):
    """A packed backward (``cp=None``, Ulysses on packed documents) runs FA4's own sm90 varlen kernels
    from a prepared plan (:mod:`~ringfa4.kernels.fa4.plain_backward`): FA4's ``_flash_attn_bwd``
    results with cu_seqlens, bit for bit for deterministic specs and for dK / dV of at most two q
    heads a kv head, elsewhere as close to float64 as FA4's own (1.05x); the second call of the same
    signature (the same pack, other values) replays the launches: no checked path, no compile, no
    host sync."""
    from flash_attn.cute import interface

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the prepared single-call backward is sm90's (sm100 keeps FA4's entry point)")
    lq, lk, h, h_kv, d, kw = case
    exact = {"dq": bool(kw.get("deterministic")), "dk": h // h_kv <= 2 or bool(kw.get("deterministic"))}
    exact["dv"] = exact["dk"]
    cu_kw = _varlen(lq, lk, h, h_kv, d, seed=0)[4]
    spec = AttnSpec(**kw, **cu_kw)
    fa4_kw = dict(causal=spec.causal, softmax_scale=spec.scale(d), softcap=float(spec.softcap),
                  window_size_left=spec.window_left, window_size_right=spec.window_right, **cu_kw)
    for rep in range(2):
        q, k, v, dout, _ = _varlen(lq, lk, h, h_kv, d, seed=rep * 17 + len(lq))
        out, lse = fa4.forward(q, k, v, spec)
        want = interface._flash_attn_bwd(q, k, v, out, dout, lse, **fa4_kw, deterministic=spec.deterministic)
        _single_backward(fa4, (dout, q, k, v, out, lse, spec), want, exact, rep > 0, monkeypatch)


@pytest.mark.parametrize("deterministic", [True, False])
def test_single_call_backward_takes_strided_views(fa4, deterministic, monkeypatch):
    """The prepared backward takes what FA4's entry point takes as it is: views of last-dim stride 1
    (a head group of bigger q / k / v / out / dout, a row range of a bigger lse, as Ulysses' head
    split and the ring's per-block backward pass them): FA4's ``_flash_attn_bwd`` results on the same
    views (bit for bit: deterministic, or dK / dV of two q heads a kv head and dQ of two kv tiles),
    its plan stored and replayed on other views of the same strides."""
    from flash_attn.cute import interface

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the prepared single-call backward is sm90's (sm100 keeps FA4's entry point)")
    spec = AttnSpec(causal=True, deterministic=deterministic)
    s_q, s_k, d = 200, 256, 128
    for rep in range(2):
        q_all, k_all, v_all, do_all = random_qkv(1, s_q, s_k, 12, 6, d, dtype=BF16, device="cuda", seed=rep + 5)
        q, do = q_all[:, :, 4:8], do_all[:, :, 4:8]  # q heads 4..7 of 12: kv heads 2..3 of 6
        k, v = k_all[:, :, 2:4], v_all[:, :, 2:4]
        out_all, lse_all = fa4.forward(q_all[:, :, 4:8].contiguous(), k.contiguous(), v.contiguous(), spec)
        out = torch.zeros(1, s_q, 12, d, dtype=BF16, device="cuda")
        out[:, :, 4:8] = out_all
        out = out[:, :, 4:8]
        lse_big = torch.zeros(1, 4, s_q + 64, device="cuda")
        lse_big[:, :, 32:32 + s_q] = lse_all
        lse = lse_big.narrow(2, 32, s_q)
        assert not any(t.is_contiguous() for t in (q, k, v, out, do, lse))
        want = interface._flash_attn_bwd(q, k, v, out, do, lse, causal=True, softmax_scale=spec.scale(d),
                                         deterministic=deterministic)
        if rep:
            monkeypatch.setattr(fa4, "_backward_plain", lambda *a: pytest.fail("the checked path ran again"))
        got = fa4.backward(do, q, k, v, out, lse, spec)
        monkeypatch.undo()
        for name, x, y in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(x, y), (rep, name, (x.float() - y.float()).abs().max())


def test_rows_that_see_no_key(fa4):
    """causal with s_q > s_k: rows i < s_q - s_k see nothing: lse -inf, out 0, dq 0."""
    q, k, v, dout = random_qkv(1, 200, 72, 4, 2, 64, dtype=BF16, device="cuda", seed=7)
    spec = AttnSpec(causal=True)
    out, lse = fa4.forward(q, k, v, spec)
    dq, dk, dv = fa4.backward(dout, q, k, v, out, lse, spec)
    blind = 200 - 72
    assert torch.all(lse[:, :, :blind] == -math.inf) and torch.isfinite(lse[:, :, blind:]).all()
    assert torch.all(out[:, :blind] == 0) and torch.all(dq[:, :blind] == 0)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


def _varlen(lq, lk, h, h_kv, d, seed):
    cu_q, cu_k = random_cu_seqlens(lq, "cuda"), random_cu_seqlens(lk, "cuda")
    q, k, v, dout = random_qkv(1, sum(lq), sum(lk), h, h_kv, d, dtype=BF16, device="cuda", seed=seed)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    return q[0], k[0], v[0], dout[0], kw


@pytest.mark.parametrize("mask", [dict(causal=True), dict(), dict(window=(40, 8))], ids=_id)
def test_varlen_forward_with_empty_documents(fa4, mask):
    # documents with no queries, no keys (their queries see nothing), or neither
    lq, lk = [37, 0, 250, 3, 0, 90], [50, 20, 250, 0, 0, 128]
    q, k, v, dout, kw = _varlen(lq, lk, 8, 2, 128, seed=3)
    got = _run(fa4, q, k, v, dout, {**kw, **mask}, grads=False)
    start = sum(lq[:3])  # the document with 3 queries and no key
    assert torch.all(got["lse"][:, start:start + 3] == -math.inf)
    assert torch.all(got["out"][start:start + 3] == 0)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(), dict(window=(40, 8)), dict(causal=True, softcap=15.0)],
                         ids=_id)
def test_varlen_backward(fa4, mask):
    # every document has queries (FA4's backward has crashed on empty query segments: upstream #2562)
    lq, lk = [37, 128, 250, 5, 90], [60, 128, 200, 5, 1]
    q, k, v, dout, kw = _varlen(lq, lk, 8, 2, 128, seed=5)
    _run(fa4, q, k, v, dout, {**kw, **mask})


def test_varlen_backward_empty_query_documents(fa4):
    lq, lk = [0, 64, 0, 130], [30, 64, 0, 200]
    q, k, v, dout, kw = _varlen(lq, lk, 4, 4, 64, seed=11)
    got = _run(fa4, q, k, v, dout, {**kw, "causal": True})
    assert torch.all(got["dk"][:30] == 0) and torch.all(got["dv"][:30] == 0)


def test_out_and_lse_into_strided_views(fa4):
    """out=/lse= may be strided views (slices of bigger buffers); nothing else is written."""
    b, s_q, s_k, h, d = 2, 192, 256, 4, 128
    q, k, v, _ = random_qkv(b, s_q, s_k, h, 2, d, dtype=BF16, device="cuda", seed=1)
    spec = AttnSpec(causal=True)
    ref_out, ref_lse = fa4.forward(q, k, v, spec)
    out_buf = torch.full((b, s_q, 3 * h, d), float("nan"), dtype=BF16, device="cuda")
    lse_buf = torch.full((2, b, h, s_q + 64), 7.0, dtype=torch.float32, device="cuda")
    out_view, lse_view = out_buf[:, :, h:2 * h], lse_buf[1, :, :, 32:32 + s_q]
    assert not out_view.is_contiguous() and not lse_view.is_contiguous()
    out, lse = fa4.forward(q, k, v, spec, out=out_view, lse=lse_view)
    assert out.data_ptr() == out_view.data_ptr() and lse.data_ptr() == lse_view.data_ptr()
    assert torch.equal(out_view, ref_out) and torch.equal(lse_view, ref_lse)
    assert out_buf[:, :, :h].isnan().all() and out_buf[:, :, 2 * h:].isnan().all()
    assert (lse_buf[0] == 7).all() and (lse_buf[1, ..., :32] == 7).all() and (lse_buf[1, ..., 32 + s_q:] == 7).all()
    # varlen: lse (h, total) as a column slice of a wider buffer
    q2, k2, v2, _, kw = _varlen([100, 60], [80, 120], 4, 2, 64, seed=2)
    spec2 = AttnSpec(causal=True, **kw)
    ref_out2, ref_lse2 = fa4.forward(q2, k2, v2, spec2)
    lse_buf2 = torch.zeros(4, 256, dtype=torch.float32, device="cuda")
    _, lse2 = fa4.forward(q2, k2, v2, spec2, lse=lse_buf2[:, 64:224])
    assert torch.equal(lse2, ref_lse2) and (lse_buf2[:, :64] == 0).all() and (lse_buf2[:, 224:] == 0).all()


def test_backward_takes_fp32_merged_out(fa4):
    q, k, v, dout = random_qkv(1, 128, 256, 4, 4, 64, dtype=BF16, device="cuda", seed=4)
    spec = AttnSpec(causal=True)
    out, lse = fa4.forward(q, k, v, spec)
    bf = fa4.backward(dout, q, k, v, out, lse, spec)
    f32 = fa4.backward(dout.float(), q, k, v, out.float(), lse, spec)
    assert all(torch.equal(a, b) for a, b in zip(bf, f32))


def test_refuses_fp32_inputs(fa4):
    from ringfa4.kernels.fa4.backend import Fa4Unsupported

    q = torch.randn(1, 64, 2, 64, device="cuda")
    with pytest.raises(Fa4Unsupported, match="fp16/bf16"):
        fa4.forward(q, q, q, AttnSpec())
