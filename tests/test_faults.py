"""Fault injection over gloo (issue 24): a rank that fails names itself to every other rank within
seconds, a dead or missing rank is named, and after a caught failure the group takes correct
calls. The one place a test asserts wall-clock time: every surviving rank exits within
``POSTED_S`` of a posted error and within the timeout plus ``OVER_S`` otherwise (generous margins
for a loaded 2-core CI machine; the targets are 5 s)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from dist_pool import Pool
from helpers import random_qkv, reference_grads, rel_err

from ringfa4.kernels import AttnSpec, get_backend

TIMEOUT_S = 5.0
POSTED_S = 5.0  # a posted error reaches every waiting rank within this
OVER_S = 8.0  # a timeout (plus the grace that names the missing ranks) ends within TIMEOUT_S + this


@pytest.fixture(scope="module")
def pool3():
    pool = Pool(3, pg_timeout_s=30)
    yield pool
    pool.close()


def _check_after(after, world, ulysses=1):
    """The correct calls after a failure: bit identical to the simulated executor on every rank, and
    within 2x the reference backend's full-sequence error (float64) of float64 math."""
    for i, (_, res) in enumerate(after):
        assert res["identical"], f"call {i} after the failure differs from the simulated executor"
        if "full" in res:
            q, k, v, do = random_qkv(1, 4 * world, 4 * world, 4, 2, 8, dtype=torch.float64, seed=20 + i)
            ref = reference_grads(q, k, v, do, causal=True)
            be = get_backend("reference")
            o, l = be.forward(q, k, v, AttnSpec(causal=True))
            base = [rel_err(x, r) for x, r in zip((o, l, *be.backward(do, q, k, v, o, l, AttnSpec(causal=True))),
                                                  ref)]
            for name, x, r, e0 in zip(("out", "lse", "dq", "dk", "dv"), res["full"], ref, base):
                assert rel_err(x, r) <= 2 * e0 + 1e-12, (i, name)


