"""Launch tapes (ringfa4.kernels.tape, ringfa4.parallel.ring.tapes) on the CPU: a replay repeats the
recorded call on new inputs bit for bit, with fresh outputs; what it cannot repeat is refused or
caught by the check; the ring's taped calls equal its untaped ones."""

from __future__ import annotations

import warnings

import pytest
import torch

import ringfa4
from ringfa4 import ContextParallel, RingOptions
from ringfa4.kernels.tape import Recorder, launch

CPU = torch.device("cpu")


def _record(fn, inputs):
    rec = Recorder(CPU).start(inputs)
    with rec:
        out = fn(*inputs)
    return rec, out, (None if rec.finish(out) is None else rec.tape())


def _mixed(q, k):
    """Views, a functional op, in-place ops on a fresh buffer, a multi-tensor copy, a dtype view."""
    acc = torch.zeros(q.shape, dtype=torch.float64)
    acc[1:3] += q.narrow(0, 1, 2) * 2
    acc.add_(k.to(torch.float64))
    spare = torch.empty_like(q)
    torch._foreach_copy_([spare], [q.flip(0)])
    bits = acc.view(torch.int64)[0]
    return [acc.to(torch.float32), spare + 1], bits.clone()


def test_a_replay_on_new_inputs_equals_the_call_and_its_outputs_are_fresh():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    rec, out, tape = _record(_mixed, [q, k])
    assert tape is not None and rec.refused is None
    assert tape.verify([q, k], out, exact=True) is None
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        q2, k2 = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
        want = _mixed(q2, k2)
        got = tape.replay([q2, k2])
        assert all(torch.equal(a, b) for a, b in zip([*got[0], got[1]], [*want[0], want[1]]))
    again = tape.replay([q2, k2])
    assert again[0][0].data_ptr() != got[0][0].data_ptr()  # every replay's outputs are its own


def test_inputs_that_are_views_with_other_offsets_are_read_where_they_are():
    base = torch.randn(10, 3)
    q, k = base[1:5], base[5:9]
    _, out, tape = _record(_mixed, [q, k])
    other = torch.randn(12, 3)
    q2, k2 = other[3:7], other[7:11]
    got, want = tape.replay([q2, k2]), _mixed(q2, k2)
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])


def _byte_sums(a, b):
    """Byte views of two inputs (one storage or two) at several offsets, read into a fresh output."""
    out = torch.zeros(4, dtype=torch.int64)
    for i, x in enumerate((a, a[1:], b, b[2:])):
        out[i] = x.view(torch.uint8).sum()
    return out


def test_inputs_seen_as_bytes_are_read_where_they_are_one_retyped_storage_or_two():
    base = torch.randn(10, 3)
    _, out, tape = _record(_byte_sums, [base[1:5], base[5:9]])  # two inputs of one storage
    assert tape is not None and tape.verify([base[1:5], base[5:9]], out, exact=True) is None
    for a, b in ((torch.randn(12, 3)[3:7], torch.randn(12, 3)[2:6]),  # two storages, other offsets
                 (lambda t: (t[0:4], t[6:10]))(torch.randn(12, 3))):  # one storage, other offsets
        assert torch.equal(tape.replay([a, b]), _byte_sums(a, b))


def _unseen_write(q):
    """A 'kernel' the dispatcher does not see: a write through numpy."""
    buf = torch.empty_like(q)
    buf.numpy()[:] = (q * 3).numpy()
    return [buf + 1]


def test_the_check_catches_a_launch_the_tape_did_not_record():
    q = torch.randn(4, 3)
    rec, out, tape = _record(_unseen_write, [q])
    assert tape is not None  # nothing the recorder could see was wrong...
    assert "differs" in tape.verify([q], out, exact=True)  # ...but the replay left the poison behind


def _seen_write(q):
    buf = torch.empty_like(q)
    launch(_numpy_times_three, buf, q)
    return [buf + 1]


def _numpy_times_three(dst, src):
    dst.numpy()[:] = (src * 3).numpy()


def test_work_passed_through_launch_is_one_entry_and_replays():
    q = torch.randn(4, 3)
    rec, out, tape = _record(_seen_write, [q])
    assert tape.verify([q], out, exact=True) is None
    assert len(tape) == 2  # the launch (its multiply inside not recorded) and the add
    q2 = torch.randn(4, 3)
    assert torch.equal(tape.replay([q2])[0], q2 * 3 + 1)


def test_a_host_sync_is_refused():
    q = torch.randn(4, 3)

    def syncs(q):
        return [q * float(q.sum())]
    rec, _, tape = _record(syncs, [q])
    assert tape is None and "host" in rec.refused


