"""The CuTe DSL fused merge (ringfa4.kernels.cute_merge).

CPU (CI): the kernel compiles to PTX and cubin for Hopper (sm_90a) and Blackwell (sm_100a) from fake
tensors, one subprocess per arch with ``CUTE_DSL_ARCH`` set (both run side by side); the wrapper's
argument checks and its choice of kernel (vector width, refusals) need no GPU. GPU (``-m gpu``): the
kernel equals ``merge_lse_torch_`` (max abs diff < 1e-5, no NaN) and is as close to a float64 merge.
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

from ringfa4.kernels.cute_merge import MergeKey, merge_lse_cute_, plan_merge

ROOT = Path(__file__).resolve().parents[1]
ARCHS = cute_compile.ARCHS
# (block dtype, d, vec): the three block dtypes, a head dim that is not a power of two, the scalar path
COMPILE_CASES = [("bfloat16", 128, 8), ("float16", 128, 8), ("float32", 128, 4), ("bfloat16", 80, 8),
                 ("float32", 67, 1)]
KERNEL_NAME = {"bfloat16": "BFloat16", "float16": "Float16", "float32": "Float32"}


def _compile_all(arch: str, dump_dir: str) -> list[dict]:
    """Subprocess side: compile every case for ``arch`` (CUTE_DSL_ARCH is set), keeping PTX / cubin."""
    from ringfa4.kernels.cute_merge import compile_merge_kernel

    bad = [("bfloat16", 100, 8), ("bfloat16", 128, 16), ("float32", 96, 3)]  # not kernels: ValueError
    return cute_compile.compile_cases(compile_merge_kernel, MergeKey, COMPILE_CASES, bad, arch, dump_dir)


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    runs = cute_compile.spawn(__file__, tmp_path_factory.mktemp("cute_merge_compile"))
    yield runs
    cute_compile.stop(r[0] for r in runs.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_cute_merge_compiles(compile_runs, arch):
    names = [f"RingMergeLse_{KERNEL_NAME[blk]}_d{d}_v{vec}_" for blk, d, vec in COMPILE_CASES]
    results, texts = cute_compile.finished_ptx(compile_runs, arch, names)
    assert len(results) == len(COMPILE_CASES)
    for (_, _, vec), name in zip(COMPILE_CASES, names):
        text = texts[name]
        assert "ex2.approx" in text and "bar.sync" in text
        if vec * 32 >= 128:  # the fp32 accumulator moves in 128-bit vectors (sm_100 packs f32 pairs: v2.b64)
            for op in ("ld", "st"):
                assert re.search(rf"{op}\.global\.(v4\.b32|v2\.b64)", text), f"{name}: no 128-bit {op}"
    print(f"\n{arch}: " + ", ".join(f"{r['case']} {r['seconds']}s" for r in results))


def test_import_does_not_load_cutlass():
    code = ("import sys, torch\n"
            "from ringfa4.kernels import cute_merge\n"
            "o = torch.zeros(2, 8, 3, 64); l = torch.zeros(2, 3, 8)\n"
            "assert cute_merge.merge_lse_cute_(o, l, o, l) is False\n"
            "assert cute_merge.plan_merge(o, l, o, l, 'sm_90a').vec == 4\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi', 'flash_attn'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _tensors(b, s, h, d, dt=torch.bfloat16, varlen=False):
    lead = (s,) if varlen else (b, s)
    lse_shape = (h, s) if varlen else (b, h, s)
    return (torch.zeros(*lead, h, d), torch.zeros(lse_shape), torch.zeros(*lead, h, d, dtype=dt),
            torch.zeros(lse_shape))


def test_malformed_input_raises():
    o, l, ob, lb = _tensors(2, 8, 3, 64)
    with pytest.raises(ValueError, match="out_blk"):
        merge_lse_cute_(o, l, ob[:, :4], lb)
    with pytest.raises(ValueError, match="lse_acc"):
        merge_lse_cute_(o, l.transpose(1, 2), ob, lb)
    with pytest.raises(ValueError, match="lse_blk"):
        merge_lse_cute_(o, l, ob, lb[:, :2])
    with pytest.raises(ValueError, match="out_acc"):
        merge_lse_cute_(o[0, 0], l[0, 0], ob[0, 0], lb[0, 0])
    with pytest.raises(ValueError, match="lse_acc"):
        plan_merge(o[0], l, ob[0], lb[0], "sm_90a")  # varlen out, dense lse


def test_cpu_tensors_are_left_to_torch():
    o, l, ob, lb = _tensors(2, 8, 3, 64)
    lb.fill_(1.0)
    assert merge_lse_cute_(o, l, ob, lb) is False
    assert torch.equal(l, torch.zeros_like(l))  # untouched


def _vec(o, l, ob, lb):
    key = plan_merge(o, l, ob, lb, "sm_100a")
    return None if key is None else key.vec


def test_plan_vector_width_and_refusals():
    o, l, ob, lb = _tensors(2, 16, 3, 128)
    assert plan_merge(o, l, ob, lb, "sm_90a") == MergeKey("bfloat16", 128, 8, "sm_90a")
    assert _vec(o, l, ob.half(), lb) == 8 and _vec(o, l, ob.float(), lb) == 4
    assert _vec(o[:, 5:11], l[:, :, 5:11], ob[:, 5:11], lb[:, :, 5:11]) == 8  # zigzag-style halves
    assert _vec(o.transpose(1, 2).contiguous().transpose(1, 2), l, ob, lb) == 8  # (b, h, s, d) memory
    assert _vec(*_tensors(1, 9, 2, 80)) == 8 and _vec(*_tensors(1, 9, 2, 36)) == 4
    assert _vec(*_tensors(1, 9, 2, 67)) == 1 and _vec(*_tensors(1, 9, 2, 80, torch.float32)) == 4
    ov, lv, obv, lbv = _tensors(0, 37, 4, 64, varlen=True)
    assert _vec(ov, lv, obv, lbv) == 8 and _vec(ov[3:20], lv[:, 3:20], obv[3:20], lbv[:, 3:20]) == 8
    big = torch.zeros(2, 16, 3, 130)
    assert _vec(big[..., 1:129], l, ob, lb) == 1  # rows start 4 bytes past a 16-byte boundary
    assert _vec(big[..., 2:130], l, ob, lb) == 2
    # refused: strided last dim, non-fp32 accumulator or lse, an unsupported block dtype, overlapping writes
    assert _vec(o, l, torch.zeros(2, 16, 3, 256, dtype=torch.bfloat16)[..., ::2], lb) is None
    assert _vec(big[..., ::2][..., :64], l, ob[..., :64], lb) is None
    assert _vec(o.double(), l, ob, lb) is None and _vec(o.half(), l, ob, lb) is None
    assert _vec(o, l.double(), ob, lb) is None and _vec(o, l, ob, lb.half()) is None
    assert _vec(o, l, ob.to(torch.int32), lb) is None
    assert _vec(o[:1, :1].expand(2, 16, 3, 128), l, ob, lb) is None
    assert _vec(o, l[:, :1].expand(2, 3, 16), ob, lb) is None
    assert _vec(*_tensors(1, 9, 2, 0)) is None
    assert _vec(*_tensors(1, 9, 2, 1025, torch.float32)) is None  # more than 1024 threads a row


# ---------------------------------------------------------------------------------------------- GPU


def _rows(w):
    return w.transpose(-1, -2).unsqueeze(-1)


def _merge64(acc, lacc, blk, lblk):
    """The merge in float64, as the reference."""
    la, lb = lacc.double(), lblk.double()
    m = torch.maximum(la, lb)
    ms = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - ms), torch.exp(lb - ms)
    tot = wa + wb
    den = torch.where(tot == 0, torch.ones_like(tot), tot)
    out = _rows(wa / den) * acc.double() + _rows(wb / den) * blk.double()
    return out, torch.where(tot == 0, torch.full_like(ms, -math.inf), ms + torch.log(den))


def _random_inputs(g, lead, h, d, dt, lse_lead=None):
    """Accumulator and block over ``lead`` rows (dense (b, S) or varlen (T,)), with -inf rows: the
    accumulator is empty on rows 0:5, the block on rows 3:8 (so rows 3:5 are empty on both sides)."""
    lse_shape = (*lead[:-1], h, lead[-1])
    acc = torch.randn(*lead, h, d, generator=g)
    blk = torch.randn(*lead, h, d, generator=g).to(dt)
    lacc, lblk = 3 * torch.randn(lse_shape, generator=g), 3 * torch.randn(lse_shape, generator=g)
    lacc[..., :5] = -math.inf
    lblk[..., 3:8] = -math.inf
    acc[..., :5, :, :] = 0.0
    blk[..., 3:8, :, :] = 0.0
    return [t.cuda() for t in (acc, lacc, blk, lblk)]


def _check_views(acc, lacc, blk, lblk, view_out, view_lse):
    """Merge the viewed part with the kernel and with torch; compare both with float64."""
    from ringfa4.kernels.merge import merge_lse_torch_

    a1, l1, a2, l2 = acc.clone(), lacc.clone(), acc.clone(), lacc.clone()
    args = lambda a, l: (view_out(a), view_lse(l), view_out(blk), view_lse(lblk))
    ref_out, ref_lse = _merge64(*args(acc, lacc))
    merge_lse_torch_(*args(a1, l1))
    assert merge_lse_cute_(*args(a2, l2)) is True
    torch.cuda.synchronize()
    assert not torch.isnan(a2).any() and not torch.isnan(l2).any()
    assert torch.equal(torch.isneginf(l1), torch.isneginf(l2))
    fin = torch.isfinite(l1)
    assert (a1 - a2).abs().max().item() < 1e-5 and (l1[fin] - l2[fin]).abs().max().item() < 1e-5
    # outside the view nothing moved
    mask_o, mask_l = torch.ones_like(acc, dtype=torch.bool), torch.ones_like(lacc, dtype=torch.bool)
    view_out(mask_o).fill_(False)
    view_lse(mask_l).fill_(False)
    assert torch.equal(a2[mask_o], acc[mask_o]) and torch.equal(l2[mask_l], lacc[mask_l])
    # as close to float64 as torch's own fp32 merge
    err = lambda out, lse: max((view_out(out).double() - ref_out).abs().max().item(),
                               (view_lse(lse).double() - ref_lse)[torch.isfinite(ref_lse)].abs().max().item())
    assert err(a2, l2) <= 2 * err(a1, l1) + 2e-6, (err(a2, l2), err(a1, l1))
    assert torch.equal(torch.isneginf(view_lse(l2)), torch.isneginf(ref_lse))
    return a2, l2


def _all(t):
    return t


BLK_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", BLK_DTYPES)
@pytest.mark.parametrize("d", [64, 128, 80])
def test_gpu_dense(dt, d):
    g = torch.Generator().manual_seed(d)
    for b, s, h in [(2, 40, 3), (1, 257, 5), (3, 17, 8)]:  # row counts that leave the last CTA partial
        acc, lacc, blk, lblk = _random_inputs(g, (b, s), h, d, dt)
        out, lse = _check_views(acc, lacc, blk, lblk, _all, _all)
        assert torch.equal(out[:, 3:5], torch.zeros_like(out[:, 3:5]))  # empty on both sides: out 0
        assert torch.isneginf(lse[:, :, 3:5]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dt", BLK_DTYPES)
def test_gpu_zigzag_halves(dt):
    g = torch.Generator().manual_seed(1)
    b, s, h, d = 2, 96, 4, 128
    acc, lacc, blk, lblk = _random_inputs(g, (b, 2 * s), h, d, dt)
    for sl in (slice(0, s), slice(s, 2 * s), slice(7, 40)):  # both halves and an odd window
        _check_views(acc, lacc, blk, lblk, lambda t, sl=sl: t[:, sl], lambda t, sl=sl: t[:, :, sl])
    # a separate contiguous block merged into one half of the accumulator
    from ringfa4.kernels.merge import merge_lse_torch_

    half_blk, half_lblk = blk[:, s:].contiguous(), lblk[:, :, s:].contiguous()
    a1, l1, a2, l2 = acc.clone(), lacc.clone(), acc.clone(), lacc.clone()
    merge_lse_torch_(a1[:, s:], l1[:, :, s:], half_blk, half_lblk)
    assert merge_lse_cute_(a2[:, s:], l2[:, :, s:], half_blk, half_lblk)
    assert (a1 - a2).abs().max().item() < 1e-5 and torch.equal(a1[:, :s], a2[:, :s])


@pytest.mark.gpu
@pytest.mark.parametrize("dt", BLK_DTYPES)
def test_gpu_varlen(dt):
    g = torch.Generator().manual_seed(2)
    acc, lacc, blk, lblk = _random_inputs(g, (333,), 6, 64, dt)  # out (t, h, d), lse (h, t)
    _check_views(acc, lacc, blk, lblk, _all, _all)
    _check_views(acc, lacc, blk, lblk, lambda t: t[100:250], lambda t: t[:, 100:250])


@pytest.mark.gpu
def test_gpu_strided_and_misaligned():
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 50, 4, 128
    acc, lacc, blk, lblk = _random_inputs(g, (b, s), h, d, torch.bfloat16)
    # (b, h, s, d) memory seen as (b, s, h, d), lse (b, s, h) memory seen as (b, h, s)
    t_out = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)
    t_lse = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)
    _check_views(t_out(acc), t_lse(lacc), t_out(blk), t_lse(lblk), _all, _all)
    # rows that start off a 16-byte boundary: the narrower-vector kernels
    for off in (1, 2):
        big = torch.zeros(b, s, h, d + 2, device="cuda")
        big[..., off:off + d] = acc
        key = plan_merge(big[..., off:off + d], lacc, blk, lblk, "sm_90a")
        assert key.vec == off
        _check_views(big, lacc, torch.zeros_like(big, dtype=blk.dtype).copy_(
            torch.nn.functional.pad(blk, (off, 2 - off))), lblk, lambda t, o=off: t[..., o:o + d], _all)


@pytest.mark.gpu
def test_gpu_refused_inputs_untouched():
    g = torch.Generator().manual_seed(4)
    acc, lacc, blk, lblk = _random_inputs(g, (2, 16), 3, 64, torch.bfloat16)
    wide = torch.zeros(2, 16, 3, 128, dtype=torch.bfloat16, device="cuda")
    wide[..., ::2] = blk
    a, l = acc.clone(), lacc.clone()
    assert merge_lse_cute_(a, l, wide[..., ::2], lblk) is False  # last dim not contiguous
    assert merge_lse_cute_(a.double(), l, blk, lblk) is False  # accumulator not fp32
    assert torch.equal(a, acc) and torch.equal(l, lacc)


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_reuses_kernels():
    from ringfa4.kernels import cute_merge

    g = torch.Generator().manual_seed(5)
    acc, lacc, blk, lblk = _random_inputs(g, (2, 64), 4, 128, torch.bfloat16)
    expected_out, expected_lse = _merge64(acc, lacc, blk, lblk)
    assert merge_lse_cute_(acc.clone(), lacc.clone(), blk, lblk)  # compiled and loaded before the timing test
    torch.cuda.synchronize()
    # the block arrives late on a side stream: only a kernel on that stream sees it
    late_blk, late_lblk = torch.zeros_like(blk), torch.full_like(lblk, -math.inf)
    a, l = acc.clone(), lacc.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
        late_blk.copy_(blk)
        late_lblk.copy_(lblk)
        assert merge_lse_cute_(a, l, late_blk, late_lblk)
    stream.synchronize()
    assert (a.double() - expected_out).abs().max().item() < 1e-5
    fin = torch.isfinite(expected_lse)
    assert (l.double() - expected_lse)[fin].abs().max().item() < 1e-5
    # other shapes and strides of the same (dtype, d) reuse the compiled kernel
    before = cute_merge._compiled.cache_info().currsize
    for b, s, h in [(1, 33, 2), (3, 10, 7)]:
        acc, lacc, blk, lblk = _random_inputs(g, (b, s), h, 128, torch.bfloat16)
        assert merge_lse_cute_(acc, lacc, blk, lblk)
        assert merge_lse_cute_(acc[:, 2:9], lacc[:, :, 2:9], blk[:, 2:9], lblk[:, :, 2:9])
    assert cute_merge._compiled.cache_info().currsize == before


if __name__ == "__main__":  # subprocess entry: python test_cute_merge.py ARCH DUMP_DIR RESULT_JSON
    cute_compile.compile_main(_compile_all)
