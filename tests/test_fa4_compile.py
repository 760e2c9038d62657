"""CI compile tests of the fa4 backend, no GPU needed.

flash-attn-4 compiles real Hopper / Blackwell kernels on a CPU machine when its calls run under
``FakeTensorMode`` with ``FLASH_ATTENTION_ARCH`` (kernel choice), ``CUTE_DSL_ARCH`` (compile target)
and ``FLASH_ATTENTION_NUM_SMS`` set. FA4 caches the arch on first use (``_get_device_arch`` is an
lru_cache) and CuTe DSL reads ``CUTE_DSL_ARCH`` when it is imported, so each arch compiles in its own
subprocess (this file run as a script); the two run side by side. Every call goes through our
``Fa4Backend.forward`` / ``backward``, so our argument mapping is what compiles.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cute_compile
import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"sm_90a": ("sm_90", "132"), "sm_100a": ("sm_100", "148")}
KERNELS = {  # kernel classes whose PTX/cubin must appear in the dump for each arch
    "sm_90a": ("FlashAttentionForwardSm90", "FlashAttentionBackwardSm90"),
    "sm_100a": ("FlashAttentionForwardSm100", "FlashAttentionBackwardSm100"),
}

# (name, dense (b, s_q, s_k) or varlen (q lengths, k lengths), h, h_kv, d, AttnSpec kwargs, fresh)
# fresh: "f" / "b" when the pattern needs a forward / backward kernel that no earlier pattern compiled
# (checked through FA4's JIT cache, and sm90's dense backward, deterministic too, through the cache of
# the prepared single-call backward, kernels/fa4/plain_backward.py, varlen too; sm90's forwards, varlen
# too, through the prepared single-call forwards' cache). Window sizes and sequence lengths
# are runtime values, so e.g. causal + left window reuses the (left, right) kernel and s_q > s_k
# reuses the s_q < s_k one. Shapes matter a little: with a single query tile per head (two on sm100)
# the forward takes a static persistent scheduler, a kernel of its own, so most patterns use
# s_q > 256 like real ring blocks.
PATTERNS = [
    ("causal_sq<sk", (2, 384, 512), 4, 4, 128, dict(causal=True), "fb"),
    ("causal_sq>sk", (2, 512, 384), 4, 4, 128, dict(causal=True), ""),
    ("full_sq<sk", (2, 384, 512), 4, 4, 128, dict(), "fb"),
    ("window_l_r", (2, 384, 384), 4, 4, 128, dict(window=(96, 32)), "fb"),
    ("causal_window_l", (2, 384, 512), 4, 4, 128, dict(causal=True, window=(128, None)), ""),
    ("anticausal_0_none", (2, 384, 384), 4, 4, 128, dict(window=(0, None)), "fb"),
    ("gqa_causal", (2, 384, 512), 8, 2, 128, dict(causal=True), "fb"),
    ("gqa_full", (2, 512, 384), 8, 2, 128, dict(), "fb"),
    ("d64_causal", (2, 384, 256), 4, 4, 64, dict(causal=True), "fb"),
    ("d64_full", (2, 384, 512), 4, 4, 64, dict(), "fb"),
    ("softcap_causal", (2, 384, 384), 4, 4, 128, dict(causal=True, softcap=30.0, softmax_scale=0.1), "fb"),
    ("deterministic_causal", (2, 384, 384), 4, 4, 128, dict(causal=True, deterministic=True), "b"),
    ("gqa_deterministic_causal", (2, 384, 512), 8, 2, 128, dict(causal=True, deterministic=True), "b"),
    ("short_causal", (2, 128, 384), 4, 4, 128, dict(causal=True), ""),  # sm100: own (persistent) kernel
    ("varlen_causal", ([64, 192, 320], [64, 192, 320]), 4, 4, 128, dict(causal=True), "fb"),
    ("varlen_gqa_causal", ([100, 0, 300], [200, 0, 300]), 8, 2, 128, dict(causal=True), "fb"),
    ("varlen_gqa_full", ([128, 320, 64], [256, 64, 192]), 8, 2, 128, dict(), "fb"),
    ("varlen_gqa_deterministic", ([100, 300], [200, 300]), 8, 2, 128, dict(causal=True, deterministic=True), "b"),
]


def _target_hardware_info(num_sms: int) -> None:
    """Answer CuTe DSL's HardwareInfo queries for the target SKU: there is no CUDA driver here.

    FA4's persistent tile schedulers (sm100 dense non-causal, for one) ask the driver for the SM
    count while compiling (to size the grid), which FLASH_ATTENTION_NUM_SMS does not cover.
    """
    import cutlass.utils
    import cutlass.utils.hardware_info
    from flash_attn.cute import tile_scheduler

    class TargetHardwareInfo:
        def __init__(self, device_id: int = 0) -> None:
            self.device_id = device_id

        def get_device_multiprocessor_count(self) -> int:
            return num_sms

        def get_max_active_clusters(self, cluster_size: int, stream=None) -> int:
            return num_sms // cluster_size

        def get_l2_cache_size_in_bytes(self) -> int:
            return 50 * 2**20

    for module in (cutlass.utils, cutlass.utils.hardware_info, tile_scheduler):
        module.HardwareInfo = TargetHardwareInfo


def _run_patterns(arch: str, dump_dir: str) -> list[dict]:
    """Compile every pattern for ``arch`` in this process (env already set); assert as we go."""
    import torch
    from flash_attn.cute import interface
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

    from ringfa4.kernels import AttnSpec
    from ringfa4.kernels.fa4 import backend as fa4_module
    from ringfa4.kernels.fa4 import fp32_forward, plain_backward
    from ringfa4.kernels.fa4.backend import Fa4Backend
    from ringfa4.kernels.validate import validate_block

    _target_hardware_info(int(os.environ["FLASH_ATTENTION_NUM_SMS"]))
    # The deterministic backward's semaphores go through torch's __dlpack__, which asks CUDA for the
    # current device (a CPU-only torch cannot answer): the fake tensors all live on cuda:0.
    torch.cuda.current_device = lambda: 0
    mode = FakeTensorMode()
    backend = Fa4Backend()
    fwd_cache = interface._flash_attn_fwd.compile_cache.cache
    bwd_cache = interface._flash_attn_bwd.compile_cache.cache
    bf16 = torch.bfloat16

    # A fake cu_seqlens has no values, so validate_block (which reads them on the host) checks a
    # real CPU copy; everything else in fa4.py sees the fake CUDA tensors.
    def cu_seqlens(lengths: list[int]) -> torch.Tensor:
        with mode:
            fake = torch.empty(len(lengths) + 1, dtype=torch.int32, device="cuda")
        fake.host_copy = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return fake

    def validate_on_host(q, k, v, spec, where=""):
        if spec.varlen:
            spec = spec.replace(cu_seqlens_q=spec.cu_seqlens_q.host_copy, cu_seqlens_k=spec.cu_seqlens_k.host_copy)
        with unset_fake_temporarily():  # real host tensors inside the fake mode
            validate_block(q, k, v, spec, where)

    fa4_module.validate_block = validate_on_host

    results = []
    gc.disable()  # collected per pattern below: what the compiles leave in reference cycles
    for name, sizes, h, h_kv, d, kw, fresh in PATTERNS:
        gc.collect()
        kw = dict(kw)
        if isinstance(sizes[0], list):  # varlen: (q lengths, k lengths) of the documents
            lq, lk = sizes
            kw.update(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk),
                      max_seqlen_q=max(lq), max_seqlen_k=max(lk))
            q_lead, k_lead, lse_shape = (sum(lq),), (sum(lk),), (h, sum(lq))
        else:
            b, s_q, s_k = sizes
            q_lead, k_lead, lse_shape = (b, s_q), (b, s_k), (b, h, s_q)
        with mode:
            spec = AttnSpec(**kw)
            q = torch.empty(*q_lead, h, d, dtype=bf16, device="cuda")
            k = torch.empty(*k_lead, h_kv, d, dtype=bf16, device="cuda")
            v = torch.empty(*k_lead, h_kv, d, dtype=bf16, device="cuda")
            # forwards: FA4's entry point's kernels, or (sm90 dense) FA4's kernel class prepared by ours
            n_plain, n_entry = len(plain_backward._CACHE), len(fwd_cache)
            n_fwd, n_bwd, t0 = len(fwd_cache) + len(fp32_forward._CACHE), len(bwd_cache) + n_plain, time.perf_counter()
            out, lse = backend.forward(q, k, v, spec)
            t1 = time.perf_counter()
            dq, dk, dv = backend.backward(torch.empty_like(out), q, k, v, out, lse, spec)
            t2 = time.perf_counter()
        got = {"out": (out, q.shape, bf16), "lse": (lse, lse_shape, torch.float32),
               "dq": (dq, q.shape, bf16), "dk": (dk, k.shape, bf16), "dv": (dv, v.shape, bf16)}
        for what, (t, shape, dtype) in got.items():
            assert isinstance(t, FakeTensor) and t.device.type == "cuda", (name, what, type(t), t.device)
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (name, what, t.shape, t.dtype)
        new_fwd = len(fwd_cache) + len(fp32_forward._CACHE) - n_fwd
        new_bwd = len(bwd_cache) + len(plain_backward._CACHE) - n_bwd
        # sm90's backward, dense or varlen (deterministic too): FA4's own kernels from ringfa4's prepared
        # plan (its preprocess and postprocesses compile through FA4's helpers, counted in its caches)
        prepared = arch == "sm_90a"
        assert len(plain_backward._CACHE) - n_plain == (new_bwd if prepared else 0), (name, new_bwd)
        # sm90's single forward, dense and varlen: FA4's own kernel class from ringfa4's prepared plan
        # (fp32_forward.prepare_plain, varlen_fwd.prepare_plain_varlen), never FA4's entry point
        assert arch != "sm_90a" or len(fwd_cache) == n_entry, (name, "FA4's forward entry point compiled")
        assert new_fwd >= ("f" in fresh) and new_bwd >= ("b" in fresh), (
            f"{name}: expected a fresh compile ({fresh!r}), got {new_fwd} forward, {new_bwd} backward")
        del q, k, v, out, lse, dq, dk, dv, got
        cyclic = _tensors_in_cycles()  # a compile that kept the call's tensors in cycles would hold
        assert cyclic == 0, (name, cyclic)  # their memory until Python's gc next runs
        results.append(dict(name=name, new_fwd=new_fwd, new_bwd=new_bwd, cyclic_tensors=cyclic,
                            fwd_s=round(t1 - t0, 2), bwd_s=round(t2 - t1, 2)))

    # The compile target really was `arch`: its PTX and cubin are in the dump for both directions.
    files = os.listdir(dump_dir)
    for cls in KERNELS[arch]:
        ptx = [f for f in files if cls in f and f.endswith(f".{arch}.ptx")]
        cubin = [f for f in files if cls in f and f.endswith(f".{arch}.cubin")]
        assert ptx and cubin, f"no PTX/cubin of {cls} for {arch} in {dump_dir}: {sorted(files)[:8]}"
        text = Path(dump_dir, ptx[0]).read_text(errors="replace")
        assert f".target {arch}" in text, f"{ptx[0]} does not target {arch}"
    return results


def _tensors_in_cycles() -> int:
    """Tensors that only Python's cyclic gc would free (collected now, counted)."""
    import torch

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def _start(arch: str, tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    fa_arch, num_sms = ARCHS[arch]
    dump = tmp / f"dump_{arch}"
    dump.mkdir()
    result, log = tmp / f"result_{arch}.json", tmp / f"log_{arch}.txt"
    env = dict(FLASH_ATTENTION_ARCH=fa_arch, CUTE_DSL_ARCH=arch, FLASH_ATTENTION_NUM_SMS=num_sms,
               FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1",
               CUTE_DSL_DUMP_DIR=str(dump))
    return cute_compile.start(__file__, [arch, str(dump), str(result)], env, log), result, log


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory):
    """Start one compile subprocess per arch, side by side (each is mostly single-threaded)."""
    from ringfa4.kernels.registry import fa4_installed

    if not fa4_installed() or importlib.util.find_spec("triton") is None:  # checked without importing them
        pytest.skip("needs flash-attn-4, nvidia-cutlass-dsl and triton (pip install 'ringfa4[gpu]')")
    tmp = tmp_path_factory.mktemp("fa4_compile")
    runs = {arch: _start(arch, tmp) for arch in ARCHS}
    yield runs
    cute_compile.stop(r[0] for r in runs.values())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fa4_patterns_compile(compile_runs, arch):
    proc, result, log = compile_runs[arch]
    cute_compile.wait_ok(proc, log, arch, timeout=280)
    results = json.loads(result.read_text())
    assert [r["name"] for r in results] == [p[0] for p in PATTERNS]
    print(f"\n{arch}: " + ", ".join(f"{r['name']} {r['fwd_s']}+{r['bwd_s']}s {r['cyclic_tensors']}" for r in results))


