"""All-gather-KV mode: the travelling documents' K/V gathered in one collective instead of P-1
ring hops, then each rank attends its local q to whole documents; dK/dV come back to their owners
the same way.

The collective is an *exchange* (:meth:`Transport.move_start`: row ranges moved straight from the
holders' K/V into the receivers' buffers): every rank receives only the keys its rows see (under the
causal mask a document's keys up to the end of its last piece there), not the whole pack. With the
balanced placement a split document lives on few ranks, so a rank receives about the key rows of the
placement's spread (``DocPlacement.key_rows``), not P times the largest rank's travelling rows: 2-4x
fewer bytes and less memory on the benchmark's packs at P = 8. The receiver lays the keys out in *key
slots* (:meth:`AllGatherSchedule.layout`, :class:`GroupLayout`): one a (piece, document) pair of its
calls, in the calls' order, so every call reads its keys as one contiguous range (no gather). The
backward returns the fp32 dK/dV of exactly the received rows along the moves reversed.

Every local row is then in exactly one call (its document's keys up to it), and every slot row too,
so the forward writes the final output directly (no fp32 partials, no merge: one varlen call's
numerics) and the backward writes each row's dq and each slot's dK/dV
(:class:`~ringfa4.kernels.spec.Written`). The travelling documents go in (at most) ``GATHER_GROUPS``
groups of about equal causal pairs (:meth:`~.packing.Packing.gather_groups`; one group where a rank's
share is small: :func:`gather_group_count`): group ``g + 1``'s moves are in flight while group ``g``
computes (the rank's whole documents compute while the first group arrives), and in the backward each
group's return is posted once its blocks are queued, so it overlaps the next group; at most two groups'
K/V are held at once.

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
from typing import NamedTuple

import torch

from ..kernels.rows_sum_triton import RowSums, sum_rows_
from ..kernels.sinks import apply_sinks_
from ..kernels.spec import Written
from .blocks import band_block, global_band, whole_block
from .memo import cached_method
from .packing import Packing
from .ring import calls
from .ring.home_grads import HomeGrads
from .varlen import PackSchedule, VarlenCall, q_runs

__all__ = ["AllGatherSchedule", "GroupLayout", "Move", "allgather_backward", "allgather_forward", "prefer_allgather"]


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


class Move(NamedTuple):
    """Rows ``[src_row, src_row + n)`` of rank ``src``'s local K/V into rows ``[slot_row, slot_row + n)``
    of the receiver's group buffer (:class:`GroupLayout`)."""

    src: int
    src_row: int
    n: int
    slot_row: int


class GroupLayout(NamedTuple):
    """A rank's K/V of one gather group, laid out for its calls: every pair of every call has its
    own *slot*, its document's key positions ``[k0, k1)`` in order, and the slots follow the calls'
    pairs, so each call's keys are one contiguous range of the buffer (no gather). ``moves`` fill
    the slots that no other slot of the same document contains; ``copies`` ``(row, from_row, n)``
    fill the others from the slot containing them once the moves arrived (a rank holding a
    document's head and tail: the head's keys are a prefix of the tail's)."""

    calls: tuple[VarlenCall, ...]
    rows: int
    moves: tuple[Move, ...]
    copies: tuple[tuple[int, int, int], ...]


