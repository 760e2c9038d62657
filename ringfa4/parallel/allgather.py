"""All-gather-KV mode for packs of many short documents: one all-gather of every rank's K/V instead
of P-1 ring hops, then each rank attends its local q to whole documents; dK/dV come back to their
owners with one reduce-scatter.

With short documents each ring step has little work per token but a full K/V hop, so the hops stop
hiding behind compute; one all-gather moves the same bytes once, with no per-step latency. The
rule (``mode="auto"`` in ``cp.pack``): per token, a ring step computes ~4 l h d / P FLOPs (l = the
token-weighted mean document length, sum(L^2) / S) and moves 4 h_kv d bytes of K/V; at ~600
TFLOP/s against ~300 GB/s the hop hides when l >= 2000 P h_kv / h. Below that: all-gather.
Second, on the compute side: the ring makes about two varlen calls a step on chunks of l / 2P
tokens, and below ~2k-token chunks each call's host overhead outweighs its GPU work. Measured on
the H200 (benchmarks/varlen_sim.py, 7 documents of 1k-16k tokens, l ~ 10k, h = 32 / 8):
all-gather 0.67 / 0.62 (fwd / fwd+bwd efficiency) vs ring 0.58 / 0.53 at P = 4, and 0.57 / 0.47
vs 0.25 / 0.40 at P = 8; so all-gather also when l < 4096 P. ``mode="ring"`` or ``"allgather"``
overrides the rule.
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
from .ring.buffers import travelling
from .ring.run import direct_home
from .varlen import PackSchedule, VarlenCall

__all__ = ["AllGatherSchedule", "allgather_backward", "allgather_forward", "prefer_allgather"]


def prefer_allgather(pack: Packing, num_heads: int, num_kv_heads: int) -> bool:
    """The documented rule of the module docstring, over the documents whose K/V travel (a
    balanced pack's split documents; all of them per document). Nothing travels: the ring, which
    then makes no hop."""
    lengths = [pack.doc_lengths[i] for i in pack.split_docs()]
    if sum(lengths) == 0:
        return False
    mean_len = sum(n * n for n in lengths) / sum(lengths)
    P = pack.world_size
    return mean_len < max(2000 * P * num_kv_heads / num_heads, 4096 * P)


@dataclass(frozen=True, eq=False)
class AllGatherSchedule(PackSchedule):
    """Blocks of ``rank``'s q against whole documents: the travelling (split) documents from the
    gathered K/V (:class:`GatheredCall`: key positions in the documents' global order, read from
    the gathered rows); a balanced pack's whole documents from the rank's own K/V (``home``
    calls)."""

    @cached_method
    def _gathered_starts(self) -> dict[int, int]:
        """Per travelling document, where its first token sits in the gathered global order."""
        out, at = {}, 0
        for doc in self.pack.split_docs():
            out[doc] = at
            at += self.pack.doc_lengths[doc]
        return out

    @cached_method
    def _doc_pieces(self) -> dict[int, list[tuple[int, int, int]]]:
        """Per travelling document its pieces in document order: (pos, length, gathered row), the
        row being ``rank * 2 * cap + local`` (:func:`gathered_rows`: the rank-major ``[k | v]``
        buffers of ``cap`` rows each, viewed as rows)."""
        out: dict[int, list] = {}
        two_cap = 2 * self.max_travel_rows
        for r in range(self.world_size):
            for s in self.pack.segments(r):
                if s.travels:
                    out.setdefault(s.doc, []).append((s.pos, s.length, r * two_cap + s.local))
        return {doc: sorted(p) for doc, p in out.items()}

    def _runs(self, doc: int, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """Document ``doc``'s key positions ``[a, b)`` as runs (gathered row, length)."""
        runs = []
        for pos, n, row in self._doc_pieces()[doc]:
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                runs.append((row + lo - pos, hi - lo))
        return tuple(runs)

    @cached_method
    def blocks(self, rank: int) -> tuple[VarlenCall, ...]:
        lo, hi = global_band(self.causal, self.window)
        starts = self._gathered_starts()
        groups: dict[tuple, list] = {}
        for s in self.pack.segments(rank):
            home = not s.travels
            if home:  # the document against itself: one call for all of them
                b = whole_block(s.local, s.length, lo, hi)
            else:
                b = band_block((s.local, s.pos, s.length), (starts[s.doc], 0, self.pack.doc_lengths[s.doc]), lo, hi)
            if b is not None:
                runs = () if home else self._runs(s.doc, b.k0 - starts[s.doc], b.k1 - starts[s.doc])
                groups.setdefault((b.causal, b.window, home), []).append(((b.q0, b.q1, b.k0, b.k1), runs))
        out = []
        for key, got in sorted(groups.items(), key=str):
            got.sort()
            pairs = tuple(p for p, _ in got)
            out.append(VarlenCall(pairs, key[0], key[1], True) if key[2] else
                       GatheredCall(pairs, key[0], key[1], False, tuple(r for _, r in got)))
        return tuple(out)


@dataclass(frozen=True)
class GatheredCall(VarlenCall):
    """A call of travelling documents: its key rows (``pairs``' k ranges are positions in the
    documents' global order) read from the gathered buffers' rows, where a document's pieces
    sit rank-major: ``k_runs`` holds, per pair, its (gathered row, length) runs. The held K is the
    rows view of the gathered buffers and the held V the same view ``cap`` rows on
    (:func:`gathered_rows`), so one index serves both and the keys are gathered once a call,
    straight from what the all-gather received; dK/dV go back by the same index into the
    reduce-scatter's buffer."""

    k_runs: tuple[tuple[tuple[int, int], ...], ...] = ()
    k_contiguous: ClassVar[bool] = False

    def _key_index(self, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(row, row + n) for runs in self.k_runs for row, n in runs]).to(device)