def test_import_does_not_load_flash_attn():
    code = ("import sys, ringfa4.kernels, ringfa4.kernels.fa4.backend, ringfa4.kernels.fa4.epilogue_merge\n"
            "import ringfa4.kernels.fa4.bwd_accum\n"
            "from ringfa4.kernels import registry\n"
            "registry.fa4_installed(); registry.resolve('auto', 'cpu')\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'cutlass', 'quack'))\n"
            "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fa4_refuses_cpu_and_fp32():
    import torch

    from ringfa4.kernels import AttnSpec
    from ringfa4.kernels.fa4.backend import Fa4Backend, Fa4Unsupported

    q = torch.zeros(1, 8, 2, 64)
    with pytest.raises(Fa4Unsupported, match="fp16/bf16"):
        Fa4Backend().forward(q, q, q, AttnSpec())
    with pytest.raises(NotImplementedError, match="CUDA"):
        Fa4Backend().forward(q.bfloat16(), q.bfloat16(), q.bfloat16(), AttnSpec())
    with pytest.raises(NotImplementedError, match="fp16/bf16"):
        Fa4Backend().backward(q, q, q, q, q, torch.zeros(1, 2, 8), AttnSpec())


if __name__ == "__main__":  # subprocess entry: python test_fa4_compile.py ARCH DUMP_DIR RESULT_JSON
    _arch, _dump, _result = sys.argv[1:4]
    _t0 = time.perf_counter()
    _res = _run_patterns(_arch, _dump)
    Path(_result).write_text(json.dumps(_res))
    print(f"{_arch}: {len(_res)} patterns in {time.perf_counter() - _t0:.1f}s")
