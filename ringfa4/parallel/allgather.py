"""All-gather-KV mode: the travelling documents' K/V gathered by all-gathers instead of P-1 ring
hops, then each rank attends its local q to whole documents; dK/dV come back to their owners
by reduce-scatters.

Every local row is then in exactly one call (its document's keys up to it), so the forward writes
the final output directly (no fp32 partials, no merge: one varlen call's numerics) and each
row's dq comes from one call. The travelling documents go in (at most) ``GATHER_GROUPS`` groups
of about equal causal pairs (:meth:`~.packing.Packing.gather_groups`; one group where a rank's
share is small: :func:`gather_group_count`): group ``g + 1``'s
all-gather is in flight while group ``g`` computes (the rank's whole documents compute while the
first group arrives), and in the backward each group's reduce-scatter is posted once its blocks
are queued, so it overlaps the next group; at most two groups' K/V are held at once.

The rule (``mode="auto"`` in ``cp.pack``), over the travelling documents: per token, a ring step
computes ~4 l h d / P FLOPs (l = the token-weighted mean document length, sum(L^2) / S) and moves
4 h_kv d bytes of K/V; at ~600 TFLOP/s against ~300 GB/s the hop hides when l >= 2000 P h_kv / h.
Below that: all-gather. Second, on the compute side: the ring makes about two varlen calls a step
on chunks of l / 2P tokens, each with fp32 partials and a merge; measured on the H200
(benchmarks/varlen_sim.py, 7 documents of 1k-16k tokens, l ~ 10k, h = 32 / 8) the ring reached
0.58 / 0.53 (fwd / fwd+bwd efficiency) at P = 4 and 0.25 / 0.40 at P = 8, so all-gather also when
l < 4096 P. Third, above that: the all-gather still computes less (one call a row; the long-tail
mix at P = 8: 0.90 / 0.86 against the ring's 0.74 / 0.70), and with its groups pipelined its
collectives hide like the ring's hops, so all-gather wherever there are two groups and none holds
more than 3/4 of the travelling tokens (one dominant document keeps the ring: its gather could not
overlap, and would hold all of its K/V at once). ``mode="ring"`` or ``"allgather"`` overrides the
rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels.sinks import apply_sinks_
from .blocks import band_block, global_band, whole_block
from .memo import cached_method
from .packing import Packing
from .ring import calls
from .ring.home_grads import HomeGrads
from .varlen import PackSchedule, VarlenCall, q_runs

__all__ = ["AllGatherSchedule", "allgather_backward", "allgather_forward", "prefer_allgather"]


GATHER_GROUPS = 2  # documents gathered in (at most) this many groups, one overlapping the last one's attention
PIPELINE_PAIRS = 1 << 27  # causal pairs a rank of travelling documents (the mean) from which the groups pay


def gather_group_count(pack: Packing) -> int:
    """How many groups the travelling documents are gathered in: ``GATHER_GROUPS`` where a rank's
    share of their causal pairs reaches ``PIPELINE_PAIRS`` (2^27: ~3.5 ms of forward at h = 32,
    d = 128 on the H200), else 1. Each group adds about two varlen calls a rank (its pieces' two
    query runs), whose host cost a short rank cannot hide (measured: 7 documents of 1k-16k, 64k
    tokens, P = 8, 49M pairs a rank: forward 0.69 with one group, 0.47 with two)."""
    pairs = sum(pack.doc_lengths[d] * (pack.doc_lengths[d] + 1) // 2 for d in pack.split_docs())
    return GATHER_GROUPS if pairs >= PIPELINE_PAIRS * pack.world_size else 1


def prefer_allgather(pack: Packing, num_heads: int, num_kv_heads: int) -> bool:
    """The documented rule of the module docstring, over the documents whose K/V travel (a
    balanced pack's split documents; all of them per document). Nothing travels: the ring, which
    then makes no hop."""
    lengths = [pack.doc_lengths[i] for i in pack.split_docs()]
    if sum(lengths) == 0:
        return False
    mean_len = sum(n * n for n in lengths) / sum(lengths)
    P = pack.world_size
    if mean_len < max(2000 * P * num_kv_heads / num_heads, 4096 * P):
        return True
    groups = pack.gather_groups(gather_group_count(pack))
    largest = max(sum(pack.doc_lengths[d] for d in g) for g in groups)
    return len(groups) >= 2 and 4 * largest <= 3 * sum(lengths)


@dataclass(frozen=True, eq=False)
class AllGatherSchedule(PackSchedule):
    """Blocks of ``rank``'s q against whole documents: a balanced pack's whole documents from the
    rank's own K/V (:meth:`home_calls`), the travelling (split) documents group by group
    (:meth:`Packing.gather_groups`) from that group's gathered K/V (:meth:`group_calls`,
    :class:`GatheredCall`: key positions in the documents' order, read from the gathered rows).
    Group ``g``'s gathered buffers hold, rank-major, every rank's pieces of the group's documents
    (in local order), ``group_cap(g)`` rows a rank."""

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self._groups()

    @cached_method
    def _groups(self) -> tuple[tuple[int, ...], ...]:
        return self.pack.gather_groups(gather_group_count(self.pack))

    @cached_method
    def group_segments(self, rank: int, g: int) -> tuple:
        """``rank``'s travelling segments of group ``g``'s documents, in local order."""
        docs = set(self.groups[g])
        return tuple(s for s in self.pack.segments(rank) if s.travels and s.doc in docs)

    @cached_method
    def group_rows(self, rank: int, g: int) -> int:
        return sum(s.length for s in self.group_segments(rank, g))

    @cached_method
    def group_cap(self, g: int) -> int:
        """Rows a rank contributes to group ``g``'s gather (the largest rank's)."""
        return max(self.group_rows(r, g) for r in range(self.world_size))

    @cached_method
    def group_index(self, rank: int, g: int, device: torch.device) -> torch.Tensor:
        """int64 local rows of :meth:`group_segments` (what ``rank`` sends, in order)."""
        segs = self.group_segments(rank, g)
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(s.local, s.local + s.length) for s in segs]).to(device)

    @cached_method
    def _doc_pieces(self, g: int) -> dict[int, list[tuple[int, int, int]]]:
        """Per document of group ``g`` its pieces in document order: (pos, length, gathered row),
        the row being ``rank * 2 * cap + offset`` (:func:`gathered_rows`: the rank-major ``[k | v]``
        buffers of ``cap`` rows each, viewed as rows)."""
        out: dict[int, list] = {}
        two_cap = 2 * self.group_cap(g)
        for r in range(self.world_size):
            at = 0
            for s in self.group_segments(r, g):
                out.setdefault(s.doc, []).append((s.pos, s.length, r * two_cap + at))
                at += s.length
        return {doc: sorted(p) for doc, p in out.items()}

    def _runs(self, g: int, doc: int, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """Document ``doc``'s key positions ``[a, b)`` as runs (gathered row, length)."""
        runs = []
        for pos, n, row in self._doc_pieces(g)[doc]:
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                runs.append((row + lo - pos, hi - lo))
        return tuple(runs)

    @cached_method
    def home_calls(self, rank: int) -> tuple[VarlenCall, ...]:
        """The rank's whole documents, each against itself: one call for all of them (per mask)."""
        lo, hi = global_band(self.causal, self.window)
        groups: dict[tuple, list] = {}
        for s in self.pack.segments(rank):
            b = None if s.travels else whole_block(s.local, s.length, lo, hi)
            if b is not None:
                groups.setdefault((b.causal, b.window), []).append((b.q0, b.q1, b.k0, b.k1))
        return tuple(VarlenCall(tuple(sorted(p)), *key, True) for key, p in sorted(groups.items(), key=str))

    @cached_method
    def group_calls(self, rank: int, g: int) -> tuple[GatheredCall, ...]:
        """The rank's pieces of group ``g``'s documents against their documents' keys up to them,
        cut into calls of contiguous query rows (:func:`~.varlen.q_runs`: a part-0 and a part-1 run)."""
        lo, hi = global_band(self.causal, self.window)
        groups: dict[tuple, list] = {}
        for s in self.group_segments(rank, g):
            b = band_block((s.local, s.pos, s.length), (0, 0, self.pack.doc_lengths[s.doc]), lo, hi)
            if b is not None:
                groups.setdefault((b.causal, b.window), []).append(((b.q0, b.q1, b.k0, b.k1), s.doc))
        out = []
        for key, got in sorted(groups.items(), key=str):
            doc_of = {pair[:2]: doc for pair, doc in got}
            for run in q_runs([pair for pair, _ in got]):
                out.append(GatheredCall(run, *key, False, tuple(self._runs(g, doc_of[p[:2]], p[2], p[3]) for p in run)))
        return tuple(out)

    @cached_method
    def blocks(self, rank: int) -> tuple[VarlenCall, ...]:
        """Every call of ``rank``: its home calls, then each group's."""
        return self.home_calls(rank) + tuple(c for g in range(len(self.groups)) for c in self.group_calls(rank, g))