def _survivors_named(res, failing, what, within=POSTED_S):
    t_fail = res[failing][1]["failed_at"]
    assert t_fail is not None, res[failing]
    assert res[failing][1]["error"] == "RuntimeError" and f"injected {what} failure" in res[failing][1]["message"]
    for r, (status, value) in enumerate(res):
        assert status == "ok", (r, status, value)
        if r == failing:
            continue
        assert value["error"] == "RuntimeError", (r, value)
        assert f"rank {failing}: RuntimeError: injected {what} failure" in value["message"], (r, value["message"])
        assert value["end"] - t_fail < within, (r, value["end"] - t_fail, value["message"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_rank_raises_mid_ring_then_three_correct_calls(pool3, where):
    res = pool3.run("fault_ring", 1, where, TIMEOUT_S, timeout=120)
    _survivors_named(res, 1, where)
    for status, value in res:
        _check_after([(status, a) for a in value["after"]], 3)


@pytest.mark.timeout(240)
def test_rank_raises_in_ulysses_then_three_correct_calls():
    pool = Pool(4, pg_timeout_s=30)
    try:
        res = pool.run("fault_ring", 2, "ulysses", TIMEOUT_S, 2, timeout=120)
    finally:
        pool.close()
    _survivors_named(res, 2, "ulysses")
    for status, value in res:
        _check_after([(status, a) for a in value["after"]], 4, 2)


BAD = [
    ("device", r"^rank 1: device type is meta, expected cpu as on rank 0"),
    ("ulysses_degree", r"^rank 1: ulysses degree is 3, expected 1 as on rank 0 .*before any subgroup is created"),
    ("ulysses_invalid", r"^rank 1: ulysses degree must divide the CP world size 3, got 2$"),
    ("cu_malformed", r"^rank 1: cu_seqlens must .*non-decreasing.*index 2"),
    ("cu_differs", r"^rank 2: cu_seqlens\[2\] is 10, expected 9 as on rank 0"),
    ("pack_mode", r"^rank 0: mode must be one of 'auto', 'balanced', 'ring', 'allgather', got 'bogus'"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_that_used_to_escape_the_check(pool3, kind, message):
    res = pool3.run("fault_bad_input", kind, timeout=60)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({value for _, value in res}) == 1, res
    assert re.search(message, res[0][1]), res[0][1]


@pytest.mark.timeout(120)
def test_a_bad_pack_shard_on_one_rank_reaches_all():
    """rank 1's ``pack.shard`` gets a tensor of the wrong length: it raises at once, and the others,
    waiting in the next call's check, raise the same ValueError within seconds (own pool: rank 1
    never joined that check, so the group is not reused)."""
    pool = Pool(3, pg_timeout_s=30)
    try:
        res = pool.run("fault_bad_input", "pack_shard", timeout=60)
    finally:
        pool.close(join_s=2)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({value for _, value in res}) == 1, res
    assert re.search(r"^rank 1: tensor to shard has 13 tokens along dim 0, expected the pack's total 12", res[0][1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dead", [1, 0])
def test_a_process_exits_mid_ring(dead):
    """Rank ``dead`` ends its process mid-forward: every other rank names it within 10 s; when rank 0
    (the store's host) dies the store goes with it, and the others say so."""
    pool = Pool(3, pg_timeout_s=30)
    try:
        res = pool.run_some("fault_ring", dead, "exit", TIMEOUT_S, 1, 0, timeout=60)
    finally:
        pool.close(join_s=2)
    assert dead not in res and len(res) == 2, res
    for r, (status, value) in res.items():
        assert status == "ok", value
        assert value["error"] == "RuntimeError", (r, value)
        if dead == 0:
            assert "rank 0" in value["message"] and ("store" in value["message"] or "died" in value["message"]), value
        else:
            assert re.search(rf"rank {dead}\b.*died|died.*rank {dead}\b", value["message"]), (r, value["message"])
        assert value["end"] - value["start"] < 10.0 + 5.0, (r, value["end"] - value["start"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late_s", [None, 9.0], ids=["never", "late"])
def test_a_rank_never_calls_or_comes_late(late_s):
    pool = Pool(3, pg_timeout_s=30)
    try:
        res = pool.run("fault_absent", 2, late_s, TIMEOUT_S, timeout=90)
    finally:
        pool.close(join_s=2)
    for r in (0, 1):
        status, value = res[r]
        assert status == "ok" and value["error"] == "RuntimeError", res
        assert "rank(s) 2 never arrived" in value["message"], value["message"]
        assert TIMEOUT_S <= value["end"] - value["start"] < TIMEOUT_S + OVER_S, value["end"] - value["start"]
    status, value = res[2]
    if late_s is None:
        assert value["error"] == "skipped"
    else:  # it finds that the others gave up on the call, and says so within seconds
        assert value["error"] == "RuntimeError" and "gave up" in value["message"], value
        assert value["end"] - value["start"] - late_s < TIMEOUT_S + OVER_S, value


EXIT_RUNS = 12


@pytest.mark.timeout(300)
def test_clean_interpreter_exit_after_packed_calls():
    """gloo, P = 2, six packed calls (mode "auto", zero- and one-token documents), forward and
    backward, then ``destroy_process_group()``: both processes exit with code 0, every run (it used
    to abort at interpreter exit in about 1 run of 5: "terminate called without an active
    exception"; ringfa4 now drops its groups at exit while the interpreter is whole)."""
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_job.py")
    for run in range(EXIT_RUNS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, job, str(r), str(port), "auto", str(run)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        codes = [p.returncode for p in procs]
        assert codes == [0, 0], (run, codes, [o[-600:] for o in outs])


@pytest.mark.timeout(120)
def test_metadata_check_once_per_key(pool3):
    """``RingOptions(metadata_check="new_shapes")`` (issue 23): three calls of one shape, then two
    with a pack, then another length check three times, not six, with bit-identical results."""
    res = pool3.run("metadata_check_once", "repeat", timeout=90)
    assert all(status == "ok" for status, _ in res), res
    for _, value in res:
        assert value == {"checks_once": 3, "checks_every": 6, "identical": True}, value


def _once_in_own_pool(kind: str, timeout_s: float) -> list[dict]:
    """``metadata_check_once(kind, timeout_s)`` on a fresh 3-rank pool (the ranks may leave a call
    unfinished): every rank's outcome."""
    pool = Pool(3, pg_timeout_s=30)
    try:
        res = pool.run("metadata_check_once", kind, timeout_s, timeout=90)
    finally:
        pool.close(join_s=2)
    assert all(status == "ok" for status, _ in res), res
    return [value for _, value in res]


@pytest.mark.timeout(120)
def test_metadata_check_once_when_one_rank_alone_changes():
    """Checking once per key, rank 1 alone changes its call (other head counts) while the others
    repeat the agreed key and skip the check: rank 1 announces its check in the error channel and
    waits for the others to announce theirs; they, waiting in the ring, see it and post the
    ValueError that names rank 1; every rank raises it within seconds, not at the timeout, no rank
    is left in a collective, and the next correct call runs on the same groups."""
    outcomes = _once_in_own_pool("one_rank_changes", 20.0)
    assert all(o["error"] == "ValueError" for o in outcomes), outcomes
    assert len({o["message"] for o in outcomes}) == 1, outcomes
    assert re.search(r"^rank 1: call \d+'s metadata .* differ from the last call the ranks agreed on",
                     outcomes[0]["message"]), outcomes
    assert all(o["end"] - o["start"] < 10 for o in outcomes), outcomes  # well within the 20 s timeout
    assert all(o["after"] == "ok" for o in outcomes), outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["bad_input_after_agreed", "bad_input_on_two"])
def test_metadata_check_once_bad_input_reaches_all(kind):
    """With the check once per key, bad input on one rank (or two) after an agreed call (its k in
    another dtype than q: a local check) still ends as the same ValueError on every rank within seconds
    (posted to the error channel: the others skip the exchange and raise it from their first
    wait), and the next correct call runs (own pool: the others left a call mid-ring)."""
    outcomes = _once_in_own_pool(kind, 20.0)
    assert all(o["error"] == "ValueError" for o in outcomes), outcomes
    assert len({o["message"] for o in outcomes}) == 1, outcomes
    assert re.search(r"^rank [12]: ", outcomes[0]["message"]), outcomes  # two bad ranks: the first post wins
    assert all(o["end"] - o["start"] < 10 for o in outcomes), outcomes  # well within the 20 s timeout
    assert all(o["after"] == "ok" for o in outcomes), outcomes
