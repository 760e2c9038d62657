"""The one-pass LSE combine of n slots (ringfa4.kernels.cute_combine).

CPU (CI): the CuTe kernel compiles to PTX and cubin for Hopper (sm_90a) and Blackwell (sm_100a) from
fake tensors, one subprocess per arch with ``CUTE_DSL_ARCH`` set (both run side by side); the
wrapper's checks and its choice of kernel need no GPU; ``combine_lse_torch_`` (the CPU path and the
oracle of the GPU tests) equals a float64 logsumexp combine written here independently, and equals
merging the slots one by one with ``merge_lse_torch_``. Slot rows (and accumulator rows) at lse -inf
hold garbage (NaN, inf) that must not leak. GPU (``-m gpu``): the kernel equals
``combine_lse_torch_`` (max abs diff < 1e-5, no NaN), for any n with one compiled kernel.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import cute_compile
import pytest
import torch

from ringfa4.kernels.cute_combine import CombineKey, combine_lse_, combine_lse_cute_, combine_lse_torch_, plan_combine
from ringfa4.kernels.merge import merge_lse_torch_

ROOT = Path(__file__).resolve().parents[1]
ARCHS = cute_compile.ARCHS
# (part dtype, d, vec): the three part dtypes, d = 64, a head dim that is not a power of two, the scalar path
COMPILE_CASES = [("bfloat16", 128, 8), ("float16", 128, 8), ("float32", 128, 4), ("bfloat16", 64, 8),
                 ("float32", 67, 1)]
KERNEL_NAME = {"bfloat16": "BFloat16", "float16": "Float16", "float32": "Float32"}
INF = math.inf


def _compile_all(arch: str, dump_dir: str) -> list[dict]:
    """Subprocess side: compile every case for ``arch`` (CUTE_DSL_ARCH is set), keeping PTX / cubin."""
    from ringfa4.kernels.cute_combine import compile_combine_kernel

    bad = [("bfloat16", 100, 8), ("bfloat16", 128, 16), ("float32", 96, 3)]  # not kernels: ValueError
    return cute_compile.compile_cases(compile_combine_kernel, CombineKey, COMPILE_CASES, bad, arch, dump_dir)


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    runs = cute_compile.spawn(__file__, tmp_path_factory.mktemp("cute_combine_compile"))
    yield runs
    cute_compile.stop(r[0] for r in runs.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_cute_combine_compiles(compile_runs, arch):
    names = [f"RingCombineLse_{KERNEL_NAME[part]}_d{d}_v{vec}_" for part, d, vec in COMPILE_CASES]
    results, texts = cute_compile.finished_ptx(compile_runs, arch, names)
    assert len(results) == len(COMPILE_CASES)
    for (part, _, vec), name in zip(COMPILE_CASES, names):
        text = texts[name]
        assert "ex2.approx" in text and "bar.sync" in text
        entry = text[text.index(".entry"):]
        assert re.search(r"\.param \.u32 \S+_param_4\s*\)", entry), "n is not a runtime argument"
        if vec * 32 >= 128:  # the fp32 accumulator moves in 128-bit vectors (sm_100 packs f32 pairs: v2.b64)
            for op in ("ld", "st"):
                assert re.search(rf"{op}\.global\.(v4\.b32|v2\.b64)", text), f"{name}: no 128-bit {op}"
        # the slot loop body holds _IN_FLIGHT (4) 128-bit slot loads, plus the accumulator's (1 or 2)
        if vec * _width(part) == 128:
            assert len(re.findall(r"ld\.global\.(v4\.b32|v2\.b64)", entry)) >= 5, name
    print(f"\n{arch}: " + ", ".join(f"{r['case']} {r['seconds']}s" for r in results))


def _width(part: str) -> int:
    return 32 if part == "float32" else 16


def test_import_does_not_load_cutlass():
    code = ("import sys, torch\n"
            "from ringfa4.kernels import cute_combine\n"
            "o = torch.zeros(2, 8, 3, 64); l = torch.zeros(2, 3, 8)\n"
            "p = torch.zeros(4, 2, 8, 3, 64); lp = torch.zeros(4, 2, 3, 8)\n"
            "assert cute_combine.combine_lse_cute_(o, l, p, lp, 2) is False\n"
            "assert cute_combine.plan_combine(o, l, p, lp, 'sm_90a').vec == 4\n"
            "cute_combine.combine_lse_(o, l, p, lp, 3)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi', 'flash_attn'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _zeros(b, s, h, d, n_slots=3, dt=torch.bfloat16, varlen=False):
    lead = (s,) if varlen else (b, s)
    lse_shape = (h, s) if varlen else (b, h, s)
    return (torch.zeros(*lead, h, d), torch.zeros(lse_shape), torch.zeros(n_slots, *lead, h, d, dtype=dt),
            torch.zeros(n_slots, *lse_shape))


def test_malformed_input_raises():
    o, l, p, lp = _zeros(2, 8, 3, 64)
    for fn in (combine_lse_cute_, combine_lse_torch_, combine_lse_):
        with pytest.raises(ValueError, match="parts"):
            fn(o, l, p[:, :, :4], lp, 1)
        with pytest.raises(ValueError, match="parts"):
            fn(o, l, p[0], lp, 1)  # no slot dim
        with pytest.raises(ValueError, match="lse_acc"):
            fn(o, l.transpose(1, 2), p, lp, 1)
        with pytest.raises(ValueError, match="lse_parts"):
            fn(o, l, p, lp[:2], 1)  # N differs from parts
        with pytest.raises(ValueError, match="lse_parts"):
            fn(o, l, p, lp[:, :, :, :4], 1)
        with pytest.raises(ValueError, match="out_acc"):
            fn(o[0, 0], l[0, 0], p[:, 0, 0], lp[:, 0, 0], 1)
        for bad_n in (-1, 4):
            with pytest.raises(ValueError, match="n must be in"):
                fn(o, l, p, lp, bad_n)
        with pytest.raises(ValueError, match="n must be an int"):
            fn(o, l, p, lp, 1.0)
    with pytest.raises(ValueError, match="lse_acc"):
        plan_combine(o[0], l, p[:, 0], lp[:, 0], "sm_90a")  # varlen out, dense lse
    with pytest.raises(ValueError, match="out_acc must be float32 or float64"):
        combine_lse_torch_(o.bfloat16(), l, p, lp, 1)


def test_cpu_tensors_are_left_to_torch():
    o, l, p, lp = _zeros(2, 8, 3, 64)
    assert combine_lse_cute_(o, l, p, lp, 2) is False
    assert torch.equal(l, torch.zeros_like(l))  # untouched
    combine_lse_(o, l, p, lp, 2)  # the dispatcher takes the torch path
    assert torch.allclose(l, torch.full_like(l, math.log(3.0)))


def _vec(o, l, p, lp):
    key = plan_combine(o, l, p, lp, "sm_100a")
    return None if key is None else key.vec


def test_plan_vector_width_and_refusals():
    o, l, p, lp = _zeros(2, 16, 3, 128)
    assert plan_combine(o, l, p, lp, "sm_90a") == CombineKey("bfloat16", 128, 8, "sm_90a")
    assert _vec(o, l, p.half(), lp) == 8 and _vec(o, l, p.float(), lp) == 4
    assert _vec(o[:, 5:11], l[:, :, 5:11], p[:, :, 5:11], lp[:, :, :, 5:11]) == 8  # zigzag-style halves
    assert _vec(o, l, p[1:], lp[1:]) == 8  # slot views
    assert _vec(o.transpose(1, 2).contiguous().transpose(1, 2), l, p, lp) == 8  # (b, h, s, d) memory
    assert _vec(*_zeros(1, 9, 2, 80)) == 8 and _vec(*_zeros(1, 9, 2, 36)) == 4
    assert _vec(*_zeros(1, 9, 2, 67)) == 1 and _vec(*_zeros(1, 9, 2, 80, dt=torch.float32)) == 4
    ov, lv, pv, lpv = _zeros(0, 37, 4, 64, varlen=True)
    assert _vec(ov, lv, pv, lpv) == 8 and _vec(ov[3:20], lv[:, 3:20], pv[:, 3:20], lpv[:, :, 3:20]) == 8
    big = torch.zeros(2, 16, 3, 130)
    assert _vec(big[..., 1:129], l, p, lp) == 1  # rows start 4 bytes past a 16-byte boundary
    assert _vec(big[..., 2:130], l, p, lp) == 2
    pbig = torch.zeros(3, 2, 16, 3, 132, dtype=torch.bfloat16)
    assert _vec(o, l, pbig[..., 2:130], lp) == 2 and _vec(o, l, pbig[..., 4:132], lp) == 4
    # refused: strided last dim, non-fp32 accumulator or lse, an unsupported part dtype, overlapping writes
    assert _vec(o, l, torch.zeros(3, 2, 16, 3, 256, dtype=torch.bfloat16)[..., ::2], lp) is None
    assert _vec(big[..., ::2][..., :64], l, p[..., :64], lp) is None
    assert _vec(o.double(), l, p, lp) is None and _vec(o.half(), l, p, lp) is None
    assert _vec(o, l.double(), p, lp) is None and _vec(o, l, p, lp.half()) is None
    assert _vec(o, l, p.to(torch.int32), lp) is None
    assert _vec(o[:1, :1].expand(2, 16, 3, 128), l, p, lp) is None
    assert _vec(o, l[:, :1].expand(2, 3, 16), p, lp) is None
    assert _vec(o, l, p[:1].expand(3, 2, 16, 3, 128), lp[:1].expand(3, 2, 3, 16)) == 8  # parts are only read
    assert _vec(*_zeros(1, 9, 2, 0)) is None
    assert _vec(*_zeros(1, 9, 2, 1025, dt=torch.float32)) is None  # more than 1024 threads a row


# ------------------------------------------------------------------------------- torch reference (CPU)


def _rows(w):
    """lse layout (..., h, s) -> out layout (..., s, h, 1)."""
    return w.transpose(-1, -2).unsqueeze(-1)


def _same(x, y) -> bool:
    """Equal, NaN where NaN (garbage rows)."""
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


def _combine64(acc, lacc, parts, lparts, n):
    """The combine in float64 written with logsumexp over the stacked (accumulator, slot) results."""
    lses = torch.cat([lacc[None], lparts[:n]]).double()
    vals = torch.cat([acc[None].double(), parts[:n].double()])
    live = lses > -INF
    new = torch.logsumexp(lses, 0)
    w = torch.where(live, torch.exp(lses - torch.where(torch.isfinite(new), new, torch.zeros_like(new))), 0.0)
    out = (torch.where(_rows(live), vals, 0.0) * _rows(w)).sum(0)
    return out, new


GARBAGE = torch.tensor([math.nan, INF, -INF, 3e38, -1e30])


def _random_inputs(g, lead, h, d, n_slots, dt=torch.float64, acc_dt=torch.float64, garbage=True):
    """Accumulator and ``n_slots`` slots over ``lead`` rows (dense (b, S) or varlen (T,)). At lse -inf:
    the accumulator on rows 0:5, every slot on rows 3:5 (so rows 3:5 are empty everywhere) and each
    slot on a random third of the other rows. Those rows hold garbage (NaN, ±inf, huge values), or 0
    without ``garbage``. Slot lse centres differ, so any of them may dominate a row."""
    lse_shape = (*lead[:-1], h, lead[-1])
    acc = torch.randn(*lead, h, d, generator=g, dtype=torch.float64)
    parts = torch.randn(n_slots, *lead, h, d, generator=g, dtype=torch.float64)
    lacc = 3 * torch.randn(lse_shape, generator=g, dtype=torch.float64)
    shift = 4 * torch.randn(n_slots, *[1] * len(lse_shape), generator=g, dtype=torch.float64)
    lparts = shift + 3 * torch.randn(n_slots, *lse_shape, generator=g, dtype=torch.float64)
    lacc[..., :5] = -INF
    lparts[..., 3:5] = -INF
    lparts[torch.rand(lparts.shape, generator=g) < 1 / 3] = -INF

    def junk(vals, lse):
        pick = torch.randint(len(GARBAGE), vals.shape, generator=g)
        bad = GARBAGE.double()[pick] if garbage else torch.zeros_like(vals)
        return torch.where(_rows(lse == -INF), bad, vals)

    acc, parts = junk(acc, lacc), junk(parts, lparts)
    return acc.to(acc_dt), lacc.to(acc_dt), parts.to(dt), lparts.to(acc_dt)


def _check_torch(acc, lacc, parts, lparts, n, view_out=None, view_lse=None, view_parts=None, view_lparts=None,
                 tol=1e-12):
    """combine_lse_torch_ on the views vs the float64 oracle; outside the views nothing moves."""
    ident = lambda t: t
    vo, vl = view_out or ident, view_lse or ident
    vp, vlp = view_parts or ident, view_lparts or ident
    a, l = acc.clone(), lacc.clone()
    ref_out, ref_lse = _combine64(vo(acc), vl(lacc), vp(parts), vlp(lparts), n)
    combine_lse_torch_(vo(a), vl(l), vp(parts), vlp(lparts), n)
    out, lse = vo(a), vl(l)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (out.double() - ref_out).abs().max().item() < tol
    assert (lse.double() - ref_lse)[fin].abs().max().item() < tol
    assert torch.equal(out[_rows(~fin).expand_as(out)], torch.zeros_like(out[_rows(~fin).expand_as(out)]))
    mask_o, mask_l = torch.ones_like(acc, dtype=torch.bool), torch.ones_like(lacc, dtype=torch.bool)
    vo(mask_o).fill_(False)
    vl(mask_l).fill_(False)
    assert _same(a[mask_o], acc[mask_o]) and torch.equal(l[mask_l], lacc[mask_l])
    return out, lse


def test_torch_combine_matches_float64_logsumexp():
    g = torch.Generator().manual_seed(0)
    for trial, (lead, h, d, n_slots) in enumerate([((2, 40), 3, 16, 4), ((1, 23), 5, 8, 6), ((3, 9), 2, 4, 1),
                                                   ((2, 17), 4, 32, 8)]):
        acc, lacc, parts, lparts = _random_inputs(g, lead, h, d, n_slots)
        for n in sorted({1, n_slots, int(torch.randint(1, n_slots + 1, (), generator=g))}):
            out, lse = _check_torch(acc, lacc, parts, lparts, n)
            assert torch.equal(out[:, 3:5], torch.zeros_like(out[:, 3:5]))  # empty everywhere: out 0, lse -inf
            assert torch.isneginf(lse[:, :, 3:5]).all()
        # n = 0: nothing to combine, nothing moves
        a, l = acc.clone(), lacc.clone()
        combine_lse_torch_(a, l, parts, lparts, 0)
        assert _same(a, acc) and torch.equal(l, lacc), trial


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_combine_fp32_accumulator(dt):
    """The fp32 path (what the GPU tests compare the kernel with) is as close to float64 as fp32 is."""
    g = torch.Generator().manual_seed(1)
    acc, lacc, parts, lparts = _random_inputs(g, (2, 33), 4, 64, 5, dt=dt, acc_dt=torch.float32)
    _check_torch(acc, lacc, parts, lparts, 4, tol=1e-5)


def test_torch_combine_zigzag_halves_and_slot_views():
    g = torch.Generator().manual_seed(2)
    s = 24
    acc, lacc, parts, lparts = _random_inputs(g, (2, 2 * s), 3, 16, 5)
    for sl in (slice(0, s), slice(s, 2 * s), slice(7, 30)):  # both halves and an odd window
        _check_torch(acc, lacc, parts, lparts, 3, lambda t, sl=sl: t[:, sl], lambda t, sl=sl: t[:, :, sl],
                     lambda t, sl=sl: t[:, :, sl], lambda t, sl=sl: t[:, :, :, sl])
    # a half of the accumulator combined with slot buffers of half length (the ring's layout)
    half_p, half_lp = parts[:, :, s:].contiguous(), lparts[:, :, :, s:].contiguous()
    _check_torch(acc, lacc, half_p, half_lp, 5, lambda t: t[:, s:], lambda t: t[:, :, s:])
    # (b, h, s, d) memory seen as (b, s, h, d), (N, b, s, h) lse memory seen as (N, b, h, s)
    tp = parts.transpose(2, 3).contiguous().transpose(2, 3)
    tlp = lparts.transpose(2, 3).contiguous().transpose(2, 3)
    _check_torch(acc, lacc, tp, tlp, 4)


def test_torch_combine_varlen():
    g = torch.Generator().manual_seed(3)
    acc, lacc, parts, lparts = _random_inputs(g, (77,), 4, 16, 4)  # out (t, h, d), lse (h, t)
    _check_torch(acc, lacc, parts, lparts, 4)
    _check_torch(acc, lacc, parts, lparts, 2, lambda t: t[20:60], lambda t: t[:, 20:60],
                 lambda t: t[:, 20:60], lambda t: t[:, :, 20:60])


def test_combine_equals_merging_one_by_one():
    """Slots at -inf carry zeros here: merge_lse_torch_ multiplies them by their weight 0."""
    g = torch.Generator().manual_seed(4)
    for lead in [(2, 31), (45,)]:
        acc, lacc, parts, lparts = _random_inputs(g, lead, 3, 16, 6, garbage=False)
        for n in (1, 3, 6):
            a1, l1, a2, l2 = acc.clone(), lacc.clone(), acc.clone(), lacc.clone()
            combine_lse_torch_(a1, l1, parts, lparts, n)
            for j in range(n):
                merge_lse_torch_(a2, l2, parts[j], lparts[j])
            assert torch.equal(torch.isneginf(l1), torch.isneginf(l2))
            fin = torch.isfinite(l1)
            assert (a1 - a2).abs().max().item() < 1e-12 and (l1[fin] - l2[fin]).abs().max().item() < 1e-12


# ---------------------------------------------------------------------------------------------- GPU


def _cuda(*ts):
    return [t.cuda() for t in ts]


def _check_kernel(acc, lacc, parts, lparts, n, view_out=None, view_lse=None, view_parts=None, view_lparts=None):
    """The kernel on the views vs combine_lse_torch_ (fp32, same device) and the float64 oracle;
    outside the views nothing moves."""
    ident = lambda t: t
    vo, vl = view_out or ident, view_lse or ident
    vp, vlp = view_parts or ident, view_lparts or ident
    a1, l1, a2, l2 = acc.clone(), lacc.clone(), acc.clone(), lacc.clone()
    combine_lse_torch_(vo(a1), vl(l1), vp(parts), vlp(lparts), n)
    assert combine_lse_cute_(vo(a2), vl(l2), vp(parts), vlp(lparts), n) is True
    torch.cuda.synchronize()
    out1, lse1, out2, lse2 = vo(a1), vl(l1), vo(a2), vl(l2)
    assert not torch.isnan(out2).any() and not torch.isnan(lse2).any()
    assert torch.isfinite(out2).all()
    assert torch.equal(torch.isneginf(lse1), torch.isneginf(lse2))
    fin = torch.isfinite(lse1)
    assert (out1 - out2).abs().max().item() < 1e-5
    assert (lse1[fin] - lse2[fin]).abs().max().item() < 1e-5
    ref_out, ref_lse = _combine64(vo(acc), vl(lacc), vp(parts), vlp(lparts), n)
    assert (out2.double() - ref_out).abs().max().item() < 1e-5
    assert (lse2.double() - ref_lse)[fin].abs().max().item() < 1e-5
    mask_o, mask_l = torch.ones_like(acc, dtype=torch.bool), torch.ones_like(lacc, dtype=torch.bool)
    vo(mask_o).fill_(False)
    vl(mask_l).fill_(False)
    assert _same(a2[mask_o], acc[mask_o]) and torch.equal(l2[mask_l], lacc[mask_l])
    return out2, lse2


PART_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _gpu_inputs(g, lead, h, d, n_slots, dt, garbage=True):
    return _cuda(*_random_inputs(g, lead, h, d, n_slots, dt=dt, acc_dt=torch.float32, garbage=garbage))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", PART_DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dense(dt, d):
    g = torch.Generator().manual_seed(d)
    for b, s, h, n_slots in [(2, 40, 3, 4), (1, 257, 5, 6), (3, 17, 8, 1), (2, 33, 4, 9)]:  # partial last CTA
        acc, lacc, parts, lparts = _gpu_inputs(g, (b, s), h, d, n_slots, dt)
        for n in sorted({1, n_slots, int(torch.randint(1, n_slots + 1, (), generator=g))}):
            out, lse = _check_kernel(acc, lacc, parts, lparts, n)
            assert torch.equal(out[:, 3:5], torch.zeros_like(out[:, 3:5]))  # empty everywhere: out 0, lse -inf
            assert torch.isneginf(lse[:, :, 3:5]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dt", PART_DTYPES)
def test_gpu_zigzag_halves(dt):
    g = torch.Generator().manual_seed(1)
    b, s, h, d = 2, 96, 4, 128
    acc, lacc, parts, lparts = _gpu_inputs(g, (b, 2 * s), h, d, 5, dt)
    for sl in (slice(0, s), slice(s, 2 * s), slice(7, 40)):  # both halves and an odd window
        _check_kernel(acc, lacc, parts, lparts, 3, lambda t, sl=sl: t[:, sl], lambda t, sl=sl: t[:, :, sl],
                      lambda t, sl=sl: t[:, :, sl], lambda t, sl=sl: t[:, :, :, sl])
    # one half of the accumulator with slot buffers of half length
    half_p, half_lp = parts[:, :, s:].contiguous(), lparts[:, :, :, s:].contiguous()
    _check_kernel(acc, lacc, half_p, half_lp, 5, lambda t: t[:, s:], lambda t: t[:, :, s:])


@pytest.mark.gpu
@pytest.mark.parametrize("dt", PART_DTYPES)
def test_gpu_varlen(dt):
    g = torch.Generator().manual_seed(2)
    acc, lacc, parts, lparts = _gpu_inputs(g, (333,), 6, 64, 4, dt)  # out (t, h, d), lse (h, t)
    _check_kernel(acc, lacc, parts, lparts, 4)
    _check_kernel(acc, lacc, parts, lparts, 3, lambda t: t[100:250], lambda t: t[:, 100:250],
                  lambda t: t[:, 100:250], lambda t: t[:, :, 100:250])


@pytest.mark.gpu
def test_gpu_strided_and_misaligned():
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 50, 4, 128
    acc, lacc, parts, lparts = _gpu_inputs(g, (b, s), h, d, 3, torch.bfloat16)
    # (b, h, s, d) memory seen as (b, s, h, d), (b, s, h) lse memory seen as (b, h, s); slots likewise
    t4 = lambda t, i: t.transpose(i, i + 1).contiguous().transpose(i, i + 1)
    _check_kernel(t4(acc, 1), t4(lacc, 1), t4(parts, 2), t4(lparts, 2), 3)
    # rows that start off a 16-byte boundary: the narrower-vector kernels
    for off in (1, 2):
        big = torch.zeros(b, s, h, d + 2, device="cuda")
        big[..., off:off + d] = acc
        assert plan_combine(big[..., off:off + d], lacc, parts, lparts, "sm_90a").vec == off
        pbig = torch.nn.functional.pad(parts, (off, 2 - off))
        _check_kernel(big, lacc, pbig, lparts, 2, lambda t, o=off: t[..., o:o + d], None,
                      lambda t, o=off: t[..., o:o + d])


@pytest.mark.gpu
def test_gpu_refused_inputs_and_n0_untouched():
    g = torch.Generator().manual_seed(4)
    acc, lacc, parts, lparts = _gpu_inputs(g, (2, 16), 3, 64, 3, torch.bfloat16)
    wide = torch.zeros(3, 2, 16, 3, 128, dtype=torch.bfloat16, device="cuda")
    wide[..., ::2] = parts
    a, l = acc.clone(), lacc.clone()
    assert combine_lse_cute_(a, l, wide[..., ::2], lparts, 2) is False  # last dim not contiguous
    assert combine_lse_cute_(a.double(), l, parts, lparts, 2) is False  # accumulator not fp32
    assert combine_lse_cute_(a, l, parts, lparts, 0) is True  # nothing to combine
    torch.cuda.synchronize()
    assert _same(a, acc) and torch.equal(l, lacc)
    # the dispatcher: the kernel where it applies, torch otherwise, same results
    a1, l1, a2, l2 = acc.clone(), lacc.clone(), acc.clone(), lacc.clone()
    combine_lse_(a1, l1, wide[..., ::2], lparts, 3)
    combine_lse_(a2, l2, parts, lparts, 3)
    assert (a1 - a2).abs().max().item() < 1e-5 and not torch.isnan(a1).any()


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_reuses_kernels():
    from ringfa4.kernels import cute_combine

    g = torch.Generator().manual_seed(5)
    acc, lacc, parts, lparts = _gpu_inputs(g, (2, 64), 4, 128, 4, torch.bfloat16)
    expected_out, expected_lse = _combine64(acc, lacc, parts, lparts, 4)
    assert combine_lse_cute_(acc.clone(), lacc.clone(), parts, lparts, 4)  # compiled and loaded first
    torch.cuda.synchronize()
    # the slots arrive late on a side stream: only a kernel on that stream sees them
    late_p, late_lp = torch.zeros_like(parts), torch.full_like(lparts, -INF)
    a, l = acc.clone(), lacc.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
        late_p.copy_(parts)
        late_lp.copy_(lparts)
        assert combine_lse_cute_(a, l, late_p, late_lp, 4)
    stream.synchronize()
    assert (a.double() - expected_out).abs().max().item() < 1e-5
    fin = torch.isfinite(expected_lse)
    assert (l.double() - expected_lse)[fin].abs().max().item() < 1e-5
    # every n, other shapes, strides and slot counts of the same (dtype, d) reuse the compiled kernel
    before = cute_combine._compiled.cache_info().currsize
    for b, s, h, n_slots in [(1, 33, 2, 8), (3, 10, 7, 2), (2, 64, 4, 4)]:
        acc, lacc, parts, lparts = _gpu_inputs(g, (b, s), h, 128, n_slots, torch.bfloat16)
        for n in range(1, n_slots + 1):
            _check_kernel(acc, lacc, parts, lparts, n)
        assert combine_lse_cute_(acc[:, 2:9], lacc[:, :, 2:9], parts[:, :, 2:9], lparts[:, :, :, 2:9], n_slots)
    torch.cuda.synchronize()
    assert cute_combine._compiled.cache_info().currsize == before


if __name__ == "__main__":  # subprocess entry: python test_cute_combine.py ARCH DUMP_DIR RESULT_JSON
    cute_compile.compile_main(_compile_all)
