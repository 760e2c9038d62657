"""All-gather-KV mode: the travelling documents' K/V gathered in one collective instead of P-1
ring hops, then each rank attends its local q to whole documents; dK/dV come back to their owners
the same way.

The collective is an *exchange* (an all-to-all of uneven chunks, :meth:`Transport.exchange_start`):
every rank sends every rank only the pieces that rank's rows see (:meth:`AllGatherSchedule.needs`:
under the causal mask a document's keys up to the end of its last piece there), not the whole pack
to everyone. With the balanced placement a split document lives on few ranks, so a rank receives
and holds about the key rows of the placement's spread (``DocPlacement.key_rows``), not P times
the largest rank's travelling rows: 2-4x fewer bytes and less memory on the benchmark's packs at
P = 8. The backward returns the fp32 dK/dV of exactly those rows along the reversed exchange.

Every local row is then in exactly one call (its document's keys up to it), so the forward writes
the final output directly (no fp32 partials, no merge: one varlen call's numerics) and each
row's dq comes from one call. The travelling documents go in (at most) ``GATHER_GROUPS`` groups
of about equal causal pairs (:meth:`~.packing.Packing.gather_groups`; one group where a rank's
share is small: :func:`gather_group_count`): group ``g + 1``'s
exchange is in flight while group ``g`` computes (the rank's whole documents compute while the
first group arrives), and in the backward each group's return exchange is posted once its blocks
are queued, so it overlaps the next group; at most two groups' K/V are held at once.

The rule (``mode="auto"`` in ``cp.pack``), over the travelling documents: per token, a ring step
computes ~4 l h d / P FLOPs (l = the token-weighted mean document length, sum(L^2) / S) and moves
4 h_kv d bytes of K/V; at ~600 TFLOP/s against ~300 GB/s the hop hides when l >= 2000 P h_kv / h.
Below that: all-gather. Second, on the compute side: the ring makes about two varlen calls a step
on chunks of l / 2P tokens, each with fp32 partials and a merge; measured on the H200
(benchmarks/varlen_sim.py, 7 documents of 1k-16k tokens, l ~ 10k, h = 32 / 8) the ring reached
0.58 / 0.53 (fwd / fwd+bwd efficiency) at P = 4 and 0.25 / 0.40 at P = 8, so all-gather also when
l < 4096 P. Third, above that: the exchange still computes less (one call a row) and moves
less (each rank only the keys its rows see, where every ring hop carries every travelling
document): the long-tail mix at P = 8 (20 documents of 128-64k, 4 split) measured 0.92 / 0.92
against the ring's 0.78-0.80 / 0.85 over two device calls. What the ring keeps is memory: it holds
two K/V buffers of one rank's rows, where the exchange holds each rank's received keys of a group
at once. So the all-gather mode wherever no rank would hold more than ``HELD_SHARE`` (4) times
its share S / P of rows in one group (:func:`held_rows`), and the ring beyond (one dominant
document, such as 200k tokens beside 25k of others at P = 8: its last pieces' holder would receive
nearly all of it). ``mode="ring"`` or ``"allgather"`` overrides the
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


HELD_SHARE = 4  # the exchange holds at most this many times a rank's share of rows (S / P) of one group's K/V


def held_rows(pack: Packing) -> int:
    """The most K/V rows one rank receives in one group's exchange under the causal mask: over
    the group's documents it holds pieces of, each one's keys up to the end of its last piece."""
    groups = pack.gather_groups(gather_group_count(pack))
    ends = [pack.piece_ends(r) for r in range(pack.world_size)]
    return max((sum(e.get(d, 0) for d in g) for e in ends for g in groups), default=0)


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
    return held_rows(pack) * P <= HELD_SHARE * sum(pack.doc_lengths)


@dataclass(frozen=True, eq=False)
class AllGatherSchedule(PackSchedule):
    """Blocks of ``rank``'s q against whole documents: a balanced pack's whole documents from the
    rank's own K/V (:meth:`home_calls`), the travelling (split) documents group by group
    (:meth:`Packing.gather_groups`) from that group's gathered K/V (:meth:`group_calls`,
    :class:`GatheredCall`: key positions in the documents' order, read from the received rows).
    What group ``g``'s exchange delivers to a rank: source-major, each source's pieces of the
    group's documents that the rank needs (:meth:`sent`), in the source's local order."""

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
    def needs(self, rank: int) -> dict[int, tuple[int, int]]:
        """Per travelling document ``rank`` holds pieces of, the key positions ``[lo, hi)`` its
        pieces see under the mask (causal: from the document's start, or the window's, to the end
        of its last piece; bidirectional: the whole document)."""
        lo, hi = global_band(self.causal, self.window)
        out: dict[int, tuple[int, int]] = {}
        for s in self.pack.segments(rank):
            b = band_block((s.local, s.pos, s.length), (0, 0, self.pack.doc_lengths[s.doc]), lo, hi) \
                if s.travels else None
            if b is not None:
                a, z = out.get(s.doc, (b.k0, b.k1))
                out[s.doc] = (min(a, b.k0), max(z, b.k1))
        return out

    @cached_method
    def sent(self, g: int, src: int, dst: int) -> tuple:
        """``src``'s segments of group ``g``'s documents that ``dst`` needs (overlapping a key range
        of :meth:`needs`; ``src == dst`` included), in ``src``'s local order."""
        need = self.needs(dst)
        out = []
        for s in self.group_segments(src, g):
            r = need.get(s.doc)
            if r is not None and s.pos < r[1] and s.pos + s.length > r[0]:
                out.append(s)
        return tuple(out)

    @cached_method
    def send_rows(self, rank: int, g: int) -> tuple[int, ...]:
        """Rows ``rank`` sends each rank (rank order) in group ``g``'s exchange."""
        return tuple(sum(s.length for s in self.sent(g, rank, dst)) for dst in range(self.world_size))

    @cached_method
    def recv_rows(self, rank: int, g: int) -> tuple[int, ...]:
        """Rows ``rank`` receives from each rank (rank order) in group ``g``'s exchange."""
        return tuple(sum(s.length for s in self.sent(g, src, rank)) for src in range(self.world_size))

    @cached_method
    def exchange_sizes(self, rank: int, g: int, width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(send, receive)`` element counts a rank (rank order) of group ``g``'s K/V exchange,
        rows of ``width`` elements (the dK/dV return swaps them)."""
        return (tuple(n * width for n in self.send_rows(rank, g)),
                tuple(n * width for n in self.recv_rows(rank, g)))

    @cached_method
    def send_index(self, rank: int, g: int, device: torch.device) -> torch.Tensor:
        """int64 local rows ``rank`` sends in group ``g``'s exchange, destination by destination
        (a row sent to several ranks appears once for each: their dK/dV come back and add)."""
        segs = [s for dst in range(self.world_size) for s in self.sent(g, rank, dst)]
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(s.local, s.local + s.length) for s in segs]).to(device)

    @cached_method
    def _doc_pieces(self, rank: int, g: int) -> dict[int, list[tuple[int, int, int]]]:
        """Per document of group ``g`` that ``rank`` needs, the pieces it receives in document
        order: (pos, length, row of its receive buffer; source-major, each source's rows in the
        source's local order)."""
        out: dict[int, list] = {}
        at = 0
        for src in range(self.world_size):
            for s in self.sent(g, src, rank):
                out.setdefault(s.doc, []).append((s.pos, s.length, at))
                at += s.length
        return {doc: sorted(p) for doc, p in out.items()}

    def _runs(self, rank: int, g: int, doc: int, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """Document ``doc``'s key positions ``[a, b)`` as runs (received row, length)."""
        runs = []
        for pos, n, row in self._doc_pieces(rank, g)[doc]:
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
                out.append(GatheredCall(run, *key, False,
                                        tuple(self._runs(rank, g, doc_of[p[:2]], p[2], p[3]) for p in run)))
        return tuple(out)

    @cached_method
    def blocks(self, rank: int) -> tuple[VarlenCall, ...]:
        """Every call of ``rank``: its home calls, then each group's."""
        return self.home_calls(rank) + tuple(c for g in range(len(self.groups)) for c in self.group_calls(rank, g))


@dataclass(frozen=True)
class GatheredCall(VarlenCall):
    """A call of travelling documents: its key rows (``pairs``' k ranges are key positions in
    each pair's document) read from the rows one group's exchange delivered (source-major):
    ``k_runs`` holds, per pair, its (received row, length) runs. Each received row is ``[k | v]``
    (:func:`kv_views`), so the held K and V are two strided views of one buffer, one index serves
    both and the keys are gathered once a call, straight from what arrived; dK/dV go back by the
    same index into the group's return buffer, laid out alike (:class:`~ringfa4.kernels.spec.RowsAt`)."""

    k_runs: tuple[tuple[tuple[int, int], ...], ...] = ()
    k_contiguous: ClassVar[bool] = False

    def _key_index(self, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(row, row + n) for runs in self.k_runs for row, n in runs]).to(device)


def row_width(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """Elements of one K row and of one V row (``h_kv x d``, ``h_kv x d_v``)."""
    return math.prod(k.shape[1:]), math.prod(v.shape[1:])


def kv_rows(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``(n, wk + wv)`` rows ``[k | v]`` of the local rows ``index`` (a send buffer, k's dtype)."""
    wk, wv = row_width(k, v)
    buf = torch.empty((index.numel(), wk + wv), dtype=k.dtype, device=k.device)
    torch.index_select(k.reshape(k.shape[0], wk), 0, index, out=buf[:, :wk])
    torch.index_select(v.reshape(v.shape[0], wv), 0, index, out=buf[:, wk:])
    return buf


def kv_views(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` shaped like ``k`` / ``v`` rows: strided views of ``[k | v]`` rows (a 1-D buffer
    of them, or ``(n, wk + wv)``)."""
    wk, wv = row_width(k, v)
    rows = rows.view(-1, wk + wv)
    n = rows.shape[0]
    return rows[:, :wk].view((n,) + tuple(k.shape[1:])), rows[:, wk:].view((n,) + tuple(v.shape[1:]))


def _exchange_start(run, ks, vs, g: int):
    """Group ``g``'s K/V exchange posted: each local rank sends every rank the pieces of the
    group's documents that its rows see (:meth:`AllGatherSchedule.sent`), as ``[k | v]`` rows."""
    sched = run.schedule
    sends, send_n, recv_n = [], [], []
    for k, v, r in zip(ks, vs, run.ranks):
        sends.append(kv_rows(k, v, sched.send_index(r, g, k.device)).view(-1))
        sizes = sched.exchange_sizes(r, g, sum(row_width(k, v)))
        send_n.append(sizes[0])
        recv_n.append(sizes[1])
    return run.transport.exchange_start(sends, send_n, recv_n, "the K/V exchange")


class _Arriving:
    """The gather groups in order as ``(g, held K/V per local rank)``: group 0's exchange posted
    at once (the caller computes the home calls meanwhile), group ``g + 1``'s posted before group
    ``g`` is handed out, so it is in flight while ``g`` computes."""

    def __init__(self, run, ks, vs) -> None:
        self.run, self.ks, self.vs, self.n = run, ks, vs, len(run.schedule.groups)
        self.pending = _exchange_start(run, ks, vs, 0) if self.n else None

    def __iter__(self):
        for g in range(self.n):
            kv = [kv_views(x, self.ks[0], self.vs[0]) for x in self.run.transport.finish(self.pending)]
            self.pending = _exchange_start(self.run, self.ks, self.vs, g + 1) if g + 1 < self.n else None
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
    """Same contract as :func:`ring_backward`: each group's travelling dK/dV go back to their
    owners by one exchange (the K/V exchange reversed: every rank returns the fp32 gradients of
    the rows it received), posted once the group's blocks are queued (it overlaps the next group),
    and each owner adds what comes back by its send index; a balanced pack's whole documents'
    dK/dV stay home. Blocks add their fp32 dK/dV by their key index straight into the group's
    return buffer (``[dk | dv]`` rows laid out as the received K/V rows). The rows that never
    travel as in the ring (:class:`~.ring.home_grads.HomeGrads`: a direct home call's own final
    gradients, else fp32 accumulators that stay home)."""
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

    arriving, returning = _Arriving(run, ks, vs), []
    for i, r in enumerate(run.ranks):
        for call in sched.home_calls(r):
            block(i, call, (ks[i], vs[i]), rows.homes[i])
    for g, kv in arriving:
        grads, send_n, recv_n = [], [], []
        for i, r in enumerate(run.ranks):
            w = sum(row_width(ks[i], vs[i]))
            flat = torch.zeros(sum(sched.recv_rows(r, g)) * w, dtype=acc, device=ks[i].device)
            dkv = kv_views(flat, ks[i], vs[i])
            for call in sched.group_calls(r, g):
                block(i, call, kv[i], dkv)
            grads.append(flat)
            sizes = sched.exchange_sizes(r, g, w)
            send_n.append(sizes[1])
            recv_n.append(sizes[0])
        del kv  # (the next group's K/V already arriving)
        returning.append(run.transport.exchange_start(grads, send_n, recv_n, "the dK/dV exchange"))
    travelled = [torch.zeros((sched.travel_rows(r), sum(row_width(ks[i], vs[i]))), dtype=acc, device=ks[i].device)
                 for i, r in enumerate(run.ranks)]  # [dk | dv] rows, as they come back
    for g, p in enumerate(returning):
        for i, (r, back) in enumerate(zip(run.ranks, run.transport.finish(p))):
            # index_put_'s sorted accumulate: deterministic, and on the H200 1.8x torch's index_add_ on
            # these wide rows (20k rows of 2048 fp32 into 8k: 160 against 294 us)
            travelled[i].index_put_((sched.send_index(r, g, ks[i].device),), back.view(-1, travelled[i].shape[1]),
                                    accumulate=True)
    got = [rows.dkv(i, *kv_views(t, ks[i], vs[i])) for i, t in enumerate(travelled)]
    return rows.dq(), [dk for dk, _ in got], [dv for _, dv in got]