def test_an_output_in_memory_made_before_the_call_is_refused():
    kept = torch.zeros(4, 3)

    def into_kept(q):
        kept.copy_(q)
        return [kept]
    rec, _, tape = _record(into_kept, [torch.randn(4, 3)])
    assert tape is None and "did not allocate" in rec.refused


# -- the ring ---------------------------------------------------------------------------------------
def _qkv(S, h, hk, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, n, 16, generator=g, dtype=dtype).requires_grad_() for n in (h, hk, hk)]


def _fwd_bwd(cp, q, k, v, seed, **kw):
    o = ringfa4.attention(q, k, v, cp=cp, **kw)
    o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 100), dtype=o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("P,layout,h,hk,kw", [
    (2, "zigzag", 4, 2, dict(causal=True)),
    (4, "zigzag", 4, 1, dict(causal=True)),
    (3, "contiguous", 2, 2, dict(causal=False)),
    (4, "zigzag", 4, 4, dict(causal=True, window=(40, 0))),
    (8, "zigzag", 4, 2, dict(causal=True, softcap=5.0)),
])
def test_taped_ring_calls_equal_untaped_ones_bit_for_bit(P, layout, h, hk, kw):
    taped = ContextParallel.simulated(P, layout=layout, backend="reference", options=RingOptions(launch_tapes="on"))
    plain = ContextParallel.simulated(P, layout=layout, backend="reference", options=RingOptions(launch_tapes="off"))
    S = 24 * P
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*launch_tapes.*")  # "on" says why a call is not taped: all are
        for seed in (1, 2, 3):
            got = _fwd_bwd(taped, *_qkv(S, h, hk, seed), seed, **kw)
            want = _fwd_bwd(plain, *_qkv(S, h, hk, seed), seed, **kw)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), seed
    assert taped.tapes.recorded == 2  # the forward and the backward at their second call; the third replayed
    assert plain.tapes is None



