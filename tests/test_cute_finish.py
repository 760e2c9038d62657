"""The ring forward's finish as one CuTe DSL kernel (ringfa4.kernels.cute_finish).

CPU (CI): the kernel compiles to PTX and cubin for Hopper (sm_90a) and Blackwell (sm_100a) from fake
tensors (one subprocess per arch, as test_cute_merge does); the wrapper's checks, refusals and vector
widths need no GPU. GPU (``-m gpu``): the output is the accumulator cast by ``Tensor.to`` bit for bit,
the lse ``planes_lse``'s to an ulp (and -inf exactly where M is), on views of a (b, h, 2, S) planes
buffer and zigzag halves, nothing outside the views written; a dense ring forward on FA4 takes it.
"""

import math

import cute_compile
import pytest
import torch

from ringfa4.kernels.cute_finish import FinishKey, finish_planes_cute, plan_finish

ARCHS = cute_compile.ARCHS
COMPILE_CASES = [("bfloat16", 128, 8), ("float16", 64, 8), ("bfloat16", 80, 8), ("bfloat16", 67, 1)]
KERNEL_NAME = {"bfloat16": "BFloat16", "float16": "Float16"}


def _compile_all(arch: str, dump_dir: str) -> list[dict]:
    """Subprocess side: compile every case for ``arch`` (CUTE_DSL_ARCH is set), keeping PTX / cubin."""
    from ringfa4.kernels.cute_finish import compile_finish_kernel

    bad = [("float32", 128, 4), ("bfloat16", 100, 8), ("bfloat16", 128, 16)]  # not kernels: ValueError
    return cute_compile.compile_cases(compile_finish_kernel, FinishKey, COMPILE_CASES, bad, arch, dump_dir)


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    runs = cute_compile.spawn(__file__, tmp_path_factory.mktemp("cute_finish_compile"))
    yield runs
    cute_compile.stop(r[0] for r in runs.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_cute_finish_compiles(compile_runs, arch):
    names = [f"RingFinishPlanes_{KERNEL_NAME[t]}_d{d}_v{vec}_" for t, d, vec in COMPILE_CASES]
    results, texts = cute_compile.finished_ptx(compile_runs, arch, names)
    assert len(results) == len(COMPILE_CASES)
    for (_, _, vec), name in zip(COMPILE_CASES, names):
        text = texts[name]
        assert "cvt.rn" in text, f"{name}: the cast does not round to nearest even"
        if vec == 8:  # eight 16-bit outputs: one 128-bit store
            assert "st.global.v4.b32" in text, f"{name}: no 128-bit store"


def _planes_case(b, s, h, d, dtype=torch.bfloat16, device="cpu"):
    acc = torch.zeros(b, s, h, d, device=device)
    planes = torch.zeros(b, h, 2, s, device=device)
    return acc, planes[:, :, 0], planes[:, :, 1], torch.zeros(b, h, s, device=device), dtype


def test_malformed_input_raises_and_cpu_is_left_to_torch():
    acc, m, s, lse, dt = _planes_case(2, 8, 3, 64)
    assert finish_planes_cute(acc, m, s, lse, dt) is None  # CPU tensors: the caller's torch ops
    assert torch.equal(lse, torch.zeros_like(lse))
    with pytest.raises(ValueError, match="out must be"):
        finish_planes_cute(acc, m, s, lse, dt, out=torch.zeros(acc.shape, dtype=torch.float16))
    out = torch.zeros(acc.shape, dtype=dt)
    with pytest.raises(ValueError, match="lse must have shape"):
        plan_finish(acc, m, s, out, lse[:, :2], "sm_90a")
    with pytest.raises(ValueError, match="m must have shape"):
        plan_finish(acc, m.transpose(1, 2), s, out, lse, "sm_90a")
    with pytest.raises(ValueError, match="out must have"):
        plan_finish(acc, m, s, out[:, :4], lse, "sm_90a")
    with pytest.raises(ValueError, match="out_acc must be"):
        plan_finish(acc[0], m, s, out[0], lse, "sm_90a")


def test_plan_vector_width_and_refusals():
    acc, m, s, lse, dt = _planes_case(2, 16, 3, 128)
    out = torch.zeros(acc.shape, dtype=dt)
    assert plan_finish(acc, m, s, out, lse, "sm_90a") == FinishKey("bfloat16", 128, 8, "sm_90a")
    assert plan_finish(acc, m, s, out.half(), lse, "sm_100a").out_dtype == "float16"
    halves = plan_finish(acc[:, 5:11], m[..., 5:11], s[..., 5:11], out[:, 5:11], lse[..., 5:11], "sm_90a")
    assert halves.vec == 8  # zigzag-style halves of the planes and the accumulator
    assert plan_finish(acc, m, s, None, lse, "sm_90a", torch.bfloat16) == FinishKey("bfloat16", 128, 8, "sm_90a")
    assert plan_finish(acc, m, s, None, lse, "sm_90a", torch.float32) is None  # a new output of an fp32 dtype
    big = torch.zeros(2, 16, 3, 130)
    assert plan_finish(big[..., 2:130], m, s, out, lse, "sm_90a").vec == 2  # rows 8 bytes past 16
    # refused: a float32 output, an fp32 lse that is not, a strided last dim, overlapping lse writes
    assert plan_finish(acc, m, s, out.float(), lse, "sm_90a") is None
    assert plan_finish(acc, m, s, out, lse.double(), "sm_90a") is None
    assert plan_finish(acc.half(), m, s, out, lse, "sm_90a") is None
    assert plan_finish(torch.zeros(2, 16, 3, 256)[..., ::2], m, s, out, lse, "sm_90a") is None
    assert plan_finish(acc, m, s, out, lse[:, :1].expand(2, 3, 16), "sm_90a") is None


# ---------------------------------------------------------------------------------------------- GPU


def _random_planes(g, b, n_s, h, d):
    """Accumulator and (M, S) planes as a ring leaves them: S in [1, 8], M finite except rows 3:6,
    which are -inf with S 0 (never reached) or 1 (a first block's fully masked rows)."""
    acc = torch.randn(b, n_s, h, d, generator=g) * 4
    planes = torch.empty(b, h, 2, n_s)
    planes[:, :, 0] = 3 * torch.randn(b, h, n_s, generator=g)
    planes[:, :, 1] = 1 + 7 * torch.rand(b, h, n_s, generator=g)
    planes[:, :, 0, 3:6] = -math.inf
    planes[:, :, 1, 3:5] = 0.0
    planes[:, :, 1, 5] = 1.0
    acc[:, 3:6] = 0.0
    return acc.cuda(), planes.cuda()


def _check(acc, planes, rows: slice, dtype):
    """The kernel on rows ``rows`` of every view against Tensor.to and planes_lse; nothing else moved."""
    from ringfa4.kernels.merge import planes_lse

    b, n_s, h, d = acc.shape
    lse = torch.full((b, h, n_s), 7.0, device=acc.device)
    out = torch.full(acc.shape, 7.0, dtype=dtype, device=acc.device)
    a, p = acc[:, rows], planes[..., rows]
    got = finish_planes_cute(a, p[:, :, 0], p[:, :, 1], lse[..., rows], dtype, out=out[:, rows])
    assert got is not None and got.data_ptr() == out[:, rows].data_ptr()
    torch.cuda.synchronize()
    assert torch.equal(out[:, rows], a.to(dtype))
    want = planes_lse(p)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isneginf(lse[..., rows]), torch.isneginf(want)) and not torch.isnan(lse).any()
    assert (lse[..., rows][fin] - want[fin]).abs().max().item() <= 4e-7 * max(1.0, want[fin].abs().max().item())
    outside_o = torch.ones(out.shape, dtype=torch.bool, device=out.device)
    outside_o[:, rows] = False
    outside_l = torch.ones(lse.shape, dtype=torch.bool, device=lse.device)
    outside_l[..., rows] = False
    assert (out[outside_o] == 7.0).all() and (lse[outside_l] == 7.0).all()
    fresh = finish_planes_cute(a, p[:, :, 0], p[:, :, 1], torch.empty_like(want), dtype)
    assert fresh.is_contiguous() and torch.equal(fresh, a.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 64, 80])