def _slots_of(slots: list[tuple[int, int, int, int]]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The slots ``(doc, k0, k1, row)`` that moves fill (contained in no other, or in an equal one
    listed later) and the copies of the others from one of those containing them."""
    def contains(j, i):
        return slots[j][0] == slots[i][0] and slots[j][1] <= slots[i][1] and slots[i][2] <= slots[j][2]
    filled = [i for i in range(len(slots))
              if not any(j != i and contains(j, i) and (not contains(i, j) or j < i) for j in range(len(slots)))]
    copies = []
    for i in range(len(slots)):
        if i not in filled:
            j = next(j for j in filled if contains(j, i))
            copies.append((slots[i][3], slots[j][3] + slots[i][1] - slots[j][1], slots[i][2] - slots[i][1]))
    return filled, copies


@dataclass(frozen=True, eq=False)
class AllGatherSchedule(PackSchedule):
    """Blocks of ``rank``'s q against whole documents: a balanced pack's whole documents from the
    rank's own K/V (:meth:`home_calls`), the travelling (split) documents group by group
    (:meth:`Packing.gather_groups`) from that group's K/V buffer (:meth:`layout`: each call's keys
    one contiguous range, filled by moves straight from the holders' K/V)."""

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
    def _doc_segments(self, doc: int) -> tuple:
        """``(rank, segment)`` of every piece of document ``doc``, rank by rank."""
        return tuple((r, s) for r in range(self.world_size) for s in self.pack.segments(r) if s.doc == doc)

    @cached_method
    def layout(self, rank: int, g: int) -> GroupLayout:
        """``rank``'s calls of group ``g`` (its pieces against their documents' visible keys, cut
        into calls of contiguous query rows by :func:`~.varlen.q_runs`), their slots, the moves
        and the copies that fill them (:class:`GroupLayout`)."""
        lo, hi = global_band(self.causal, self.window)
        by_flags: dict[tuple, list] = {}
        for s in self.group_segments(rank, g):
            b = band_block((s.local, s.pos, s.length), (0, 0, self.pack.doc_lengths[s.doc]), lo, hi)
            if b is not None:
                by_flags.setdefault((b.causal, b.window), []).append(((b.q0, b.q1, b.k0, b.k1), s.doc))
        calls, slots, at = [], [], 0
        for key, got in sorted(by_flags.items(), key=str):
            doc_of = {pair[:2]: doc for pair, doc in got}
            for run in q_runs([pair for pair, _ in got]):
                pairs = []
                for q0, q1, k0, k1 in run:
                    slots.append((doc_of[(q0, q1)], k0, k1, at))
                    pairs.append((q0, q1, at, at + k1 - k0))
                    at += k1 - k0
                calls.append(VarlenCall(tuple(pairs), *key, False))
        filled, copies = _slots_of(slots)
        moves = []
        for doc, a, b, row in (slots[i] for i in filled):
            for src, s in self._doc_segments(doc):
                x, y = max(a, s.pos), min(b, s.pos + s.length)
                if x < y:
                    moves.append(Move(src, s.local + x - s.pos, y - x, row + x - a))
        return GroupLayout(tuple(calls), at, tuple(moves), tuple(copies))

    @cached_method
    def sends(self, rank: int, g: int) -> tuple[tuple[int, int, int], ...]:
        """``(dst, local row, n)`` of every move ``rank`` makes in group ``g``: each receiver's
        moves from it, in the receiver's order (so the k-th send to a rank fills its k-th receive
        from this one)."""
        return tuple((dst, m.src_row, m.n) for dst in range(self.world_size)
                     for m in self.layout(dst, g).moves if m.src == rank)

    @cached_method
    def return_rows(self, rank: int, g: int) -> int:
        """Rows of dK/dV ``rank`` gets back in group ``g``: one piece for each of its :meth:`sends`
        to another rank, staged in that order."""
        return sum(n for dst, _, n in self.sends(rank, g) if dst != rank)

    @cached_method
    def pieces(self, rank: int, g: int) -> tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]:
        """The group buffer's rows cut so that every view a call moves comes out of one
        ``split`` (one C++ call, not a ``narrow`` each): consecutive piece sizes over its
        :attr:`GroupLayout.rows` and then the :meth:`return_rows` staged. Returns the sizes, the
        piece of each move (in :attr:`GroupLayout.moves` order: moves tile the slots they fill,
        copied slots lie between them), how many pieces cover the slots, and the piece of each
        return (its :meth:`sends` to other ranks, in order)."""
        lay = self.layout(rank, g)
        sizes: list[int] = []
        piece, at = [0] * len(lay.moves), 0
        for i in sorted(range(len(lay.moves)), key=lambda i: lay.moves[i].slot_row):
            m = lay.moves[i]
            if m.slot_row > at:  # copied slots
                sizes.append(m.slot_row - at)
            piece[i], at = len(sizes), m.slot_row + m.n
            sizes.append(m.n)
        if at < lay.rows:
            sizes.append(lay.rows - at)
        slots = len(sizes)
        returns = []
        for dst, _, n in self.sends(rank, g):
            if dst != rank:
                returns.append(len(sizes))
                sizes.append(n)
        return tuple(sizes), tuple(piece), slots, tuple(returns)

    @cached_method
    def return_sums(self, rank: int, g: int, device: torch.device) -> RowSums:
        """Each of ``rank``'s travelling rows of group ``g``'s documents as the sum of its pieces,
        over the group's gradient buffer (its slots' :attr:`GroupLayout.rows`, then the
        :meth:`return_rows` staged): the rank's own slot rows (its moves to itself), then each
        return in :meth:`sends` order; a row with none (no query sees it) is written zero."""
        lay = self.layout(rank, g)
        spans = [(s.local, s.length, -1) for s in self.group_segments(rank, g)]
        spans += [(m.src_row, m.n, m.slot_row) for m in lay.moves if m.src == rank]
        at = lay.rows
        for dst, row, n in self.sends(rank, g):
            if dst != rank:
                spans.append((row, n, at))
                at += n
        return RowSums.from_spans(spans, device)

    def group_calls(self, rank: int, g: int) -> tuple[VarlenCall, ...]:
        return self.layout(rank, g).calls

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
    def blocks(self, rank: int) -> tuple[VarlenCall, ...]:
        """Every call of ``rank``: its home calls, then each group's."""
        return self.home_calls(rank) + tuple(c for g in range(len(self.groups)) for c in self.group_calls(rank, g))


