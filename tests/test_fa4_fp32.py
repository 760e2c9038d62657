"""The fp32-output FA4 forward (ringfa4.kernels.fa4.fp32_forward).

CPU (CI): the kernels compile for sm_90a and sm_100a under ``FakeTensorMode``, one subprocess per
arch (this file run as a script; CuTe DSL reads ``CUTE_DSL_ARCH`` at import), side by side; the PTX
shows O leaving as float32: on sm90 straight from the MMA registers (``st.global.v2.b32``, d / 4 per
thread, no TMA store), on sm100 through a float32 sO (``st.shared.v4.b32``, q_stage * d / 4 per
thread, twice bf16's count) and a 5-D TMA store.
GPU (``-m gpu``, Hopper / Blackwell): against float64 attention, the fp32 output is at least as
accurate as FA4's own bf16 output, rounds to it, and its lse matches FA4's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cute_compile
import pytest
import torch

from ringfa4.kernels import AttnSpec

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"sm_90a": "sm_90", "sm_100a": "sm_100"}
# (name, head_dim, causal, kwargs of compile_only)
CASES = [
    ("d128_causal", 128, True, {}),
    ("d128_full", 128, False, {}),
    ("d64_causal", 64, True, {}),
    ("d64_full", 64, False, {}),
    ("gqa_window", 128, False, dict(window=(96, 32), shape=(2, 384, 512, 8, 2))),
    ("softcap_causal_short", 128, True, dict(softcap=30.0, shape=(2, 128, 384, 4, 4))),
]
# the merging epilogue (kernels/fa4/epilogue_merge.py): sm90 only
MERGE_COMPILE = [
    ("merge_d128_causal", 128, True, dict()),
    ("merge_d64_gqa_window", 64, False, dict(window=(96, 32), shape=(2, 384, 512, 8, 2))),
]
# FA4's own kernel class prepared for a single call (prepare_plain, sm90): O in q's dtype through its TMA store
PLAIN_COMPILE = [
    ("plain_d128_causal", 128, True, dict()),
    ("plain_gqa_window", 128, False, dict(window=(96, 32), shape=(2, 384, 512, 8, 2))),
]


def _compile_cases(arch: str) -> list[dict]:
    """Compile every case for ``arch`` in this process (env already set); assert on each PTX."""
    import cutlass

    from ringfa4.kernels.fa4 import epilogue_merge
    from ringfa4.kernels.fa4 import fp32_forward as fa4_fp32

    results = []
    cases = [(c, fa4_fp32.compile_only) for c in CASES]
    if arch == "sm_90a":
        cases += [(c, epilogue_merge.compile_only) for c in MERGE_COMPILE]
        cases += [(c, fa4_fp32.compile_only_plain) for c in PLAIN_COMPILE]
    for (name, d, causal, kw), compile_only in cases:
        t0 = time.perf_counter()
        entry = compile_only(arch, torch.bfloat16, d, causal, **kw)
        ptx = entry.fn.__ptx__
        assert isinstance(ptx, str) and f".target {arch}" in ptx, (name, "no PTX for", arch)
        assert entry.fn.__cubin__, (name, "no cubin")
        stores = re.findall(r"st\.global\.v\d\.b32|cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)
        if name.startswith("plain"):
            assert type(entry.kernel).__name__ == "FlashAttentionForwardSm90" and entry.key.plain, name
            assert entry.key.pack_gqa == (kw.get("shape", (0, 0, 0, 4, 4))[3] > kw.get("shape", (0, 0, 0, 4, 4))[4])
            assert stores and set(stores) == {"cp.async.bulk.tensor.4d.global.shared"}, (name, stores)  # bf16 O: TMA
        elif name.startswith("merge"):
            # O read back and written once from registers; the running lse read and the block lse stored
            assert type(entry.kernel).__name__ == "_Sm90MergeOut" and entry.key.merge, name
            assert stores == ["st.global.v2.b32"] * (d // 4), (name, stores)
            assert re.findall(r"ld\.global\.v\d\.b32", ptx) == ["ld.global.v2.b32"] * (d // 4), name
            assert len(re.findall(r"ld\.global\.b32", ptx)) == len(re.findall(r"st\.global\.b32", ptx)) > 0, name
        elif arch == "sm_90a":
            assert entry.kernel.use_tma_O is False, name
            # every thread stores its d / 4 float32 pairs of O; no TMA store of O from smem
            assert stores == ["st.global.v2.b32"] * (d // 4), (name, stores)
        else:
            assert entry.kernel.o_dtype is cutlass.Float32 and entry.kernel.is_split_kv, name
            assert set(stores) == {"cp.async.bulk.tensor.5d.global.shared"}, (name, stores)
            smem = ptx.count("st.shared.v4.b32")  # fp32 sO: one row of d floats per thread and stage
            assert smem == entry.key.q_stage * d // 4, (name, smem, entry.key)
        results.append(dict(name=name, seconds=round(time.perf_counter() - t0, 2), key=repr(entry.key)))
    return results


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    """One compile subprocess per arch, started side by side."""
    from ringfa4.kernels.registry import fa4_installed

    if not fa4_installed():
        pytest.skip("needs flash-attn-4 and nvidia-cutlass-dsl (pip install 'ringfa4[gpu]')")
    tmp = tmp_path_factory.mktemp("fa4_fp32")
    runs = {}
    for arch, fa_arch in ARCHS.items():
        result, log = tmp / f"result_{arch}.json", tmp / f"log_{arch}.txt"
        dump = tmp / f"dump_{arch}"
        dump.mkdir()
        env = dict(FLASH_ATTENTION_ARCH=fa_arch, CUTE_DSL_ARCH=arch, FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0",
                   CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(dump))
        runs[arch] = (cute_compile.start(__file__, [arch, str(result)], env, log), result, log)
    yield runs
    cute_compile.stop(r[0] for r in runs.values())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_forward_compiles(compile_runs, arch):
    proc, result, log = compile_runs[arch]
    cute_compile.wait_ok(proc, log, arch, timeout=120)
    results = json.loads(result.read_text())
    assert [r["name"] for r in results] == [c[0] for c in CASES + (MERGE_COMPILE + PLAIN_COMPILE
                                                                    if arch == "sm_90a" else [])]
    print(f"\n{arch}: " + ", ".join(f"{r['name']} {r['seconds']}s" for r in results))


def test_empty_rows():
    from ringfa4.kernels.fa4.fp32_forward import _empty_rows

    assert _empty_rows(512, 256, True, None, None) == [(0, 256)]  # bottom-right causal, s_q > s_k
    assert _empty_rows(256, 512, True, None, None) == []
    assert _empty_rows(512, 256, False, None, 10) == [(0, 246)]
    assert _empty_rows(256, 512, False, 10, None) == []
    assert _empty_rows(256, 100, False, None, None) == []
    # brute force against the definition: row i sees keys i + s_k - s_q - wl .. i + s_k - s_q + wr
    def sees_no_key(i, s_q, s_k, wl, wr):
        first = max(0, i + s_k - s_q - (10**9 if wl is None else wl))
        last = min(s_k - 1, i + s_k - s_q + (10**9 if wr is None else wr))
        return first > last

    for s_q, s_k, wl, wr in [(300, 40, 5, 0), (40, 300, 0, 3), (64, 64, 0, 0), (10, 5, 2, None), (5, 10, None, 0)]:
        want = {i for i in range(s_q) if sees_no_key(i, s_q, s_k, wl, wr)}
        got = {i for a, b in _empty_rows(s_q, s_k, False, wl, wr) for i in range(a, b)}
        assert got == want, (s_q, s_k, wl, wr)


@pytest.mark.parametrize("error", [ValueError, NotImplementedError, AssertionError])
def test_fa4_backend_falls_back_when_the_fp32_kernel_cannot(monkeypatch, error):
    """Fa4Backend.forward with an fp32 ``out=``: a call the fp32-output kernel does not cover
    (ValueError / NotImplementedError: e.g. d != d_v) runs FA4's own forward and widens its output
    into ``out``; FA4 refusing the call (AssertionError) is Fa4Unsupported, as for bf16 outputs.
    (CPU tensors stand in; FA4 itself is faked by the reference backend.)"""
    from ringfa4.kernels.fa4 import backend as fa4
    from ringfa4.kernels.reference import ReferenceBackend

    def fp32_kernel(*args):
        raise error("not covered")

    def fa4_forward(q, k, v, softmax_scale, causal, softcap, window_size_left, window_size_right, return_lse,
                    out, lse):
        assert out is None and return_lse
        o, l = ReferenceBackend().forward(q, k, v, AttnSpec(causal=causal, softmax_scale=softmax_scale))
        lse.copy_(l)
        return o, lse

    monkeypatch.setattr(fa4, "_check_inputs", lambda q, spec: None)
    monkeypatch.setattr(fa4, "_forward_fp32", fp32_kernel)
    monkeypatch.setattr(fa4, "_kernels", lambda: (fa4_forward, None))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    out, lse = torch.full((1, 64, 2, 16), math.nan), torch.empty(1, 2, 64)
    if error is AssertionError:
        with pytest.raises(fa4.Fa4Unsupported):
            fa4.Fa4Backend().forward(q, k, v, AttnSpec(causal=True), out=out, lse=lse)
        return
    o, l = fa4.Fa4Backend().forward(q, k, v, AttnSpec(causal=True), out=out, lse=lse)
    want = ReferenceBackend().forward(q, k, v, AttnSpec(causal=True))
    assert o is out and l is lse and o.dtype == torch.float32
    assert torch.equal(o, want[0].float()) and torch.equal(l, want[1])


def test_rejects_bad_inputs_without_loading_flash_attn():
    code = """
