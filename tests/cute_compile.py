"""Compile-only checks of our CuTe DSL kernels on a CPU machine, shared by their test files.

A test file names its kernel cases and a ``compile_fn(key, dump_dir=...)``; :func:`spawn` starts one
subprocess per arch (``python <test file> ARCH DUMP RESULT`` with ``CUTE_DSL_ARCH`` set, side by
side), the file's ``__main__`` calls :func:`compile_main`, and :func:`finished_ptx` waits for an
arch and returns the PTX text of each case, checked to target that arch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_90a", "sm_100a")


def compile_cases(compile_fn, make_key, cases, bad_cases, arch: str, dump_dir: str) -> list[dict]:
    """Subprocess side: compile every case (keeping PTX / cubin); every bad case must raise ValueError."""
    results = []
    for case in cases:
        t0 = time.perf_counter()
        assert compile_fn(make_key(*case, arch), dump_dir=dump_dir) is not None
        results.append(dict(case="_".join(map(str, case)), seconds=round(time.perf_counter() - t0, 2)))
    for case in bad_cases:
        try:
            compile_fn(make_key(*case, arch))
        except ValueError:
            continue
        raise AssertionError(f"{case} compiled")
    return results


def compile_main(compile_all) -> None:
    """The ``__main__`` of a test file: ``compile_all(arch, dump)`` into RESULT as JSON."""
    arch, dump, result = sys.argv[1:4]
    t0 = time.perf_counter()
    res = compile_all(arch, dump)
    Path(result).write_text(json.dumps(res))
    print(f"{arch}: {len(res)} kernels in {time.perf_counter() - t0:.1f}s")


def start(test_file: str, args: list[str], env_extra: dict, log: Path) -> subprocess.Popen:
    """``python test_file *args`` from the repo root with ``env_extra``, no GPU, output to ``log``
    (a file, not a pipe: a run nobody waits on yet never blocks)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env_extra,
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with open(log, "w") as sink:
        return subprocess.Popen([sys.executable, test_file, *args], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT)


def wait_ok(proc: subprocess.Popen, log: Path, arch: str, timeout: float = 240) -> None:
    """Wait for a compile subprocess; fail the test with its log when it times out or fails."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{arch}: compiling timed out\n{log.read_text()[-4000:]}")
    assert proc.returncode == 0, f"{arch}: compile subprocess failed\n{log.read_text()[-6000:]}"


def stop(procs) -> None:
    """Kill what is still running (fixture teardown); ``procs`` are Popen objects."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def spawn(test_file: str, tmp: Path) -> dict:
    """Start the per-arch compile subprocesses of ``test_file``; skips without nvidia-cutlass-dsl."""
    if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None:
        pytest.skip("needs nvidia-cutlass-dsl (pip install 'ringfa4[gpu]')")
    runs = {}
    for arch in ARCHS:
        dump, result, log = tmp / f"dump_{arch}", tmp / f"result_{arch}.json", tmp / f"log_{arch}.txt"
        dump.mkdir()
        runs[arch] = (start(test_file, [arch, str(dump), str(result)], {"CUTE_DSL_ARCH": arch}, log), dump, result,
                      log)
    return runs


def finished_ptx(runs: dict, arch: str, names: list[str]) -> tuple[list[dict], dict[str, str]]:
    """Wait for ``arch``'s subprocess; (its timing results, {kernel name: PTX text}), each name
    having exactly one PTX and one cubin for the arch, its entry and ``.target``."""
    proc, dump, result, log = runs[arch]
    wait_ok(proc, log, arch)
    results = json.loads(result.read_text())
    files = os.listdir(dump)
    texts = {}
    for name in names:
        ptx = [f for f in files if name in f and f.endswith(f".{arch}.ptx")]
        cubin = [f for f in files if name in f and f.endswith(f".{arch}.cubin")]
        assert len(ptx) == 1 and len(cubin) == 1, f"{name}: no PTX/cubin for {arch} in {sorted(files)}"
        text = (dump / ptx[0]).read_text(errors="replace")
        assert f".target {arch}" in text and f".entry kernel_cutlass_kernel_{name}" in text, ptx[0]
        texts[name] = text
    return results, texts