@dataclass(frozen=True)
class GatheredCall(VarlenCall):
    """A call of travelling documents: its key rows (``pairs``' k ranges are key positions in
    each pair's document) read from one gather group's buffers' rows, where a document's pieces
    sit rank-major: ``k_runs`` holds, per pair, its (gathered row, length) runs. The held K is the
    rows view of the gathered buffers and the held V the same view ``cap`` rows on
    (:func:`gathered_rows`), so one index serves both and the keys are gathered once a call,
    straight from what the all-gather received; dK/dV go back by the same index into the
    group's reduce-scatter buffer (:class:`~ringfa4.kernels.spec.RowsAt`)."""

    k_runs: tuple[tuple[tuple[int, int], ...], ...] = ()
    k_contiguous: ClassVar[bool] = False

    def _key_index(self, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(row, row + n) for runs in self.k_runs for row, n in runs]).to(device)


def _layout(k, v, cap):
    ks, vs = (cap,) + tuple(k.shape[1:]), (cap,) + tuple(v.shape[1:])
    return ks, vs, math.prod(ks), math.prod(ks) + math.prod(vs)


def _flat(k, v, cap, index, dtype=None):
    """A rank's ``[k | v]`` send buffer of ``cap`` rows each: rows ``index`` of its K and V first,
    zeros after."""
    ks, vs, kn, n = _layout(k, v, cap)
    buf = torch.zeros(n, dtype=dtype or k.dtype, device=k.device)
    rows = index.numel()
    torch.index_select(k, 0, index, out=buf[: kn].view(ks)[:rows])
    torch.index_select(v, 0, index, out=buf[kn:].view(vs)[:rows])
    return buf