def _layout(k, v, cap):
    ks, vs = (cap,) + tuple(k.shape[1:]), (cap,) + tuple(v.shape[1:])
    return ks, vs, math.prod(ks), math.prod(ks) + math.prod(vs)


def _flat(k, v, cap, dtype=None):
    ks, vs, kn, n = _layout(k, v, cap)
    buf = torch.zeros(n, dtype=dtype or k.dtype, device=k.device)
    buf[: k.numel()].copy_(k.reshape(-1))
    buf[kn: kn + v.numel()].copy_(v.reshape(-1))
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


def _gathered_kv(run, ks, vs):
    """Per local rank: the held (K, V) of :func:`gathered_rows` over every rank's travelling rows."""
    cap = run.schedule.max_travel_rows
    tk, tv = travelling(run, ks, vs)
    gathered = run.transport.all_gather([_flat(k, v, cap) for k, v in zip(tk, tv)])
    return [gathered_rows(g, ks[0], vs[0], cap) for g in gathered]


def allgather_forward(run, qs, ks, vs):
    """Same contract as :func:`ring_forward`, packed tensors only. Every local row is in exactly
    one call (a segment is one block: its document's visible keys in one range), so each call
    writes its rows of the output (q's dtype) and lse straight into the results: one varlen call's
    numerics, no partials and no merge. With sinks the output is fp32 where the backend writes
    fp32 blocks, rescaled by the sinks once and then cast."""
    kv = _gathered_kv(run, ks, vs)
    outs, lses = [], []
    for i, r in enumerate(run.ranks):
        q, blocks = qs[i], run.schedule.blocks(r)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=lse_dtype, device=q.device)
        wide = run.sinks is not None and run.backend.fp32_block_outputs(q.device)
        covered = sum(b - a for c in blocks for a, b, _, _ in c.pairs) == q.shape[0]
        out = (torch.empty if covered else torch.zeros)(q.shape[:-1] + (vs[i].shape[-1],), device=q.device,
                                                        dtype=lse_dtype if wide else q.dtype)
        for call in blocks:
            held = (ks[i], vs[i]) if call.home else kv[i]
            o, l = calls.forward(run.backend, call, q, *held, run.spec, out, lse)
            call.put_q(out, o)
            call.put_lse(lse, l)
        if run.sinks is not None:  # once, on the final rows
            apply_sinks_(out, lse, run.sinks)
            out = out.to(q.dtype)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def allgather_backward(run, douts, qs, ks, vs, outs, lses):
    """Same contract as :func:`ring_backward`: the travelling dK/dV summed over ranks by one
    reduce-scatter; a balanced pack's whole documents' dK/dV stay home. Blocks add their fp32
    dK/dV by their key index straight into the reduce-scatter's rank-major buffer (laid out as
    :func:`gathered_rows` lays out K/V). The rank's whole documents, when one call of exactly the
    rows after the travelling prefix (:func:`~.ring.run.direct_home`), get their final dq / dk / dv
    from that call alone in the inputs' dtype (one varlen call's numerics, no fp32 accumulators)."""
    sched, cap = run.schedule, run.schedule.max_travel_rows
    kv = _gathered_kv(run, ks, vs)
    dqs, fulls, homes, finals = [], [], [], []
    for i, r in enumerate(run.ranks):
        acc = torch.float64 if qs[i].dtype == torch.float64 else torch.float32
        blocks, travel = sched.blocks(r), sched.travel_rows(r)
        direct = direct_home(run, blocks, r)
        dq = torch.zeros(qs[i].shape if direct is None else (travel,) + tuple(qs[i].shape[1:]), dtype=acc,
                         device=qs[i].device)
        flat, (dk, dv), bases = _grad_rows(sched.world_size, ks[i], vs[i], cap, acc)
        home = None if travel == sched.rows(r) or direct is not None else (
            torch.zeros(ks[i].shape, dtype=acc, device=dq.device),
            torch.zeros(vs[i].shape, dtype=acc, device=dq.device))
        fp32 = run.options.fp32_grads and qs[i].dtype != acc
        final = None
        for call in blocks:
            held, dst = ((ks[i], vs[i]), home) if call.home else (kv[i], (dk, dv))
            tensors = (douts[i], qs[i], *held, outs[i], lses[i])
            if call is direct:
                final = calls.backward(run.backend, call, tensors, run.spec)
                continue
            kept = calls.backward_fp32(run.backend, call, tensors, run.spec, dq, dst) if fp32 else None
            if kept is None:
                g = calls.backward(run.backend, call, tensors, run.spec)
                call.add_q(dq, g[0])
                kept = g[1:]
            if kept:
                call.add_k(dst[0], kept[0])
                call.add_k(dst[1], kept[1])
        homes.append(home)
        finals.append(final)
        fulls.append(flat if bases is None else _rank_major(*bases, ks[i], vs[i], cap))
        dqs.append(dq.to(qs[i].dtype) if final is None else calls.join_rows(dq, final[0], qs[i].dtype))
    mine = run.transport.reduce_scatter(fulls)
    dks, dvs = [], []
    for i, r in enumerate(run.ranks):
        ks_, vs_, kn, _ = _layout(ks[i], vs[i], cap)
        n = sched.travel_rows(r)
        dk, dv = mine[i][:kn].view(ks_)[:n], mine[i][kn:].view(vs_)[:n]
        if finals[i] is not None:
            dks.append(calls.join_rows(dk, finals[i][1], ks[i].dtype))
            dvs.append(calls.join_rows(dv, finals[i][2], vs[i].dtype))
            continue
        if homes[i] is not None:  # the travelled dK/dV added to what stayed home
            homes[i][0][:n] += dk
            homes[i][1][:n] += dv
            dk, dv = homes[i]
        dks.append(dk.to(ks[i].dtype))
        dvs.append(dv.to(vs[i].dtype))
    return dqs, dks, dvs


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