def test_taped_head_groups_written_in_one_pass_equal_untaped_calls(monkeypatch):
    """fp32 block gradients in place in two kv-head groups of a backend's own layout, written out in one
    pass for both groups (strided views spanning the groups' buffers, into a permuted view of dk / dv):
    the taped backward equals the untaped one bit for bit, and both wrote the groups in one pass."""
    from helpers import HeadMajorGrads

    from ringfa4.kernels.reference import _ReferenceAccum

    made = []
    monkeypatch.setattr(_ReferenceAccum, "kv_layout", lambda self, k, cap: made.append(
        HeadMajorGrads(k, cap, 1)) or made[-1])
    opts = RingOptions(fp32_grads=True, dkv_groups=2)
    taped = ContextParallel.simulated(4, backend="reference", options=opts.replace(launch_tapes="on"))
    plain = ContextParallel.simulated(4, backend="reference", options=opts.replace(launch_tapes="off"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*launch_tapes.*")
        for seed in (1, 2, 3):
            got = _fwd_bwd(taped, *_qkv(96, 4, 2, seed, torch.bfloat16), seed, causal=True)
            want = _fwd_bwd(plain, *_qkv(96, 4, 2, seed, torch.bfloat16), seed, causal=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), seed
    assert taped.tapes.recorded == 2
    assert sum(lay.group_writes for lay in made) == (3 + 2) * 4  # a write a rank: plain 3 calls, taped 2 (+ 1 replay)

def test_packs_are_taped_at_their_second_call_and_stay_exact():
    P = 4
    taped = ContextParallel.simulated(P, backend="reference", options=RingOptions(launch_tapes="on"))
    plain = ContextParallel.simulated(P, backend="reference", options=RingOptions(launch_tapes="off"))
    lengths = [50, 7, 0, 90, 13]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    outs = []
    for cp in (taped, plain):
        pack = cp.pack(cu, mode="ring")
        res = []
        for seed in (1, 2, 3):
            g = torch.Generator().manual_seed(seed)
            q, k, v = (pack.shard(torch.randn(total, n, 16, generator=g), 0).requires_grad_() for n in (4, 2, 2))
            o = ringfa4.attention(q, k, v, cp=cp, packing=pack, causal=True)
            o.backward(torch.randn(o.shape, generator=g))
            res.append((o.detach(), q.grad, k.grad, v.grad))
        outs.append(res)
    for got, want in zip(*outs):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert taped.tapes.recorded == 2  # recorded at the pack's second call, replayed at its third


def test_auto_leaves_cpu_calls_untaped_and_off_never_tapes():
    auto = ContextParallel.simulated(2, backend="reference")
    assert auto.options.launch_tapes == "auto"
    _fwd_bwd(auto, *_qkv(32, 2, 2, 0), 0, causal=True)
    assert auto.tapes.recorded == 0
    assert ContextParallel.simulated(2, backend="reference", options=RingOptions(launch_tapes="off")).tapes is None


def test_a_call_over_the_scratch_cap_runs_untaped_and_says_so_once():
    cp = ContextParallel.simulated(2, backend="reference", options=RingOptions(launch_tapes="on", launch_tape_mib=0))
    _fwd_bwd(cp, *_qkv(32, 2, 2, 0), 0, causal=True)  # a key's first call is not recorded
    with pytest.warns(UserWarning, match="over launch_tape_mib"):
        _fwd_bwd(cp, *_qkv(32, 2, 2, 0), 0, causal=True)
    assert cp.tapes.recorded == 0 and cp.tape_memory() == 0


def test_the_tapes_memory_is_their_scratch():
    cp = ContextParallel.simulated(2, backend="reference", options=RingOptions(launch_tapes="on"))
    for seed in range(2):  # the key's second call is recorded
        _fwd_bwd(cp, *_qkv(64, 2, 2, seed), seed, causal=True)
    assert cp.tapes.recorded == 2 and cp.tape_memory() > 0
    assert cp.tape_memory() == sum(cp.tapes.key_bytes.values())


@pytest.mark.parametrize("field,value", [("launch_tapes", "yes"), ("launch_tapes", True), ("launch_tape_mib", -1),
                                         ("launch_tape_mib", 1.5), ("launch_tape_mib", True)])
def test_bad_tape_options_are_refused(field, value):
    with pytest.raises(ValueError, match=f"RingOptions.{field}"):
        RingOptions(**{field: value})


def test_empty_tensors_are_made_per_replay():
    def with_empties(q):
        none = q.new_empty((0, 3))
        return [q[:0] * 2, none + 1, q * 2]
    q = torch.randn(4, 3)
    _, out, tape = _record(with_empties, [q])
    assert tape.verify([q], out, exact=True) is None
    got = tape.replay([torch.ones(4, 3)])
    assert [tuple(t.shape) for t in got] == [(0, 3), (0, 3), (4, 3)] and torch.equal(got[2], torch.full((4, 3), 2.0))


def test_casts_and_reductions_replay_as_one_op_each():
    """A cast is a copy into the recorded result, a reduction its out= form: no op runs and is then
    copied (one launch each on a GPU, as untaped)."""
    def casts(a):
        return [a.to(torch.bfloat16), a.float().sum(0), torch.cat([a, a])]
    a = torch.randn(4, 3, dtype=torch.float64)
    _, out, tape = _record(casts, [a])
    assert len(tape) == 4 and all(e.results is None for e in tape.entries)
    assert tape.verify([a], out, exact=True) is None


def test_factories_that_fill_replay_as_that_fill():
    """zeros / ones / full (and their _like / new_ forms) and arange replay as the fill they run on
    their result (no factory run and copied: one launch each on a GPU, as untaped), on every replay."""
    def factories(a):
        z = torch.zeros_like(a).add_(a)
        o = a.new_ones(a.shape[0]) * 2
        f = torch.full((2, 3), -1.5, dtype=torch.float64) + torch.full_like(a[:2], 0.25)
        r = torch.arange(5) + torch.arange(2, 7) + torch.arange(1, 11, 2) + torch.ones(5, dtype=torch.int64)
        return [z, o, f, r, torch.zeros(3, dtype=torch.int32)]
    a = torch.randn(4, 3, dtype=torch.float64)
    _, out, tape = _record(factories, [a])
    assert all(e.results is None for e in tape.entries)
    assert {"aten.zero_.default", "aten.fill_.Scalar", "aten.arange.start_out"} <= {e.name for e in tape.entries}
    assert tape.verify([a], out, exact=True) is None
    b = torch.randn(4, 3, dtype=torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(tape.replay([b]), factories(b)))


def test_outputs_made_whole_in_their_layout_and_the_rest_as_views():
    """A fresh output one slot covers densely (any dim order) is made in its own layout, the others
    (a storage two outputs share, one with gaps) as views of one allocation: every replay alike."""
    from ringfa4.kernels.tape import _dense_bytes, _Slot

    def outs(a):
        whole = torch.empty(3, 4, dtype=a.dtype).t()  # dense in another dim order
        whole.copy_(a * 2)
        both = torch.empty(2, 4, 3, dtype=a.dtype)
        both[0].copy_(a + 1)
        both[1].copy_(a - 1)
        gaps = torch.empty(4, 6, dtype=a.dtype)[:, ::2]
        gaps.copy_(a)
        return [whole, both[0], both[1], gaps]
    a = torch.randn(4, 3, dtype=torch.float64)
    _, out, tape = _record(outs, [a])
    assert sum(tape.made_whole) == 1 and len(tape.made_whole) == 3
    assert tape.verify([a], out, exact=True) is None
    b = torch.randn(4, 3, dtype=torch.float64)
    got = tape.replay([b])
    assert got[0].stride() == (1, 4) and got[1].data_ptr() + 12 * 8 == got[2].data_ptr()
    assert all(torch.equal(x, y) for x, y in zip(got, outs(b)))
    slot = lambda shape, stride: _Slot("out", 0, 0, shape, stride, torch.float32)  # noqa: E731
    assert _dense_bytes(slot((4, 3), (1, 4))) == 48 and _dense_bytes(slot((1, 5, 1), (7, 1, 9))) == 20
    assert _dense_bytes(slot((4, 3), (6, 2))) == -1 and _dense_bytes(slot((4, 3), (1, 1))) == -1
    assert _dense_bytes(slot((0, 3), (3, 1))) == 0


@pytest.mark.parametrize("world,mode,h_kv", [(2, "dense", 2), (3, "dense", 1), (2, "ring", 2), (3, "allgather", 2)])
def test_real_ranks_replay_their_hops_and_equal_untaped_calls(pools, world, mode, h_kv):
    """gloo ranks: a hop's post and its watched wait are tape entries, so a replay posts, waits and
    unstages as an untaped call does: the results are the same bits on every rank."""
    for status, res in pools(world).run("tapes_real_rank", mode, h_kv, timeout=300):
        assert status == "ok", res
        assert res["same"] and res["off_untaped"]
        assert res["recorded"] == 2  # the forward and the backward, at their second call
        assert res["replays"] == 2  # the third call's forward and backward (real ranks: no check replay)


def test_transports_say_whether_their_hops_are_taped_and_checked():
    import datetime

    from ringfa4.parallel.transport import LoopbackTransport, P2PTransport, Transport

    assert LoopbackTransport().tape_blocker() is None and LoopbackTransport().tape_self_check()
    assert "does not say" in Transport().tape_blocker() and not Transport().tape_self_check()  # opt in
    nccl = P2PTransport(None, 1, 2, datetime.timedelta(seconds=5))  # no gloo group: NCCL's path
    assert P2PTransport.TAPED_NCCL  # on since tests/test_nccl_self_gpu.py passed on a GPU
    assert nccl.tape_blocker() is None and not nccl.tape_self_check()  # a check's hops would have no peer
    nccl.TAPED_NCCL = False  # the gate shut: NCCL's hops untaped, and said why
    assert "NCCL" in nccl.tape_blocker()
    nccl.gloo = True  # gloo's hops are taped whatever the gate
    assert nccl.tape_blocker() is None


def test_tapes_keep_at_most_the_cap_together_dropping_the_least_recently_replayed():
    cp = ContextParallel.simulated(2, backend="reference", options=RingOptions(launch_tapes="on"))
    plain = ContextParallel.simulated(2, backend="reference", options=RingOptions(launch_tapes="off"))
    for seed in range(3):  # length A: recorded at its second call
        _fwd_bwd(cp, *_qkv(96, 2, 2, seed), seed, causal=True)
    a_keys = set(cp.tapes.order)
    cp.tapes.max_bytes = cp.tape_memory() + 1  # room for A's two tapes; B (a third of A's tokens) needs less
    for seed in range(3):  # length B: its tapes push (some of) A's out
        got = _fwd_bwd(cp, *_qkv(32, 2, 2, seed), seed, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(got, _fwd_bwd(plain, *_qkv(32, 2, 2, seed), seed, causal=True)))
    assert cp.tapes.recorded == 4 and len(cp.tapes.order) >= 2
    assert cp.tape_memory() <= cp.tapes.max_bytes and len(a_keys & set(cp.tapes.order)) < 2
    for seed in range(3):  # A again: exact, and the tapes still within the cap
        got = _fwd_bwd(cp, *_qkv(96, 2, 2, seed), seed, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(got, _fwd_bwd(plain, *_qkv(96, 2, 2, seed), seed, causal=True)))
    assert cp.tape_memory() <= cp.tapes.max_bytes


def test_calls_with_sinks_run_untaped_and_say_so():
    cp = ContextParallel.simulated(2, backend="reference", options=RingOptions(launch_tapes="on"))
    sinks = torch.zeros(2, requires_grad=True)
    with pytest.warns(UserWarning, match="sinks are not taped"):
        for seed in range(3):
            _fwd_bwd(cp, *_qkv(32, 2, 2, seed), seed, causal=True, sinks=sinks)
    assert cp.tapes.recorded == 0