def gathered_rows(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The held (K, V) of :class:`GatheredCall` from rank-major ``[k | v]`` buffers of ``cap`` rows
    each (what the all-gather returns, or the reduce-scatter's buffer): ``K (P * 2 cap, ...)`` their
    rows, V the same rows ``cap`` on, so row ``rank * 2 cap + local`` of either is that rank's
    token. Views where K and V rows have one shape; else copies into two such buffers (half of each
    unused)."""
    ks, vs, kn, n = _layout(k, v, cap)
    world = flat.numel() // n
    if ks == vs:
        rows = flat.view((world * 2 * cap,) + ks[1:])
        return rows, rows[cap:]
    per = flat.view(world, n)
    k_rows = flat.new_zeros((world, 2 * cap) + ks[1:])
    v_rows = flat.new_zeros((world, 2 * cap) + vs[1:])
    k_rows[:, :cap] = per[:, :kn].view((world,) + ks)
    v_rows[:, cap:] = per[:, kn:].view((world,) + vs)
    return k_rows.view((-1,) + ks[1:]), v_rows.view((-1,) + vs[1:])[cap:]


def _gather_start(run, ks, vs, g: int):
    """Group ``g``'s all-gather posted: every local rank's pieces of the group's documents."""
    sched = run.schedule
    cap = sched.group_cap(g)
    bufs = [_flat(k, v, cap, sched.group_index(r, g, k.device)) for k, v, r in zip(ks, vs, run.ranks)]
    return run.transport.all_gather_start(bufs)


def _gathered(run, ks, vs, g: int, pending) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per local rank: group ``g``'s held (K, V) (:func:`gathered_rows`) once its gather is in."""
    cap = run.schedule.group_cap(g)
    return [gathered_rows(x, ks[0], vs[0], cap) for x in run.transport.finish(pending)]


class _Arriving:
    """The gather groups in order as ``(g, held K/V per local rank)``: group 0's all-gather posted
    at once (the caller computes the home calls meanwhile), group ``g + 1``'s posted before group
    ``g`` is handed out, so it is in flight while ``g`` computes."""

    def __init__(self, run, ks, vs) -> None:
        self.run, self.ks, self.vs, self.n = run, ks, vs, len(run.schedule.groups)
        self.pending = _gather_start(run, ks, vs, 0) if self.n else None

    def __iter__(self):
        for g in range(self.n):
            kv = _gathered(self.run, self.ks, self.vs, g, self.pending)
            self.pending = _gather_start(self.run, self.ks, self.vs, g + 1) if g + 1 < self.n else None
            yield g, kv
            del kv


def allgather_forward(run, qs, ks, vs):
    """Same contract as :func:`ring_forward`, packed tensors only. Every local row is in exactly
    one call (a segment is one block: its document's visible keys in one range), so each call
    writes its rows of the output (q's dtype) and lse straight into the results: one varlen call's
    numerics, no partials and no merge. The home calls run while the first group's K/V arrive;
    with sinks the output is fp32 where the backend writes fp32 blocks, rescaled by the sinks once
    and then cast."""
    sched = run.schedule
    outs, lses = [], []
    for i, r in enumerate(run.ranks):
        q = qs[i]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lses.append(torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=lse_dtype, device=q.device))
        wide = run.sinks is not None and run.backend.fp32_block_outputs(q.device)
        covered = sum(b - a for c in sched.blocks(r) for a, b, _, _ in c.pairs) == q.shape[0]
        outs.append((torch.empty if covered else torch.zeros)(q.shape[:-1] + (vs[i].shape[-1],), device=q.device,
                                                             dtype=lse_dtype if wide else q.dtype))

    def compute(calls_of, held_of):
        for i, r in enumerate(run.ranks):
            for call in calls_of(r):
                o, l = calls.forward(run.backend, call, qs[i], *held_of(i), run.spec, outs[i], lses[i])
                call.put_q(outs[i], o)
                call.put_lse(lses[i], l)

    arriving = _Arriving(run, ks, vs)
    compute(sched.home_calls, lambda i: (ks[i], vs[i]))
    for g, kv in arriving:
        compute(lambda r, g=g: sched.group_calls(r, g), lambda i, kv=kv: kv[i])
    if run.sinks is not None:  # once, on the final rows
        for i, q in enumerate(qs):
            apply_sinks_(outs[i], lses[i], run.sinks)
            outs[i] = outs[i].to(q.dtype)
    return outs, lses


def allgather_backward(run, douts, qs, ks, vs, outs, lses):
    """Same contract as :func:`ring_backward`: each group's travelling dK/dV summed over ranks by
    one reduce-scatter, posted once the group's blocks are queued (it overlaps the next group);
    a balanced pack's whole documents' dK/dV stay home. Blocks add their fp32 dK/dV by their key
    index straight into the group's reduce-scatter buffer (laid out as :func:`gathered_rows` lays
    out K/V). The rows that never travel as in the ring (:class:`~.ring.home_grads.HomeGrads`: a
    direct home call's own final gradients, else fp32 accumulators that stay home)."""
    sched = run.schedule
    acc = torch.float64 if qs[0].dtype == torch.float64 else torch.float32
    fp32 = run.options.fp32_grads and qs[0].dtype != acc
    rows = HomeGrads(run, qs, ks, vs, sched.blocks)

    def block(i, call, held, dst):
        tensors = (douts[i], qs[i], *held, outs[i], lses[i])
        if rows.backward(i, call, tensors):
            return
        kept = calls.backward_fp32(run.backend, call, tensors, run.spec, rows.dqs[i], dst) if fp32 else None
        if kept is None:
            g = calls.backward(run.backend, call, tensors, run.spec)
            call.add_q(rows.dqs[i], g[0])
            kept = g[1:]
        if kept:
            call.add_k(dst[0], kept[0])
            call.add_k(dst[1], kept[1])

    arriving, scattering = _Arriving(run, ks, vs), []
    for i, r in enumerate(run.ranks):
        for call in sched.home_calls(r):
            block(i, call, (ks[i], vs[i]), rows.homes[i])
    for g, kv in arriving:
        cap, fulls = sched.group_cap(g), []
        for i, r in enumerate(run.ranks):
            flat, dkv, bases = _grad_rows(sched.world_size, ks[i], vs[i], cap, acc)
            for call in sched.group_calls(r, g):
                block(i, call, kv[i], dkv)
            fulls.append(flat if bases is None else _rank_major(*bases, ks[i], vs[i], cap))
        del kv  # (the next group's K/V already arriving)
        scattering.append(run.transport.reduce_scatter_start(fulls))
    travelled = [_travelled(run, ks[i], vs[i], r, acc) for i, r in enumerate(run.ranks)]
    for g, p in enumerate(scattering):
        for i, (r, mine) in enumerate(zip(run.ranks, run.transport.finish(p))):
            ks_, vs_, kn, _ = _layout(ks[i], vs[i], sched.group_cap(g))
            got, index = sched.group_rows(r, g), sched.group_index(r, g, ks[i].device)
            travelled[i][0].index_add_(0, index, mine[:kn].view(ks_)[:got])
            travelled[i][1].index_add_(0, index, mine[kn:].view(vs_)[:got])
    got = [rows.dkv(i, *t) for i, t in enumerate(travelled)]
    return rows.dq(), [dk for dk, _ in got], [dv for _, dv in got]


def _travelled(run, k: torch.Tensor, v: torch.Tensor, rank: int, dtype: torch.dtype):
    """Zeroed dK/dV of ``rank``'s travelling rows (the groups' reduce-scattered slices add in)."""
    n = run.schedule.travel_rows(rank)
    return (torch.zeros((n,) + tuple(k.shape[1:]), dtype=dtype, device=k.device),
            torch.zeros((n,) + tuple(v.shape[1:]), dtype=dtype, device=v.device))


def _grad_rows(world: int, k: torch.Tensor, v: torch.Tensor, cap: int, dtype: torch.dtype):
    """Zeroed dK/dV accumulators laid out as :func:`gathered_rows` lays out K/V: ``(flat, (dk,
    dv), None)`` with ``flat`` the reduce-scatter's buffer itself where K and V rows have one
    shape, else ``(None, (dk, dv), (dk_rows, dv_rows))`` for :func:`_rank_major`."""
    ks, vs, _, n = _layout(k, v, cap)
    if ks == vs:
        flat = torch.zeros(world * n, dtype=dtype, device=k.device)
        rows = flat.view((world * 2 * cap,) + ks[1:])
        return flat, (rows, rows[cap:]), None
    k_rows = torch.zeros((world * 2 * cap,) + ks[1:], dtype=dtype, device=k.device)
    v_rows = torch.zeros((world * 2 * cap,) + vs[1:], dtype=dtype, device=k.device)
    return None, (k_rows, v_rows[cap:]), (k_rows, v_rows)


def _rank_major(k_rows: torch.Tensor, v_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: int
                ) -> torch.Tensor:
    """The reduce-scatter's flat rank-major ``[dk | dv]`` buffer from :func:`_grad_rows`' two row
    buffers (K and V rows of different shapes)."""
    world = k_rows.shape[0] // (2 * cap)
    k_part = k_rows.view(world, 2 * cap, -1)[:, :cap].reshape(world, -1)
    v_part = v_rows.view(world, 2 * cap, -1)[:, cap:].reshape(world, -1)
    return torch.cat([k_part, v_part], 1).reshape(-1)
