"""FA4 backward accumulated in fp32 across ring blocks (ringfa4.kernels.fa4.bwd_accum).

CPU (CI): prepare + accumulate + finish run under ``FakeTensorMode`` in a subprocess that targets
sm_90a (this file run as a script), compiling FA4's preprocess, main kernel and dQ postprocess; the
main kernel's PTX shows dK and dV leaving as fp32 reduce-adds (``cp.reduce.async.bulk ... add.f32``,
one per warp group each, next to dQ's) and no TMA tensor store, for MHA too. The same for sm_100a
(FA4's sm100 kernel with its fp32 dK / dV path pinned on, 2-CTA clusters for d = 128; compiled only:
no Blackwell GPU has run it).
GPU (``-m gpu``, Hopper): ring-like blocks (q split unaligned to the tile, 4 kv blocks, causal /
windows / softcap / GQA / s_q != s_k) accumulated into one state, against float64 attention and
against per-block FA4 backward calls summed in fp32.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import cute_compile
import pytest
import torch

# (name, (b, s_q, s_k, h, h_kv, d), kwargs): blocks q[q0:] vs k[:s_k] (fake tensors: compile only)
COMPILE_CASES = [
    ("mha_causal_unaligned_q", (2, 300, 200, 4, 4, 128), dict(causal=True, q0=100)),
    ("mha_full", (2, 256, 384, 4, 4, 128), dict(causal=False)),
    ("gqa_window", (2, 384, 512, 8, 2, 128), dict(window=(96, 32), q0=64, q1=300)),
    ("mha_d64_softcap_causal", (2, 384, 384, 4, 4, 64), dict(causal=True, softcap=30.0)),
    ("mha_d192_full", (1, 200, 300, 2, 2, 192), dict(causal=False)),  # dKV_swapAB config
]
SM100_CASES = [  # d = 128: 2-CTA clusters (kv rounded to tile pairs); d = 64 / 96: one CTA
    ("mha_causal_unaligned_q", (2, 300, 200, 4, 4, 128), dict(causal=True, q0=100)),
    ("gqa_window", (2, 384, 512, 8, 2, 128), dict(window=(96, 32), q0=64, q1=300)),
    ("mha_d64_softcap_causal", (2, 384, 384, 4, 4, 64), dict(causal=True, softcap=30.0)),
    ("mha_d96_full", (1, 200, 300, 2, 2, 96), dict(causal=False)),
]
CASES = {"sm_90a": COMPILE_CASES, "sm_100a": SM100_CASES}


def _compile_cases(arch: str) -> list[dict]:
    """Subprocess side (FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH set): compile every case; check PTX."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringfa4.kernels.fa4 import bwd_accum as acc
    from ringfa4.kernels.fa4 import bwd_plan as fa4_bwd_plan

    results = []
    for name, (b, s_q, s_k, h, h_kv, d), kw in CASES[arch]:
        t0 = time.perf_counter()
        kw = dict(kw)
        softcap = kw.pop("softcap", 0.0)
        with FakeTensorMode():
            q = torch.empty(b, s_q, h, d, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(b, h, s_q, dtype=torch.float32, device="cuda")
            kv = torch.empty(b, s_k, h_kv, d, dtype=torch.bfloat16, device="cuda")
            dkv = torch.empty(b, s_k, h_kv, d, dtype=torch.float32, device="cuda")
            state = acc.prepare(q, q, q, lse, softmax_scale=d ** -0.5, softcap=softcap)
            key = acc.accumulate(state, kv, kv, dkv, dkv, **kw)
            dq = acc.finish(state)
        assert dq.shape == q.shape and dq.dtype == q.dtype, name
        assert key.qhead_per_kvhead == h // h_kv, (name, key)
        ptx = acc._CACHE[key].__ptx__
        assert isinstance(ptx, str) and f".target {arch}" in ptx, (name, "no PTX for", arch)
        assert acc._CACHE[key].__cubin__, (name, "no cubin")
        adds = re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32", ptx)
        if arch == "sm_90a":
            cfg = fa4_bwd_plan._sm90_config(d)
            wg_dq = 1 if cfg.dQ_single_wg else cfg.num_wg
            # dQ, dK, dV chunks per warp group (local: a second dK / dV epilogue adds the zeros of kv tiles
            # no query sees)
            assert len(adds) == wg_dq + 2 * cfg.num_wg * (2 if key.local else 1), (name, len(adds))
        else:  # dQ's reduce-adds and at least one each for dK and dV (FA4's stock MHA kernel has none)
            assert len(adds) >= 3, (name, len(adds))
            assert state.plan.cluster_size == (2 if d >= 128 else 1), (name, state.plan)
        assert not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx), (name, "TMA store of dK/dV")
        results.append(dict(name=name, seconds=round(time.perf_counter() - t0, 2), key=repr(key)))
    results.append(_compile_head_group())
    return results