def _rows(x: torch.Tensor, a: int, n: int) -> torch.Tensor:
    return x.narrow(0, a, n)


class _Arriving:
    """The gather groups in order as ``(g, (K, V) buffers per local rank)``: group 0's moves posted
    at once (the caller computes the home calls meanwhile), group ``g + 1``'s posted before group
    ``g`` is handed out, so they are in flight while ``g`` computes."""

    def __init__(self, run, ks, vs) -> None:
        self.run, self.ks, self.vs, self.n = run, ks, vs, len(run.schedule.groups)
        self.pending = self._post(0) if self.n else None

    def _post(self, g: int):
        """Group ``g``'s K/V moves posted: each rank's K/V rows sent straight from its ``k`` / ``v``
        into the receivers' group buffers (``(rows, h_kv, d)``, like ``k`` / ``v``)."""
        sched, sends, recvs, held = self.run.schedule, [], [], []
        for k, v, r in zip(self.ks, self.vs, self.run.ranks):
            lay = sched.layout(r, g)
            kv = (k.new_empty((lay.rows,) + tuple(k.shape[1:])), v.new_empty((lay.rows,) + tuple(v.shape[1:])))
            held.append(kv)
            sizes, piece, slots, _ = sched.pieces(r, g)
            parts = [x.split_with_sizes(sizes[:slots]) for x in kv]
            recvs.append([(m.src, part[j]) for m, j in zip(lay.moves, piece) for part in parts])
            sends.append([(dst, _rows(x, row, n)) for dst, row, n in sched.sends(r, g) for x in (k, v)])
        return held, self.run.transport.move_start(sends, recvs, "the K/V exchange")

    def __iter__(self):
        for g in range(self.n):
            held, pending = self.pending
            self.run.transport.finish(pending)
            for kv, r in zip(held, self.run.ranks):  # one multi-tensor copy a rank, as a real rank's
                copies = self.run.schedule.layout(r, g).copies  # (into other slots than they read)
                if copies:
                    torch._foreach_copy_([_rows(x, row, n) for row, _, n in copies for x in kv],
                                         [_rows(x, frm, n) for _, frm, n in copies for x in kv])
            self.pending = self._post(g + 1) if g + 1 < self.n else None
            yield g, held
            del held


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
    for g, held in arriving:
        compute(lambda r, g=g: sched.group_calls(r, g), lambda i, held=held: held[i])
    if run.sinks is not None:  # once, on the final rows
        for i, q in enumerate(qs):
            apply_sinks_(outs[i], lses[i], run.sinks)
            outs[i] = outs[i].to(q.dtype)
    return outs, lses