def test_gpu_equals_cast_and_planes_lse(dtype, d):
    g = torch.Generator().manual_seed(d)
    for b, n_s, h in [(1, 257, 5), (2, 40, 3), (3, 17, 8)]:  # row counts that leave the last CTA partial
        acc, planes = _random_planes(g, b, n_s, h, d)
        _check(acc, planes, slice(0, n_s), dtype)
        _check(acc, planes, slice(n_s // 2, n_s), dtype)  # the zigzag's second half
        _check(acc, planes, slice(1, 12), dtype)  # an odd window


@pytest.mark.gpu
def test_gpu_ring_forward_finishes_in_one_launch(monkeypatch):
    """A dense FA4 ring forward (simulated, epilogue merge) finishes each rank with the kernel:
    out the same as the torch finish's bit for bit, lse to an ulp."""
    pytest.importorskip("flash_attn.cute")
    import ringfa4
    from ringfa4 import AttnSpec, RingOptions
    from ringfa4.parallel.ring import forward

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4096, n, 128, generator=g).to(torch.bfloat16).cuda() for n in (8, 2, 2))
    cp = ringfa4.ContextParallel.simulated(4, options=RingOptions(launch_tapes="off"))
    made = []
    real = forward.finish_planes_cute
    monkeypatch.setattr(forward, "finish_planes_cute", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    o1, l1 = cp.attention(q, k, v, AttnSpec(causal=True))
    assert len(made) == 4 and all(m is not None for m in made)  # one kernel a rank
    monkeypatch.setattr(forward, "finish_planes_cute", lambda *a, **kw: None)  # the torch finish
    o0, l0 = cp.attention(q, k, v, AttnSpec(causal=True))
    assert torch.equal(o1, o0)
    assert torch.equal(torch.isneginf(l1), torch.isneginf(l0))
    fin = torch.isfinite(l0)
    assert fin.all()  # causal: every row sees itself
    assert (l1 - l0).abs().max().item() <= 4e-7 * l0.abs().max().item()


if __name__ == "__main__":  # subprocess entry: python test_cute_finish.py ARCH DUMP_DIR RESULT_JSON
    cute_compile.compile_main(_compile_all)