import sys, torch
from ringfa4.kernels.fa4.fp32_forward import fa4_forward_fp32 as f
q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
for args, kw, exc in [((q.float(), q.float(), q.float()), {}, TypeError),
                      ((q, q[:, :, :1], q), {}, ValueError),
                      ((q, q, q[..., :32]), {}, ValueError),
                      ((q, q[:, :, :1].expand(1, 8, 3, 64), q[:, :, :1].expand(1, 8, 3, 64)), {}, ValueError),
                      ((q, q, q), dict(window=(-2, 4)), ValueError)]:
    try:
        f(*args, causal=False, softmax_scale=0.1, **kw)
    except exc:
        pass
    else:
        raise AssertionError((args[0].dtype, kw))
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'cutlass', 'quack'))
assert not bad, bad
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # (name, (b, s_q, s_k, h, h_kv, d), kwargs)
    ("causal", (2, 384, 512, 4, 4, 128), dict(causal=True)),
    ("full", (2, 512, 384, 4, 4, 128), dict(causal=False)),
    ("causal_sq>sk", (2, 512, 256, 4, 4, 128), dict(causal=True)),  # 256 query rows see no key
    ("d64_causal", (2, 384, 256, 4, 4, 64), dict(causal=True)),
    ("d64_full", (1, 300, 700, 4, 4, 64), dict(causal=False)),
    ("gqa_causal", (2, 384, 512, 8, 2, 128), dict(causal=True)),
    ("gqa_full_short", (2, 100, 333, 8, 2, 128), dict(causal=False)),
    ("window", (2, 384, 384, 4, 4, 128), dict(causal=False, window=(96, 32))),
    ("causal_window", (2, 384, 512, 4, 4, 128), dict(causal=True, window=(128, None))),
    ("softcap_causal", (2, 384, 384, 4, 4, 128), dict(causal=True, softcap=30.0, softmax_scale=0.1)),
    ("fp16_full", (2, 256, 512, 4, 4, 128), dict(causal=False, dtype=torch.float16)),
]