def allgather_backward(run, douts, qs, ks, vs, outs, lses):
    """Same contract as :func:`ring_backward`: each group's travelling dK/dV go back to their
    owners by the group's moves reversed (every rank returns the fp32 gradients of the slot rows
    it received), posted once the group's blocks are queued (they overlap the next group); once all
    came back, each owner writes every travelling row's dK/dV once, the sum of its own slot's and
    the returned pieces (:meth:`AllGatherSchedule.return_sums`, one pass a group:
    :func:`~ringfa4.kernels.rows_sum_triton.sum_rows_`). A balanced pack's whole documents' dK/dV
    stay home. Blocks write their fp32 dK/dV straight into the group's gradient buffers, laid out as
    its K/V buffers (contiguous key rows a call; each slot one call's) and followed by the staged
    returns, and each row's dq into the final q-dtype rows; a copied slot's gradients fold into the
    slot it was copied from. The rows that never travel as in the ring
    (:class:`~.ring.home_grads.HomeGrads`: a direct home call's own final gradients, else fp32
    accumulators that stay home)."""
    sched = run.schedule
    acc = torch.float64 if qs[0].dtype == torch.float64 else torch.float32
    fp32 = run.options.fp32_grads and qs[0].dtype != acc
    rows = HomeGrads(run, qs, ks, vs, sched.blocks, dq_once=True)
    dq_written = [Written(dq) for dq in rows.dqs]

    def block(i, call, held, dst, write: bool):
        """Call ``call``'s gradients: dq written (every row in one call); dK/dV written into
        ``dst``'s rows (a group's slots: one call each) or, for the home accumulators, added."""
        tensors = (douts[i], qs[i], *held, outs[i], lses[i])
        if rows.backward(i, call, tensors):
            return
        dkv = tuple(Written(x) for x in dst) if write else dst
        if fp32 and calls.backward_fp32(run.backend, call, tensors, run.spec, dq_written[i], dkv) is not None:
            return
        g = calls.backward(run.backend, call, tensors, run.spec)
        call.put_q(rows.dqs[i], g[0])
        for x, gx in zip(dst, g[1:]):
            if write:
                call.k_rows(x).copy_(gx)
            else:
                call.add_k(x, gx)

    arriving, returning = _Arriving(run, ks, vs), []
    for i, r in enumerate(run.ranks):
        for call in sched.home_calls(r):
            block(i, call, (ks[i], vs[i]), rows.homes[i], False)
    for g, held in arriving:
        sends, recvs, bufs = [], [], []
        for i, r in enumerate(run.ranks):
            lay = sched.layout(r, g)
            back = sched.return_rows(r, g)
            buf = tuple(torch.empty((lay.rows + back,) + tuple(x.shape[1:]), dtype=acc, device=x.device)
                        for x in held[i])  # the slots' dK / dV, then the returns staged
            grads = tuple(_rows(x, 0, lay.rows) for x in buf)
            for call in lay.calls:
                block(i, call, held[i], grads, True)
            for row, frm, n in lay.copies:  # a copied slot's gradients into the slot it came from
                for x in grads:
                    _rows(x, frm, n).add_(_rows(x, row, n))
            sizes, piece, _, returns = sched.pieces(r, g)
            parts = [x.split_with_sizes(sizes) for x in buf]
            sends.append([(m.src, part[j]) for m, j in zip(lay.moves, piece) if m.src != r for part in parts])
            back_from = [dst for dst, _, _ in sched.sends(r, g) if dst != r]
            recvs.append([(dst, part[j]) for dst, j in zip(back_from, returns) for part in parts])
            bufs.append(buf)
        del held  # (the next group's K/V already arriving)
        returning.append((g, run.transport.move_start(sends, recvs, "the dK/dV exchange"), bufs))
    outs_kv = [rows.travel_out(i) for i in range(len(run.ranks))]
    for g, pending, bufs in returning:
        run.transport.finish(pending)
        for i, r in enumerate(run.ranks):
            sums = sched.return_sums(r, g, bufs[i][0].device)
            for out, buf in zip(outs_kv[i], bufs[i]):
                sum_rows_(out, buf, sums)
    got = [rows.dkv_written(i) for i in range(len(run.ranks))]
    return rows.dq(), [dk for dk, _ in got], [dv for _, dv in got]
