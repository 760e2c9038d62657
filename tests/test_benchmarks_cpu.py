"""The benchmark scripts' step functions run (CPU, reference backend, tiny shapes), so a GPU call is
not the first place they are executed; and the all-to-all volume formula."""

import os
import sys

import pytest
import torch

import ringfa4
from ringfa4.kernels import AttnSpec, get_backend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from _common import cp_step, full_call, rotating  # noqa: E402


def _sets(S=32, h=4, hk=2, d=8):
    return [[torch.randn(1, S, n, d) for n in (h, hk, hk, h)] for _ in range(2)]


def test_common_steps_run_and_rotate():
    sets = _sets()
    be = get_backend("reference")
    for backward in (False, True):
        call = rotating(full_call(be, AttnSpec(causal=True), backward), sets)
        call()
        call()
        cp = ringfa4.ContextParallel.simulated(4, backend="reference")
        rotating(cp_step(cp, backward), sets)()
        packed = [[t[0] for t in s] for s in sets]
        pack = cp.pack(torch.tensor([0, 10, 32], dtype=torch.int32))
        rotating(cp_step(cp, backward, pack), packed)()


def test_ring_sim_calls_alone_runs():
    from _common import calls_alone, executor_step

    cp = ringfa4.ContextParallel.simulated(4, backend="reference")
    be = get_backend("reference")
    for backward in (False, True):
        calls_alone(cp, AttnSpec(causal=True), be, backward)(*_sets()[0])
        cache, inputs = {}, _sets()[0]
        for _ in range(2):  # executor level: shards made once per input set
            calls_alone(cp, AttnSpec(causal=True), be, backward, cache)(*inputs)
            executor_step(cp, AttnSpec(causal=True), backward)(*inputs)
        assert len(cache) == 1


def test_interleaved_rounds_alternate_and_ratio_is_per_round():
    """interleaved_ms times every function once a round, the order reversed every other round, the
    first round thrown away; ratio takes the per-round ratio, so a drift that slows both alike in a
    round cancels (the fake timer drifts 2x over the run)."""
    from _common import interleaved_ms, ratio

    calls = []

    def fake(fn, sets, rep):
        calls.append(fn)
        drift = 1.0 + len(calls) / 4  # the machine slows down as the run goes on
        return {"a": 1.1, "b": 1.0}[fn] * drift

    timed = interleaved_ms({"a": "a", "b": "b"}, sets=None, rounds=4, rep=5, measure=fake)
    assert calls == ["a", "b", "b", "a"] * 2 + ["a", "b"]  # one warm round thrown away, then 4
    drift = [1 + (i + 1) / 4 for i in range(len(calls))]
    a_t = [1.1 * drift[i] for i, c in enumerate(calls) if c == "a"][1:]
    b_t = [drift[i] for i, c in enumerate(calls) if c == "b"][1:]
    assert timed["a"]["rounds"] == a_t and timed["b"]["rounds"] == b_t
    per = sorted(x / y for x, y in zip(a_t, b_t))
    r = ratio(timed, "a", "b")
    assert abs(r["median"] - 0.5 * (per[1] + per[2])) < 1e-12 and r["min"] == per[0] and r["max"] == per[-1]
    assert abs(r["median"] - 1.1) < 0.05  # alternating order: the drift's bias mostly cancels
    assert timed["b"]["ms"] == 0.5 * (sorted(b_t)[1] + sorted(b_t)[2])


def test_ulysses_a2a_volume():
    import ulysses_sim

    fwd, bwd = ulysses_sim.a2a_mb_per_rank(65536, 8, 8, 32, 8, 128)
    # q + k + v + out of 8k tokens: (32 + 8 + 8 + 32) heads x 128 x 2 bytes x 7/8
    assert abs(fwd - 8192 * 80 * 128 * 2 * 7 / 8 / 1e6) < 1e-9 and fwd == bwd
    assert ulysses_sim.a2a_mb_per_rank(65536, 8, 1, 32, 8, 128) == (0.0, 0.0)