@pytest.fixture(scope="module")
def gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("needs a Hopper (sm90) or Blackwell (sm100) GPU")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed")
    from flash_attn.cute.interface import _flash_attn_fwd

    from ringfa4.kernels.fa4.fp32_forward import fa4_forward_fp32
    return fa4_forward_fp32, _flash_attn_fwd


def _inputs(shape, dtype, seed=0):
    b, s_q, s_k, h, h_kv, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", dtype)  # noqa: E731
    return mk(b, s_q, h, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d)


def _stock(fwd, q, k, v, causal, scale, window, softcap):
    out, lse = fwd(q, k, v, softmax_scale=scale, causal=causal, softcap=softcap, window_size_left=window[0],
                   window_size_right=window[1], return_lse=True)[:2]
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape,kw", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_fp32_forward_vs_float64(gpu, name, shape, kw):
    from helpers import attention64

    fp32_fwd, stock_fwd = gpu
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    causal, window, softcap = kw.pop("causal"), kw.pop("window", (None, None)), kw.pop("softcap", 0.0)
    scale = kw.pop("softmax_scale", shape[-1] ** -0.5)
    q, k, v = _inputs(shape, dtype)
    out, lse = fp32_fwd(q, k, v, causal=causal, softmax_scale=scale, window=window, softcap=softcap)
    out16, lse16 = _stock(stock_fwd, q, k, v, causal, scale, window, softcap)
    ref, ref_lse = attention64(q, k, v, causal=causal, window=window, softcap=softcap, softmax_scale=scale)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse.shape == lse16.shape
    assert torch.isfinite(out).all(), name
    err32 = (out.double() - ref).abs()
    err16 = (out16.double() - ref).abs()
    report = (f"{name}: mean err fp32 {err32.mean():.3g} vs bf16 {err16.mean():.3g}, "
              f"max {err32.max():.3g} vs {err16.max():.3g}")
    print(report)
    assert err32.mean() <= err16.mean() and err32.max() <= err16.max(), report
    # rounded to the input dtype it is FA4's own output, up to one rounding step
    torch.testing.assert_close(out.to(dtype), out16, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(lse, lse16, rtol=1e-5, atol=1e-5)  # -inf rows must match too
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    empty = torch.isinf(ref_lse)  # (b, h, s_q) rows that see no key: out exactly 0
    if empty.any():
        assert (out.permute(0, 2, 1, 3)[empty] == 0).all(), name


@pytest.mark.gpu
def test_fp32_forward_strided_out(gpu):
    fp32_fwd, stock_fwd = gpu
    b, s_q, s_k, h, d = 2, 384, 512, 4, 128
    q, k, v = _inputs((b, s_q, s_k, h, h, d), torch.bfloat16, seed=1)
    out_buf = torch.full((b, s_q, 2 * h, d + 32), math.nan, device="cuda")  # a view of every other head
    lse_buf = torch.full((b, h, s_q + 16), math.nan, device="cuda")
    out_view, lse_view = out_buf[:, :, 1::2, 16:16 + d], lse_buf[..., 8:8 + s_q]
    got = fp32_fwd(q, k, v, causal=True, softmax_scale=d ** -0.5, out=out_view, lse=lse_view)
    assert got[0] is out_view and got[1] is lse_view
    ref_out, ref_lse = fp32_fwd(q, k, v, causal=True, softmax_scale=d ** -0.5)
    torch.testing.assert_close(out_view, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse_view, ref_lse, rtol=0, atol=0)
    assert torch.isnan(out_buf[:, :, 0::2]).all() and torch.isnan(out_buf[..., :16]).all()
    assert torch.isnan(lse_buf[..., :8]).all() and torch.isnan(lse_buf[..., 8 + s_q:]).all()
    _, lse16 = _stock(stock_fwd, q, k, v, True, d ** -0.5, (None, None), 0.0)
    torch.testing.assert_close(lse_view, lse16, rtol=1e-5, atol=1e-5)


MERGE_CASES = [  # (name, (b, s_q, s_k, h, h_kv, d), kwargs of the merged block)
    ("causal_sq>sk", (2, 512, 256, 4, 4, 128), dict(causal=True)),  # its first 256 rows see no key
    ("full_gqa", (2, 300, 384, 8, 2, 128), dict(causal=False)),
    ("window_d64", (1, 384, 384, 4, 4, 64), dict(causal=False, window=(96, 32))),
    ("softcap_fp16", (2, 256, 512, 4, 4, 128), dict(causal=True, softcap=30.0, dtype=torch.float16)),
    ("one_head", (1, 256, 384, 1, 1, 128), dict(causal=True)),  # h = 1: plane 1 found through a size-1 dim
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape,kw", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_epilogue_vs_torch_merge(gpu, name, shape, kw):
    """fa4_merge: a block merged inside FA4's epilogue into a strided fp32 accumulator and a slice of
    (b, h, 2, S) running (M, S) planes equals fa4_forward_fp32 followed by the torch planes merge
    (and, through M + log S, the lse merge); rows where both sides are -inf keep out = 0 and
    (M, S) = (-inf, 0); nothing outside the views is touched."""
    from ringfa4.kernels import merge_lse_
    from ringfa4.kernels.fa4.epilogue_merge import fa4_forward_merge_
    from ringfa4.kernels.merge import merge_planes_, planes_lse

    fp32_fwd, _ = gpu
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    b, s_q, s_k, h, h_kv, d = shape
    q, k, v = _inputs(shape, dtype, seed=2)
    _, k0, v0 = _inputs((b, s_q, 200, h, h_kv, d), dtype, seed=3)
    common = dict(causal=kw.pop("causal"), window=kw.pop("window", (None, None)), softcap=kw.pop("softcap", 0.0),
                  softmax_scale=d ** -0.5)
    o0, l0 = fp32_fwd(q, k0, v0, causal=False, softmax_scale=d ** -0.5)  # the accumulator so far
    o0[:, :16], l0[:, :, :16] = 0.0, -math.inf  # rows no earlier block reached
    start = torch.stack([l0, torch.where(l0 == -math.inf, 0.0, 1.0)], dim=2)  # (M, S) after one block
    ref_o, ref_l, ref_planes = o0.clone(), l0.clone(), start.clone()
    o1, l1 = fp32_fwd(q, k, v, **common)
    merge_lse_(ref_o, ref_l, o1, l1)
    ref_po = o0.clone()
    merge_planes_(ref_po, ref_planes, o1, l1)

    acc_buf = torch.full((b, s_q, 2 * h, d), math.nan, device="cuda")
    acc = acc_buf[:, :, 1::2]  # every other head: a strided accumulator
    acc.copy_(o0)
    planes_buf = torch.full((b, h, 2, s_q + 24), math.nan, device="cuda")
    planes = planes_buf[..., 8:8 + s_q]
    planes.copy_(start)
    got = fa4_forward_merge_(q, k, v, acc, planes, **common)
    assert got.data_ptr() == planes.data_ptr()
    torch.testing.assert_close(planes[:, :, 0], ref_planes[:, :, 0], rtol=0, atol=0)  # M: a max of lse values
    torch.testing.assert_close(planes[:, :, 1], ref_planes[:, :, 1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(planes_lse(planes), ref_l, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc, ref_po, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc, ref_o, rtol=1e-5, atol=1e-6)
    both = torch.isinf(ref_l).permute(0, 2, 1)  # (b, s_q, h)
    assert (acc[both] == 0).all(), name
    assert (planes[:, :, 1][torch.isinf(ref_l)] == 0).all(), name
    assert torch.isnan(acc_buf[:, :, 0::2]).all()
    assert torch.isnan(planes_buf[..., :8]).all() and torch.isnan(planes_buf[..., 8 + s_q:]).all()
    with pytest.raises(ValueError, match="planes"):  # plane 1 is not half a head stride after plane 0
        fa4_forward_merge_(q, k, v, acc, torch.zeros(b, h, 3, s_q, device="cuda")[:, :, :2], **common)


if __name__ == "__main__":  # subprocess entry: python test_fa4_fp32.py ARCH RESULT_JSON
    _t0 = time.perf_counter()
    _res = _compile_cases(sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(_res))
    print(f"{sys.argv[1]}: {len(_res)} cases in {time.perf_counter() - _t0:.1f}s")
