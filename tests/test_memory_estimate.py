"""The step-memory formula (ringfa4.memory.estimate) against the H200 measurements stored in
benchmarks/results, and the parts it adds up."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringfa4.memory.estimate import GIB, StepMemory, step_peak_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = [ROOT / "benchmarks/results/capacity_h200.json", ROOT / "benchmarks/results/capacity_2l_h200.json"]
SCRIPT = ROOT / "benchmarks/memory_formula.py"


def test_formula_predicts_every_measured_step(tmp_path):
    out = tmp_path / "formula.json"
    subprocess.run([sys.executable, str(SCRIPT), *map(str, RESULTS), "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)  # also fails if estimate.py drifted from the refit
    rows = json.loads(out.read_text())
    assert {(r["layers"], r["seq"]) for r in rows} >= {(2, 1 << 19), (2, 1 << 20), (32, 1 << 18)}
    validation = [r for r in rows if r["layers"] == 32]
    assert len(validation) >= 8 and sum(r["in_fit"] for r in validation) >= 4  # left-out refits, not the floor only
    for r in validation:
        assert r["role"] == "validation"
        assert abs(r["error"]) <= 0.05, r
        assert r["loo_error"] is not None and abs(r["loo_error"]) <= 0.05, r
    # The reduced-depth (2-layer) steps are the only points at u = 4 and 8 GiB: they anchor the
    # extrapolation to full-size steps, so a refit without one of them moves the line (leave-one-out
    # +6.4% / -5.3%); held in-sample (+4.4% / -0.7%).
    for r in rows:
        if r["layers"] < 32:
            assert r["role"] == "fit" and r["in_fit"]
            assert abs(r["error"]) <= 0.05, r


def test_drifted_constants_fail_the_check(tmp_path):
    """benchmarks/memory_formula.py exits nonzero when estimate.py's constants leave the refit."""
    code = ("import runpy, sys; import ringfa4.memory.estimate as e; e.SLOPE += 0.1; "
            f"sys.argv = ['memory_formula.py', *{list(map(str, RESULTS))!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "differs from the least-squares refit" in r.stderr, r.stderr


def test_parts_of_a_step():
    u = 1 << 20 << 12 << 1  # one hidden-size bf16 tensor of 1M tokens: 8 GiB
    base = StepMemory(tokens=1 << 20, hidden=4096, dtype_bytes=2, state_bytes=15 * GIB, gpu=2)
    p = step_peak_bytes(base)
    assert p["inputs_gpu"] == 2 * u and p["inputs_host"] == 0
    assert p["total"] == p["state"] + p["inputs_gpu"] + p["working_set"]
    assert p["working_set"] == pytest.approx(11.38 * u - 2.62 * GIB)
    grouped = step_peak_bytes(StepMemory(**{**base.__dict__, "gpu": 0, "host": 11, "group": 3}))
    assert grouped["inputs_gpu"] == 3 * u and grouped["inputs_host"] == 11 * u  # 2 rebuilding + 1 fetched
    old = step_peak_bytes(StepMemory(**{**base.__dict__, "lora_fp32": True, "plain_norms": True}))
    assert old["working_set"] - p["working_set"] == pytest.approx(16.51 * u)  # fitted together, split 7:13
    lora = step_peak_bytes(StepMemory(**{**base.__dict__, "lora_fp32": True}))
    assert lora["working_set"] - p["working_set"] == pytest.approx(16.51 * 7 / 20 * u, rel=1e-3)
    short = step_peak_bytes(StepMemory(**{**base.__dict__, "tokens": 4096}))
    assert short["working_set"] == pytest.approx(16.7 * GIB)  # the floor: loss chunk and optimizer


@pytest.mark.parametrize("config", ["llama3_8b_1xh200_1m.toml", "llama3_8b_8xh200_4m.toml"])
def test_long_configs_fit_one_h200(config):
    """The dry-run estimates of the 1M (one H200) and 4M (CP 8, 512k per rank) configs, under the H200's
    139 GiB (126.7 and 130.0 GiB with the constants of 2026-11-29)."""
    r = subprocess.run([sys.executable, str(ROOT / "recipes/finetune.py"), str(ROOT / "recipes/configs" / config),
                        "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("memory estimate per rank"))
    total = float(line.rsplit("total_gpu ", 1)[1])
    assert 100 < total < 139, line