def _compile_head_group() -> dict:
    """The ring's head groups: a state of q heads [2, 4) (views of the whole state's tensors) adding
    into its kv head's TileKVLayout buffer, and FA4's dK / dV postprocess writing the sums into a head
    slice of bf16 dk / dv (``TileKVLayout.write``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringfa4.kernels.fa4 import bwd_accum as acc

    t0 = time.perf_counter()
    with FakeTensorMode():
        q = torch.empty(1, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(1, 4, 256, dtype=torch.float32, device="cuda")
        kv = torch.empty(1, 320, 2, 128, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, 320, 2, 128, dtype=torch.bfloat16, device="cuda")
        state = acc.prepare(q, q, q, lse, softmax_scale=128 ** -0.5).heads(2, 4)
        k_g = kv.narrow(2, 1, 1)
        layout = acc.TileKVLayout(state, k_g, 320)
        buf = torch.empty(layout.numel, dtype=torch.float32, device="cuda")
        key = acc.accumulate_tiles(state, k_g, k_g, *layout.cols(buf, 320, 0, 320), causal=True)
        layout.write(buf, 320, out.narrow(2, 1, 1), out.narrow(2, 1, 1))
    assert key.qhead_per_kvhead == 2 and acc._CACHE[key].__cubin__, key
    return dict(name="head_group_write", seconds=round(time.perf_counter() - t0, 2), key=repr(key))


@pytest.fixture(scope="module")
def compile_run(tmp_path_factory):
    from ringfa4.kernels.registry import fa4_installed

    if not fa4_installed():
        pytest.skip("needs flash-attn-4 and nvidia-cutlass-dsl (pip install 'ringfa4[gpu]')")
    runs = {}
    for arch, (fa_arch, sms) in {"sm_90a": ("sm_90", "132"), "sm_100a": ("sm_100", "148")}.items():
        tmp = tmp_path_factory.mktemp(f"fa4_bwd_accum_{arch}")
        result, log = tmp / "result.json", tmp / "log.txt"
        env = dict(FLASH_ATTENTION_ARCH=fa_arch, CUTE_DSL_ARCH=arch, FLASH_ATTENTION_NUM_SMS=sms,
                   FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", CUTE_DSL_KEEP="ptx,cubin",
                   CUTE_DSL_DUMP_DIR=str(tmp))
        runs[arch] = (cute_compile.start(__file__, [arch, str(result)], env, log), result, log)
    yield runs
    cute_compile.stop([proc for proc, _, _ in runs.values()])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_bwd_accum_compiles(compile_run, arch):
    proc, result, log = compile_run[arch]
    cute_compile.wait_ok(proc, log, arch, timeout=300)
    results = json.loads(result.read_text())
    assert [r["name"] for r in results] == [c[0] for c in CASES[arch]] + ["head_group_write"]
    print(f"\n{arch}: " + ", ".join(f"{r['name']} {r['seconds']}s" for r in results))


def test_can_implement():
    from ringfa4.kernels.fa4.bwd_accum import can_implement

    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed")
    for d in (64, 96, 128, 192, 256):
        assert can_implement(90, torch.bfloat16, d), d
    assert can_implement(90, torch.float16, 128)
    for d in (64, 96, 128):
        assert can_implement(100, torch.bfloat16, d), d
    assert not can_implement(100, torch.bfloat16, 192)  # sm100: tile_hdim <= 128 (256: a kernel without dq_accum)
    assert not can_implement(100, torch.bfloat16, 256)
    assert not can_implement(120, torch.bfloat16, 128)
    assert not can_implement(90, torch.float32, 128)
    assert not can_implement(90, torch.bfloat16, 192, 128)
    assert not can_implement(90, torch.bfloat16, 72)  # FA4's kernel (80) and accumulator (96) roundings differ


def test_prepare_rejects(monkeypatch):
    from ringfa4.kernels.fa4 import bwd_accum as acc

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    for args, kw in [((q.float(), q, q, lse), {}), ((q, q[:, :4], q, lse), {}), ((q, q, q, lse[..., :4]), {}),
                     ((q, q, q, lse), dict(deterministic=True))]:
        with pytest.raises(ValueError):
            acc.prepare(*args, softmax_scale=0.1, **kw)
    if importlib.util.find_spec("flash_attn") is None:
        return
    monkeypatch.setattr(acc, "_arch", lambda: 120)
    with pytest.raises(ValueError, match="sm120"):
        acc.prepare(q, q, q, lse, softmax_scale=0.1)


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # (name, (b, s_q, s_k, h, h_kv, d), kwargs)
    ("mha_causal", (2, 512, 512, 4, 4, 128), dict(causal=True)),
    ("mha_full_sq<sk", (2, 384, 640, 4, 4, 128), dict(causal=False)),
    ("mha_causal_sq>sk", (1, 640, 384, 4, 4, 128), dict(causal=True)),
    ("gqa_causal", (2, 512, 512, 8, 2, 128), dict(causal=True)),
    ("gqa_window", (1, 300, 700, 8, 2, 128), dict(causal=False, window=(96, 32))),
    ("mha_d64_causal", (2, 640, 640, 4, 4, 64), dict(causal=True)),
    ("mha_softcap_full", (2, 384, 384, 4, 4, 128), dict(causal=False, softcap=30.0, softmax_scale=0.1)),
    ("gqa_d256_causal", (1, 384, 384, 4, 2, 256), dict(causal=True)),
]


@pytest.fixture(scope="module")
def gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("needs a Hopper (sm90) or Blackwell (sm100) GPU")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed")
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    return _flash_attn_fwd, _flash_attn_bwd


def _blocks(s_q: int, s_k: int, causal: bool, window) -> list:
    """Ring-like blocks: q in 2 segments (split off the tile grid), kv in 4, under the global
    bottom-right mask (q token i sits at global position i + s_k - s_q)."""
    from ringfa4.parallel.blocks import band_block, global_band

    lo, hi = global_band(causal, window)
    q_cuts, k_cuts = [0, s_q // 3 + 5, s_q], [round(i * s_k / 4) for i in range(5)]
    blocks = []
    for qa, qb in zip(q_cuts, q_cuts[1:]):
        for ka, kb in zip(k_cuts, k_cuts[1:]):
            blk = band_block((qa, qa + s_k - s_q, qb - qa), (ka, ka, kb - ka), lo, hi)
            if blk is not None:
                blocks.append(blk)
    return blocks


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape,kw", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_ring_accumulation_vs_float64(gpu, name, shape, kw):
    from helpers import reference_grads, rel_err

    from ringfa4.kernels.fa4 import bwd_accum as acc

    fwd, bwd = gpu
    b, s_q, s_k, h, h_kv, d = shape
    if not acc.can_implement(acc._arch(), torch.bfloat16, d):
        pytest.skip(f"sm{acc._arch()}: FA4's accumulating backward takes head_dim <= 128 here, not {d}")
    causal, window = kw.get("causal", False), kw.get("window", (None, None))
    softcap, scale = kw.get("softcap", 0.0), kw.get("softmax_scale", d ** -0.5)
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(b, s_q, h, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d), mk(b, s_q, h, d)
    common = dict(softmax_scale=scale, causal=causal, softcap=softcap, window_size_left=window[0],
                  window_size_right=window[1])
    out, lse = fwd(q, k, v, return_lse=True, **common)[:2]
    full = bwd(q, k, v, out, dout, lse, **common)

    state = acc.prepare(q, out, dout, lse, softmax_scale=scale, softcap=softcap)
    dk32 = torch.zeros(b, s_k, h_kv, d, device="cuda")
    dv32 = torch.zeros_like(dk32)
    summed = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]  # bf16 block grads summed in fp32
    blocks = _blocks(s_q, s_k, causal, window)
    assert any(blk.q0 % state.plan.tile_m for blk in blocks), "no block off the tile grid"
    for blk in blocks:
        r, c = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
        acc.accumulate(state, k[:, c], v[:, c], dk32[:, c], dv32[:, c], q0=blk.q0, q1=blk.q1, causal=blk.causal,
                       window=blk.window)
        grads = bwd(q[:, r], k[:, c], v[:, c], out[:, r], dout[:, r], lse[:, :, r], softmax_scale=scale,
                    causal=blk.causal, softcap=softcap, window_size_left=blk.window[0],
                    window_size_right=blk.window[1])
        for s, gr, sl in zip(summed, grads[:3], (r, c, c)):
            s[:, sl] += gr.float()
    dq32 = acc.finish(state, torch.float32)
    dq16 = acc.finish(state)
    # the fp32 gather reads FA4's dQ tile order exactly as its postprocess does
    assert torch.equal(dq16, dq32.to(torch.bfloat16)), name

    ref = reference_grads(q, k, v, dout, causal=causal, window=window, softcap=softcap, softmax_scale=scale)[2:]
    report = []
    for gname, ours, blk_sum, stock, r64 in zip("qkv", (dq32, dk32, dv32), summed, full[:3], ref):
        e_ours, e_sum, e_full = rel_err(ours, r64), rel_err(blk_sum, r64), rel_err(stock, r64)
        report.append(f"d{gname}: fp32 accum {e_ours:.3g}, bf16 blocks {e_sum:.3g}, FA4 full {e_full:.3g}")
        assert e_ours <= 1.1 * e_full + 1e-5, (name, report[-1])
        assert e_ours <= e_sum + 1e-6, (name, report[-1])
        assert rel_err(ours, blk_sum.double()) <= 3 * e_full + 1e-3, (name, report[-1])
    print(f"{name}: " + "; ".join(report))


@pytest.mark.gpu
def test_states_are_independent(gpu):
    """Two states (e.g. two ring backward calls in flight) and an fp32 dq written into a strided view."""
    from ringfa4.kernels.fa4 import bwd_accum as acc

    fwd, _ = gpu
    b, s, h, d = 1, 256, 2, 128
    g = torch.Generator().manual_seed(2)
    mk = lambda *sh: torch.randn(*sh, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(b, s, h, d), mk(b, s, h, d), mk(b, s, h, d), mk(b, s, h, d)
    out, lse = fwd(q, k, v, softmax_scale=d ** -0.5, causal=True, return_lse=True)[:2]
    res = []
    for _ in range(2):
        state = acc.prepare(q, out, dout, lse, softmax_scale=d ** -0.5)
        dk, dv = torch.zeros(b, s, h, d, device="cuda"), torch.zeros(b, s, h, d, device="cuda")
        acc.accumulate(state, k, v, dk, dv, causal=True)
        buf = torch.full((b, s, 2 * h, d), float("nan"), device="cuda")
        dq = acc.finish(state, torch.float32, out=buf[:, :, ::2])
        assert torch.isnan(buf[:, :, 1::2]).all()
        res.append((dq.clone(), dk, dv))
    for x, y in zip(*res):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)  # atomics: order may differ


@pytest.mark.gpu
@pytest.mark.parametrize("s_k,h_kv", [(512, 4), (500, 2)])
def test_tile_layout_equals_dense(gpu, s_k, h_kv):
    """accumulate_tiles into one TileKVLayout buffer (blocks at every multiple of the layout's kv
    alignment: sm90 128, sm100 2-CTA 256; no scratch, no gather) gives the dense accumulate's dq,
    dk, dv up to the order of fp32 atomics."""
    from ringfa4.kernels.fa4 import bwd_accum as acc

    fwd, _ = gpu
    b, s_q, h, d = 1, 448, 4, 128
    g = torch.Generator().manual_seed(3)
    mk = lambda *sh: torch.randn(*sh, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, dout = mk(b, s_q, h, d), mk(b, s_q, h, d)
    k, v = mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d)
    out, lse = fwd(q, k, v, softmax_scale=d ** -0.5, causal=True, return_lse=True)[:2]
    dense_state, tile_state = (acc.prepare(q, out, dout, lse, softmax_scale=d ** -0.5) for _ in range(2))
    layout = acc.TileKVLayout(tile_state, k, s_k)
    align = layout.align
    assert align == (128 if acc._arch() // 10 == 9 else 256), align  # d = 128
    buf = torch.zeros(layout.numel, device="cuda")
    dk, dv = torch.zeros(b, s_k, h_kv, d, device="cuda"), torch.zeros(b, s_k, h_kv, d, device="cuda")
    cuts = list(range(0, s_k, align)) + [s_k]
    for qa, qb in ((0, 150), (150, s_q)):
        for ka, kb in zip(cuts, cuts[1:]):
            c, kw = slice(ka, kb), dict(q0=qa, q1=qb, window=(None, None))
            acc.accumulate(dense_state, k[:, c], v[:, c], dk[:, c], dv[:, c], **kw)
            acc.accumulate_tiles(tile_state, k[:, c], v[:, c], *layout.cols(buf, s_k, ka, kb), **kw)
    with pytest.raises(ValueError, match=f"multiple of {align}"):
        layout.cols(buf, s_k, 100, 200)
    tk, tv = layout.dense(buf, s_k)
    for x, y in ((tk, dk), (tv, dv), (acc.finish(tile_state, torch.float32), acc.finish(dense_state, torch.float32))):
        assert x.abs().max() > 0
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("h,h_kv,s_k", [(4, 4, 512), (8, 2, 500)])
def test_head_groups_in_place_and_write(gpu, h, h_kv, s_k):
    """The ring's kv-head groups: states of q heads [0, h/2) and [h/2, h) (views sharing one dq
    accumulator) each add dK / dV into their own TileKVLayout buffer in place, and FA4's postprocess
    writes the sums into head slices of bf16 dk / dv (every element, also past the last full kv
    tile): equal to the whole-head state's dense gather rounded once, dq equal too."""
    from ringfa4.kernels.fa4 import bwd_accum as acc

    fwd, _ = gpu
    b, s_q, d = 1, 384, 128
    g = torch.Generator().manual_seed(4)
    mk = lambda *sh: torch.randn(*sh, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, dout, k, v = mk(b, s_q, h, d), mk(b, s_q, h, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d)
    out, lse = fwd(q, k, v, softmax_scale=d ** -0.5, causal=True, return_lse=True)[:2]
    whole, grouped = (acc.prepare(q, out, dout, lse, softmax_scale=d ** -0.5) for _ in range(2))
    lay = acc.TileKVLayout(whole, k, s_k)
    buf = torch.zeros(lay.numel, device="cuda")
    acc.accumulate_tiles(whole, k, v, *lay.cols(buf, s_k, 0, s_k), causal=True)
    dk_ref, dv_ref = lay.dense(buf, s_k)
    dk, dv = (torch.full((b, s_k, h_kv, d), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in "kv")
    half, q_per = h_kv // 2, h // h_kv
    for a, z in ((0, half), (half, h_kv)):
        st = grouped.heads(a * q_per, z * q_per)
        k_g, v_g = k.narrow(2, a, z - a), v.narrow(2, a, z - a)
        glay = acc.TileKVLayout(st, k_g, s_k)
        gbuf = torch.zeros(glay.numel, device="cuda")
        acc.accumulate_tiles(st, k_g, v_g, *glay.cols(gbuf, s_k, 0, s_k), causal=True)
        glay.write(gbuf, s_k, dk.narrow(2, a, z - a), dv.narrow(2, a, z - a))
    assert not dk.isnan().any() and not dv.isnan().any()
    for got, ref in ((dk, dk_ref), (dv, dv_ref)):
        assert ref.abs().max() > 0
        # one rounding of (nearly) the same fp32 sum: within a bf16 ulp (atomics' order may differ)
        torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-5)
        assert (got == ref.to(torch.bfloat16)).float().mean() > 0.95
    torch.testing.assert_close(acc.finish(grouped, torch.float32), acc.finish(whole, torch.float32),
                               rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # subprocess entry: python test_fa4_bwd_accum.py ARCH RESULT_JSON
    _t0 = time.perf_counter()
    _res = _compile_cases(sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(_res))
    print(f"{sys.argv[1]}: {len(_res)} cases in {time.perf_counter() - _t0:.1f}s")
