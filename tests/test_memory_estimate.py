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


def test_formula_predicts_every_measured_step_within_5_percent(tmp_path):
    out = tmp_path / "formula.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/memory_formula.py"), *map(str, RESULTS), "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    rows = json.loads(out.read_text())
    assert len(rows) >= 8 and sum(r["role"] == "test" for r in rows) >= 4
    assert {(r["layers"], r["seq"]) for r in rows} >= {(2, 1 << 20), (32, 1 << 18)}
    for r in rows:
        assert abs(r["error"]) <= 0.05, r


def test_parts_of_a_step():
    u = 1 << 20 << 12 << 1  # one hidden-size bf16 tensor of 1M tokens: 8 GiB
    base = StepMemory(tokens=1 << 20, hidden=4096, dtype_bytes=2, state_bytes=15 * GIB, gpu=2)
    p = step_peak_bytes(base)
    assert p["inputs_gpu"] == 2 * u and p["inputs_host"] == 0
    assert p["total"] == p["state"] + p["inputs_gpu"] + p["working_set"]
    grouped = step_peak_bytes(StepMemory(**{**base.__dict__, "gpu": 0, "host": 11, "group": 3}))
    assert grouped["inputs_gpu"] == 3 * u and grouped["inputs_host"] == 11 * u  # 2 rebuilding + 1 fetched
    old = step_peak_bytes(StepMemory(**{**base.__dict__, "lora_fp32": True, "plain_norms": True}))
    assert old["working_set"] - p["working_set"] == pytest.approx(20 * u)
    short = step_peak_bytes(StepMemory(**{**base.__dict__, "tokens": 4096}))
    assert short["working_set"] == pytest.approx(16.7 * GIB)  # the floor: loss chunk and optimizer