def test_ulysses_sim_packed_configs(monkeypatch):
    """ulysses_sim.py --packed on the CPU (reference backend, every timed step run once): each U x R
    runs the pack through ringfa4.attention; with R = 1 no document is split at the ring level, with
    R > 1 the document longer than a ring rank's share is."""
    import ulysses_sim

    calls = []

    def run_once(fn, sets, rep=200):
        for s in sets:
            fn(*s)
        calls.append(fn)
        return 1.0

    monkeypatch.setattr(ulysses_sim, "median_ms", run_once)
    be = get_backend("reference")
    inp = ulysses_sim.packed_inputs("tiny", [40, 7, 13, 4], (4, 2, 8), device="cpu", dtype=torch.float32)
    rows = ulysses_sim.config_rows(be, inp, [(4, 1), (4, 2), (4, 4)])
    want = [(u, 4 // u, p) for u in (1, 2, 4) for p in ("fwd", "fwd+bwd")]
    assert [(r["U"], r["R"], r["pass"]) for r in rows] == want
    assert all(r["efficiency"] == 1.0 and r["S"] == 64 for r in rows) and len(calls) == 2 + len(rows)
    split = {r["R"]: r["split_docs"] for r in rows}
    assert split[1] == 0 and split[2] >= 1 and split[4] >= 1, split


def test_capacity_runs_tiny(tmp_path):
    """benchmarks/capacity.py end to end on a tiny shape (CPU): both modes, host placement, shares."""
    import json
    import subprocess

    pytest_ = __import__("pytest")
    pytest_.importorskip("peft")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "capacity.py")
    for mode, extra in (("ringfa4", ["--host-budget-gib", "0.001", "--gpu-budget-gib", "0", "--shares",
                                     "--cache-attention"]), ("plain", [])):
        out = tmp_path / f"{mode}.json"
        r = subprocess.run([sys.executable, script, "--tiny", "--mode", mode, "--layers", "2", "--seqs", "64",
                            "--out", str(out), *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        row = json.loads(out.read_text())["rows"][0]
        assert row["step_s"] > 0 and row["loss"] > 0
        if mode == "ringfa4":
            assert "0 on GPU, 2 on host" in row["placement"] and set(row["shares"]) == {"attention", "mlp", "loss"}


def test_ring_profile_runs_tiny():
    """benchmarks/ring_profile.py end to end on the CPU (reference backend): groups and top ops."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "ring_profile.py")
    for extra in ([], ["--packed", "--forward-only"]):
        r = subprocess.run([sys.executable, script, "--seq", "128", "--world", "2", "--heads", "2", "--kv-heads", "1",
                            "--head-dim", "8", "--backend", "reference", "--reps", "1", *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "| group | ms | share of busy |" in r.stdout and "device busy" in r.stdout


def test_stream_gaps_splits_idle_time_of_the_compute_stream():
    """ring_profile.stream_gaps (varlen_sim --profile's gap analysis) on a made-up trace: two steps on
    stream 7 with a 50 us gap after a hop's copy ends on stream 9, a 30 us gap after nothing, a 2 us
    short one and an overlap (no gap); the copy stream's events are not the compute stream's."""
    from ring_profile import stream_gaps

    def ev(name, cat, ts, dur, stream):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}
    evs = [ev("attn_a", "kernel", 0, 100, 7), ev("copy", "gpu_memcpy", 60, 85, 9),
           ev("attn_b", "kernel", 150, 100, 7),  # 50 us gap ending 5 us after the copy ended
           ev("add", "kernel", 240, 20, 7),       # overlaps attn_b (no gap), ends after it
           ev("attn_c", "kernel", 290, 100, 7),   # 30 us gap, no copy near
           ev("fill", "gpu_memset", 392, 8, 7),   # 2 us: short
           ev("tiny_other_stream", "kernel", 1000, 1, 9)]
    got = stream_gaps(evs, reps=2)
    assert got["span_ms"] == 0.4 / 2 and got["idle_ms"] == (50 + 30 + 2) / 1e3 / 2
    assert got["after_copy_ms"] == 0.05 / 2 and got["after_copy_gaps"] == 0.5
    assert got["other_ms"] == 0.03 / 2 and got["gaps"] == 0.5 and got["short_ms"] == 0.002 / 2
    assert abs(got["busy_ms"] - (0.4 - 0.082) / 2) < 1e-12
    assert [(g["us"], g["after"], g["before"]) for g in got["top_gaps"]] == [
        (50, "attn_a", "attn_b"), (30, "add", "attn_c"), (2, "attn_c", "fill")]  # after: the last to end


def test_memtrace_replay_finds_the_peak_live_set():
    import _memtrace

    fr = lambda name: [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},  # noqa: E731
                       {"filename": f"/s/site-packages/ringfa4/{name}.py", "line": 7, "name": "f"}]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": fr("a")},
              {"action": "alloc", "addr": 2, "size": 300, "frames": fr("b")},
              {"action": "free_completed", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 3, "size": 150, "frames": fr("b")},
              {"action": "free_requested", "addr": 2, "size": 300},  # still in use on a side stream
              {"action": "alloc", "addr": 4, "size": 50, "frames": fr("c")},  # 500: the peak
              {"action": "free_completed", "addr": 2, "size": 300},
              {"action": "alloc", "addr": 5, "size": 200, "frames": fr("c")}]
    res = _memtrace.at_peak({"device_traces": [events]})
    assert res["peak_in_trace_gib"] * 2**30 == 500
    assert [(round(r["gib"] * 2**30), r["where"]) for r in res["live_at_peak"]] == [(450, "ringfa4/b.py:7 f"),
                                                                                   (50, "ringfa4/c.py:7 f")]


def test_ring_sim_records_its_options(monkeypatch):
    """The RingOptions a benchmark ran with: the defaults, with the RINGFA4_* variables it was started
    with applied (RingOptions.from_env)."""
    import ring_sim

    monkeypatch.setenv("RINGFA4_BWD_RING", "q")
    monkeypatch.delenv("RINGFA4_DKV_GROUPS", raising=False)
    got = ring_sim._options()
    assert got["bwd_ring"] == "q" and got["dkv_groups"] == 2 and got["fp32_grads"] is True


def test_solver_time_rows():
    """solver_time.py's packs are 1,000 documents each and its rows report the balance reached,
    within the solver's bounds."""
    import solver_time

    from ringfa4.parallel.dispatch import FLOP_BOUND, TOKEN_BOUND

    assert all(len(lengths) == 1000 for lengths in solver_time.packs().values())
    rows = solver_time.rows(1, worlds=(4,))
    assert len(rows) == 4 and all(r["ms"] > 0 for r in rows)
    assert all(r["flops_balance"] <= FLOP_BOUND + 1e-9 and r["token_balance"] <= TOKEN_BOUND + 1e-9 for r in rows)


def test_varlen_sim_fits_the_rank_cost():
    """varlen_sim's per-rank cost fit recovers known per-unit costs from noise-free rank times (and
    pairs alone then explain less of them), one fit a pass, balanced rows only."""
    import random

    import varlen_sim

    rnd = random.Random(0)
    truth = {"rank_tile_pairs": 2e-6, "rank_key_rows": 0.05, "rank_key_tiles": 3.0, "rank_tokens": 0.01,
             "rank_segments": 7.0, "const": 40.0}
    rows = []
    for mode in ("balanced", "ring"):
        for pass_ in ("fwd", "fwd+bwd"):
            for _ in range(6):
                P = rnd.choice([4, 8])
                feats = {f: [rnd.randint(1, 10) * 10 ** rnd.randint(2, 8) for _ in range(P)]
                         for f in varlen_sim.COST_FEATURES}
                us = [truth["const"] + sum(truth[f] * feats[f][r] for f in feats) for r in range(P)]
                feats["rank_pairs"] = [x * 0.95 for x in feats["rank_tile_pairs"]]
                rows.append({"mode": mode, "pass": pass_, "rank_ms": [u / 1e3 for u in us], **feats})
    fits = varlen_sim.fit_rank_cost(rows)
    assert [f["pass"] for f in fits] == ["fwd", "fwd+bwd"] and all(f["mode"] == "balanced" for f in fits)
    for fit in fits:
        assert fit["r2"] > 1 - 1e-9 and fit["r2_tile_pairs"] < 0.99
        assert abs(fit["r2_pairs"] - fit["r2_tile_pairs"]) < 1e-9  # pairs here: a multiple of the tile pairs
        for name, value in truth.items():
            assert abs(fit["us_per"][name] - value) <= 1e-6 * value, (name, fit)


def test_varlen_sim_sorts_a_ranks_kernels_by_kind():
    """varlen_sim --profile all: FA4's forward, backward main, pre- and postprocess kernels told
    apart by name, every other kernel by ring_profile's group, each kind's ms summed."""
    import varlen_sim

    top = [{"ms": 1.5, "name": "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_o"},
           {"ms": 4.0, "name": "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_o"},
           {"ms": 0.1, "name": "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPr"},
           {"ms": 0.05, "name": "kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardP"},
           {"ms": 0.04, "name": "kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardP"},
           {"ms": 0.2, "name": "Memcpy DtoD (Device -> Device)"},
           {"ms": 0.12, "name": "unpad_add_kernel"}]
    kinds = varlen_sim._kernel_kinds({"span_ms": 6.2, "top_all": top})
    assert kinds["span"] == 6.2 and kinds["fa4_fwd"] == 1.5 and kinds["fa4_bwd"] == 4.0
    assert kinds["fa4_bwd_pre"] == 0.1 and abs(kinds["fa4_bwd_post"] - 0.09) < 1e-12
    rest = {k: v for k, v in kinds.items() if not k.startswith("fa4") and k != "span"}
    assert abs(sum(rest.values()) - 0.32) < 1e-12 and len(rest) >= 1


def test_tile_schedule_model():
    """tile_schedule.py's list schedule and tile costs on hand-checked cases, and its finding kept: the
    local order (each call's heaviest segments first) is no worse than document order in fwd+bwd on
    varlen_sim's mixes at P = 8, and better where a rank's whole documents differ in length."""
    import tile_schedule as ts

    assert ts.makespan([4, 2, 2], 2) == 4 and ts.makespan([2, 2, 4], 2) == 6  # the long tile last: a tail
    assert ts.forward_tiles([(128, 256)], 0) == [2] * ts.HEADS  # one query tile, two key tiles
    assert ts.forward_tiles([(256, 256)], 1) == [3] * ts.HEADS + [2] * ts.HEADS  # the last query tile first
    assert ts.backward_tiles([(128, 256)], 0) == [2.5, 2.5] * ts.HEADS  # each key tile: 128 query rows
    rows = {m: ts.mix_rows(m, 8, 132, 4.0) for m in ("uniform_64k", "short_128k")}
    for r in rows.values():
        assert r["local"]["fwd+bwd"] <= r["document"]["fwd+bwd"] + 1e-12
    assert rows["short_128k"]["local"]["fwd+bwd"] < rows["short_128k"]["document"]["fwd+bwd"] - 0.01


def test_varlen_tile_cost_fit():
    """varlen_tile_cost.py's units and fit: a segment's tiles and blocks as tile_schedule counts them,
    enough segments for the waves asked, and the fit recovers the per-block, per-tile and per-call
    costs (and so the tile cost in blocks) of times made from them, with R^2 1 and no residual."""
    import tile_schedule as ts
    import varlen_tile_cost as vtc

    u = vtc.segment_units(256, 1024)  # two query tiles, ten key tiles
    assert u["fwd_tiles"] == 2 * ts.HEADS and u["fwd_blocks"] == (10 + 9) * ts.HEADS
    assert u["bwd_tiles"] == 10 * ts.HEADS and u["bwd_blocks"] == (8 * 2 + 2 + 1) * 2.5 * ts.HEADS
    for n, p in ((128, 0), (256, 12288), (4096, 0)):
        R = vtc.segments_for(n, p, 4.0)
        per = vtc.segment_units(n, p)
        assert R * min(per["fwd_tiles"], per["bwd_tiles"]) >= 4 * ts.SMS
        assert R == 1 or (R - 1) * min(per["fwd_tiles"], per["bwd_tiles"]) < 4 * ts.SMS
    a, b, c = 2e-5, 3e-4, 0.02  # ms a block, a tile, a call: a tile cost of 15 blocks
    rows = []
    for n, p in ((128, 0), (256, 6144), (1024, 2048), (4096, 0), (512, 12288)):
        units = {k: 3 * x for k, x in vtc.segment_units(n, p).items()}
        rows.append({**units, "bwd": a * units["bwd_blocks"] + b * units["bwd_tiles"] + c})
    fit = vtc.fit_tile_cost(rows, "bwd")
    assert abs(fit["tile_cost_blocks"] - 15) < 1e-6 and abs(fit["us_per_call"] - 20) < 1e-6
    assert fit["r2"] > 1 - 1e-9 and max(abs(x) for x in fit["residual_ms"]) < 1e-9
    ran = []

    def once(fns, rounds):  # each timed call run once (the reference backend's accumulating varlen backward)
        ran.extend(name for name, fn in fns.items() if fn() is not False)
        return {name: {"ms": 1.0} for name in fns}

    times = vtc.time_config(get_backend("reference"), 8, 24, 3, 1, device="cpu", measure=once)
    assert times == {"fwd": 1.0, "bwd": 1.0, "bwd/fa4": 1.0} and ran == ["fwd", "bwd", "bwd/fa4"]


def test_varlen_sim_ranks_alone():
    """varlen_sim's one-rank runs: every mode's forward and backward run for each rank alone; a
    rank whose documents are all whole (nothing travels) gets exactly its rows of the full result."""
    import dataclasses

    import varlen_sim

    from ringfa4.parallel import make_layout
    from ringfa4.parallel.allgather import allgather_backward, allgather_forward
    from ringfa4.parallel.ring import ring_backward, ring_forward

    assert sum(varlen_sim.mix_lengths("short_128k")) == 131072 and varlen_sim.mix_lengths("one_64k") == [65536]
    P = 4
    cp = ringfa4.ContextParallel.simulated(P, layout=make_layout("zigzag", P, tile=4), backend="reference")
    checked = 0
    for lengths in ([9, 40, 3, 17, 25, 6], [16, 16, 16, 16]):
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        q, k, v, do = (torch.randn(sum(lengths), n, 8, dtype=torch.float64) for n in (4, 2, 2, 4))
        for mode in ("balanced", "ring", "allgather"):
            pack = cp.pack(cu, mode)
            packing, ag = pack.packing, pack.uses_allgather(4, 2)
            fwd, bwd = (allgather_forward, allgather_backward) if ag else (ring_forward, ring_backward)
            base = cp.run(q, AttnSpec(causal=True), packing, ag)
            full = ringfa4.attention(q, k, v, cp=cp, packing=pack, causal=True)
            for r in range(P):
                exchange = ("serial", "overlapped")[r % 2]  # (the same on the CPU: no communication stream)
                run = dataclasses.replace(base, ranks=(r,), transport=varlen_sim._OneRank(P, exchange))
                shards = [packing.shard(t, 0, r) for t in (q, k, v, do)]
                varlen_sim._rank_step(run, fwd, bwd, True)(*shards)
                if not packing.split_docs():
                    out = fwd(run, *([s] for s in shards[:3]))[0][0]
                    assert torch.equal(out, packing.shard(full, 0, r))
                    checked += 1
    assert checked == P  # the balanced pack of four equal documents keeps each whole
    with pytest.raises(ValueError, match="exchange must be"):
        varlen_sim._OneRank(P, "async")


def test_host_cost_imports_and_parses():
    """host_cost.py needs a GPU to run; here it imports (its helpers and constants are there)."""
    import host_cost

    assert callable(host_cost.bench_dense) and callable(host_cost.bench_packed)
    assert host_cost.H % host_cost.HK == 0
    import nccl_post  # (its hop posts need a GPU: gpu.sh host real)

    assert callable(nccl_post.main) and callable(nccl_post._timed)


def test_real_rank_host_cost_runs_on_gloo_ranks():
    """host_cost's real-rank path: spawned gloo ranks, a distributed ContextParallel with stub hops
    (CPU, the reference backend): rank 0's rows for fwd and fwd+bwd, positive times; the metadata
    check in the profiled call on every call, and not at all once per call key (the key repeats)."""
    from _real_rank import real_rank_rows

    rows = real_rank_rows(2, 32, (4, 2, 8), device="cpu", backend="reference", reps=2)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    assert all(r["path"] == "real-rank" and r["P"] == 2 and r["us_per_rank_step"] > 0 for r in rows)
    assert all(r["metadata_check"] == "every_call" and r["check_share"] > 0 for r in rows)
    assert not any(r["taped"] for r in rows)  # CPU calls are untaped under the default "auto"
    once = real_rank_rows(2, 32, (4, 2, 8), device="cpu", backend="reference", reps=2,
                          options={"metadata_check": "new_shapes", "launch_tapes": "on"})
    assert all(r["metadata_check"] == "new_shapes" and r["check_share"] == 0 for r in once), once  # key repeated
    assert all(r["taped"] for r in once)  # the gloo ranks' calls replayed from launch tapes


def test_real_rank_host_cost_with_stub_peers_runs_in_this_process():
    """``peers="stub"``: rank 0 of a fake process group of 4 in this process (no spawned peers): the
    same rows, its checks agreeing (every call: the check in the profiled call; once per key: not),
    taped with ``launch_tapes="on"``; the process group is gone afterwards."""
    import torch.distributed as dist
    from _real_rank import real_rank_rows

    every = real_rank_rows(4, 32, (4, 2, 8), device="cpu", backend="reference", reps=2, peers="stub")
    once = real_rank_rows(4, 32, (4, 2, 8), device="cpu", backend="reference", reps=2, peers="stub",
                          options={"metadata_check": "new_shapes", "launch_tapes": "on"})
    assert [r["pass"] for r in every + once] == ["fwd", "fwd+bwd"] * 2
    assert all(r["peers"] == "stub" and r["P"] == 4 and r["rank_steps"] == 4 and r["us_per_rank_step"] > 0
               for r in every + once)
    assert all(r["check_share"] > 0 and not r["taped"] for r in every)
    assert all(r["check_share"] == 0 and r["taped"] for r in once), once
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="stub peers take loopback, stream-ordered, nccl-self hops"):
        real_rank_rows(4, 32, (4, 2, 8), device="cpu", backend="reference", hops="blocking", peers="stub")
    if not dist.is_nccl_available():  # (NCCL's hops to self run in a process of their own: its failure named)
        with pytest.raises(RuntimeError, match="NCCL hops to self: rank 0 failed"):
            real_rank_rows(4, 32, (4, 2, 8), device="cpu", backend="reference", hops="nccl-self", peers="stub")


def test_check_cost_times_the_metadata_all_gather_on_gloo_ranks():
    """check_cost.py: two spawned gloo ranks time the per-call metadata check; one row, per-rank
    (median, min) pairs, positive and ordered."""
    from check_cost import check_cost

    row = check_cost(2, reps=20)
    assert row["P"] == 2 and len(row["per_rank"]) == 2
    assert all(0 < mn <= med for med, mn in row["per_rank"]) and row["us_min"] <= row["us_median"]


def test_executor_floor_times_the_ring_with_kernels_that_do_nothing():
    """executor_floor.py: the simulated ring on the CPU with the null backend takes FA4's paths (the
    merge in the kernel, the in-place head-group backward) and gives positive host times and call
    counts per rank-step for both levels and passes."""
    import executor_floor
    from _null_backend import NullBackend

    from ringfa4.parallel.ring.accum_sink import AccumGradSink
    from ringfa4.parallel.ring.forward import EpilogueMerge, forward_merge_strategy
    from ringfa4.parallel.ring.kv_side import grad_sink

    rows = executor_floor.floor_rows(4, 128, reps=2)
    assert [(r["pass"], r["level"]) for r in rows] == [(p, lvl) for p in ("fwd", "fwd+bwd")
                                                       for lvl in ("executor", "api", "api, taped")]
    assert all(r["us_per_rank_step"] > 0 and r["python_calls_per_rank_step"] > 0 for r in rows)
    calls = {(r["pass"], r["level"]): r["python_calls_per_rank_step"] for r in rows}
    for p in ("fwd", "fwd+bwd"):  # a replay runs the launches, not the executor's Python
        assert calls[p, "api, taped"] < 0.7 * calls[p, "api"], calls
    ops = {(r["pass"], r["level"]): r["torch_ops_by_kind"] for r in rows}
    # the torch ops a call dispatches, by kind: the taped forward's finish (CPU: planes_lse and the
    # cast) once a rank, its hops P - 1 multi-tensor copies a rank
    assert ops["fwd", "api, taped"]["aten.log"] == 4 and ops["fwd", "api, taped"]["aten._foreach_copy_"] == 12
    assert all(r["torch_ops_per_rank_step"] == sum(r["torch_ops_by_kind"].values()) / r["rank_steps"] for r in rows)
    cp = ringfa4.ContextParallel.simulated(4, backend=NullBackend())
    q, k, v = (torch.randn(1, 512, n, 16).to(torch.bfloat16) for n in (8, 2, 2))
    run = cp.run(q, AttnSpec(causal=True))
    qs, ks, vs = (cp.comm.split(cp.layout, t, 1) for t in (q, k, v))
    assert isinstance(forward_merge_strategy(run, qs, vs[0]), EpilogueMerge)
    sink = grad_sink(run, (qs, qs, ks, vs, qs, [torch.zeros(1, 8, 128)] * 4))
    assert isinstance(sink, AccumGradSink) and sink.in_place and sink.groups == 2


def test_tape_entries_count_what_a_taped_ring_launches():
    """tape_entries.py on no-op kernels (P = 4): per rank and call, the forward's tape holds its
    block and 3 merging blocks, 3 hops and the finish (CPU: planes_lse's log and add, the cast), the
    backward's 8 blocks (two head groups), 8 hops and one zero for both groups' accumulators."""
    from tape_entries import tape_rows

    rows = {(r["pass"], r["tape"]): r for r in tape_rows(4, 256, null=True)}
    fwd = rows["fwd", "ring_forward"]["per_rank"]
    assert fwd["_null_forward"] == 1 and fwd["_null_merge"] == 3 and fwd["aten._foreach_copy_.default"] == 3
    assert fwd["aten.log.out"] == fwd["aten.add_.Tensor"] == fwd["aten.copy_.default"] == 1
    bwd = rows["fwd+bwd", "ring_backward"]["per_rank"]
    assert bwd["_null_block"] == 8 and bwd["aten._foreach_copy_.default"] == 8
    assert bwd["aten.zero_.default"] == 2  # both groups' dK/dV in one, and the null backend's dq


def test_cp_step_backward_on_the_calling_thread(monkeypatch):
    """cp_step(calling_thread=True): the ring backward runs with autograd's worker threads off (on
    CUDA it then runs on the calling thread, not the device thread), the default leaves them on,
    and the setting is back afterwards."""
    from ringfa4.parallel.context import _RingAttention

    seen = []
    orig = _RingAttention.backward

    def spy(ctx, *grads):
        seen.append(torch._C._is_multithreading_enabled())
        return orig(ctx, *grads)

    monkeypatch.setattr(_RingAttention, "backward", staticmethod(spy))
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    cp_step(cp, True, calling_thread=True)(q, k, v, do)
    cp_step(cp, True)(q, k, v, do)
    assert seen == [False, True] and torch._C._is_multithreading_enabled()


def test_cp_layers_step_chains_calls_with_one_backward(monkeypatch):
    """cp_layers_step: L ring calls, each on the previous one's output, and one backward() that runs
    all L ring backwards (autograd's entry once a step, as in a model), which reach q, k and v."""
    from _common import cp_layers_step

    from ringfa4.parallel.context import _RingAttention

    counts = {"fwd": 0, "bwd": 0, "engine": 0}
    fwd, bwd, engine = _RingAttention.forward, _RingAttention.backward, torch.autograd.backward
    firsts = []

    def spy_fwd(ctx, q, *args):
        counts["fwd"] += 1
        firsts.append(q)
        return fwd(ctx, q, *args)

    def spy_bwd(ctx, *grads):
        counts["bwd"] += 1
        got = bwd(ctx, *grads)
        assert all(g is not None and bool(g.abs().sum() > 0) for g in got[:3])  # dq, dk, dv of this layer
        return got

    def spy_engine(*args, **kwargs):
        counts["engine"] += 1
        return engine(*args, **kwargs)

    monkeypatch.setattr(_RingAttention, "forward", staticmethod(spy_fwd))
    monkeypatch.setattr(_RingAttention, "backward", staticmethod(spy_bwd))
    monkeypatch.setattr(torch.autograd, "backward", spy_engine)
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    cp_layers_step(cp, True, 3)(q, k, v, do)
    assert counts == {"fwd": 3, "bwd": 3, "engine": 1}
    assert firsts[0].is_leaf and not firsts[1].is_leaf  # layer 2's queries are layer 1's output
    counts.update(fwd=0, bwd=0, engine=0)
    cp_layers_step(cp, False, 3)(q, k, v, do)
    assert counts == {"fwd": 3, "bwd": 0, "engine": 0}


def test_host_cost_times_the_ring_backward_where_it_runs():
    """host_cost.InsideBackward: one timed entry per ring backward (the autograd thread's share of a
    call), a profile of it when asked, and the Function's own backward back afterwards."""
    import host_cost

    from ringfa4.parallel.context import _RingAttention

    orig = _RingAttention.backward
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    step = cp_step(cp, True)
    with host_cost.InsideBackward(profile=True) as inside:
        step(q, k, v, do)
        step(q, k, v, do)
        cp_step(cp, False)(q, k, v, do)  # a forward alone: nothing inside
    assert len(inside.us) == 2 and all(t > 0 for t in inside.us)
    assert any("ring_backward" in r["function"] for r in inside.top()["cum"])
    assert _RingAttention.backward is orig


def test_sustained_batches_rotate_discard_and_flag_a_host_behind():
    """sustained_ms: each call once compiled, then its host time from 3 calls on an idle GPU; every
    batch preloads the GPU for at least preload_ms and twice the calls' host time, runs each call
    once behind a flush, rotated every batch and reversed every other round; the first round is
    thrown away; per call the median over rounds of per-round medians. With the preload capped
    under the host's time, the result says so."""
    import time

    from _common import sustained_ms

    class FakeOps:
        def __init__(self):
            self.log, self.clock = [], 0.0

        def busy(self, ms):
            self.log.append(("busy", ms))

        def flush(self):
            self.log.append(("flush",))

        def event(self):
            ops = self

            class Ev:
                def record(self):
                    self.t = ops.clock
            return Ev()

        @staticmethod
        def elapsed_ms(start, end):
            return end.t - start.t

        def sync(self):
            self.log.append(("sync",))

    def run(cap):
        ops, order = FakeOps(), []

        def make(name, gpu_ms, host_s=0.0):
            def fn():
                order.append(name)
                ops.clock += gpu_ms
                if host_s:
                    time.sleep(host_s)
            return fn

        fns = {"a": make("a", 2.0), "b": make("b", 1.0), "c": make("c", 3.0, host_s=0.003)}
        return ops, order, sustained_ms(fns, rounds=2, reps=3, preload_ms=0.001, discard=1, ops=ops,
                                        max_preload_ms=cap)

    ops, order, out = run(1000.0)
    assert order[:3] == ["a", "b", "c"] and order[3:12] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3  # warm, host
    batches = [order[12 + 3 * i: 15 + 3 * i] for i in range(9)]
    assert batches[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]  # round 0 (thrown away)
    assert batches[3:6] == [["c", "b", "a"], ["b", "a", "c"], ["a", "c", "b"]]  # round 1: reversed, rotated
    assert batches[6:] == batches[:3]
    assert out["a"]["ms"] == 2.0 and out["b"]["ms"] == 1.0 and out["c"]["ms"] == 3.0
    assert out["a"]["rounds"] == [2.0, 2.0] and out["c"]["host_ms"] >= 3.0 > out["a"]["host_ms"]
    loads = [x[1] for x in ops.log if x[0] == "busy"]
    assert len(loads) == 9 and len(set(loads)) == 1 and loads[0] >= 6.0  # twice >= 3 ms of host
    assert out["_exposed"] is None
    assert sum(1 for x in ops.log if x[0] == "flush") == 27
    _, _, capped = run(1.0)
    assert capped["_exposed"] >= 3.0  # >= 3 ms of host behind a 1 ms preload


def test_varlen_sim_unrefined_mode_is_the_placement_before_step5():
    """varlen_sim's ``unrefined`` mode packs without the solver's step 5 and restores it after: the
    64k pack at P = 8 (tile 128) is 1.028 max/mean in whole-tile work without it, 1.006 with it."""
    import torch
    import varlen_sim
    from _null_backend import NullBackend

    import ringfa4
    from ringfa4.parallel import dispatch

    lengths = varlen_sim.mix_lengths("uniform_64k")
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    cp = ringfa4.ContextParallel.simulated(8, backend=NullBackend())
    refine = dispatch.refine_boundaries
    with varlen_sim.without_step5():
        raw = cp.pack(cu, "balanced").packing
    assert dispatch.refine_boundaries is refine
    done = cp.pack(cu, "balanced").packing
    tiles = [varlen_sim._ratio([p.tile_work(r) for r in range(8)]) for p in (raw, done)]
    assert round(tiles[0], 3) == 1.028 and round(tiles[1], 3) == 1.006


def test_single_call_floor_stubs_the_kernels_of_both_paths():
    """single_call_floor.py: ringfa4 ``cp=None`` (backend fa4) and FA4's ``flash_attn_func`` each
    reach FA4's stubbed kernel entry points exactly once a forward and once a backward (so the two
    host times compare like for like), the stubs are undone afterwards, and the rows are positive."""
    pytest.importorskip("flash_attn.cute")
    import single_call_floor
    from flash_attn.cute import interface

    before = (interface._flash_attn_fwd, interface._flash_attn_bwd)
    q, k, v, dout = (torch.randn(1, 256, n, 128).to(torch.bfloat16) for n in (32, 8, 8, 32))
    for t in (q, k, v):
        t.requires_grad_(True)
    with single_call_floor.stubbed_fa4(q, k, v) as calls:
        for name, fn in single_call_floor.paths(q, k, v, dout).items():
            start = dict(calls)
            fn(True)
            assert (calls["fwd"] - start["fwd"], calls["bwd"] - start["bwd"]) == (1, 1), name
            assert q.grad is None  # reset after each call: no .grad accumulation timed
    assert (interface._flash_attn_fwd, interface._flash_attn_bwd) == before
    rows = single_call_floor.rows(tokens=256, reps=3, rounds=2)
    assert sorted((r["path"], r["pass"]) for r in rows) == sorted(
        (p, s) for p in ("FA4 flash_attn_func", "ringfa4 cp=None") for s in ("fwd", "fwd+bwd"))
    assert all(0 < r["min_us"] <= r["us"] for r in rows)
