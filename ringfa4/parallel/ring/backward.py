"""The ring backward: per block, the backend backward with the *global* merged out and lse; one
loop over the side :func:`backward_side` picks (K/V travel with their fp32 dK/dV and dq
accumulates locally, or the q side travels with its fp32 dq while K/V and dK/dV stay); the
travelling accumulators go in head groups that the kernels add into in place where the backend
can and reach their owner after the last active step; one cast at the end. Steps after the last
one any rank needs are not run.

Per hop the K/V side moves K, V and fp32 dK, dV (MHA bf16: 12 bytes per kv element), the q side
q, dout and fp32 dq (8 bytes per q element, plus two floats a row): for MHA a third less, for GQA
with h / h_kv >= 2 more. ``RingOptions.bwd_ring`` picks: ``"auto"`` the side that moves fewer
bytes a hop (the q side needs the backend's AccumBackward: FA4 on sm90, the reference backend),
``"kv"`` or ``"q"`` (q where it can run, else kv). Every rank chooses alike: shapes, dtypes,
options and the backend decide it.
"""

from __future__ import annotations

import torch

from .accum_sink import accum_states
from .kv_side import KVSide
from .protocols import BackwardSide
from .q_side import make_q_side, q_side_possible
from .run import RingRun, acc_dtype

__all__ = ["backward_side", "hop_bytes", "ring_backward"]


def ring_backward(run: RingRun, douts: list[torch.Tensor], qs: list[torch.Tensor], ks: list[torch.Tensor],
                  vs: list[torch.Tensor], outs: list[torch.Tensor], lses: list[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: dq, dk, dv in the inputs' dtypes (accumulated in fp32).

    The travelling data (K/V, or the q side) hops ``side.step`` ranks a step; the travelling fp32
    accumulators (dK/dV, or dq) go in ``side.groups`` pieces (head groups). Where the kernels add
    into the travelling buffer itself (``side.in_place``), each group waits for its piece's hop from
    the step before, runs its blocks into it and sends it on, so one group's hop hides behind the
    other groups' blocks; with two or more groups the data goes in group 0's hop (one transfer a
    rank-step fewer; the data then hides behind the later groups' blocks). Otherwise the data is
    posted before the step's blocks run, which go to a scratch (or come back per block) added after
    the accumulators' hop arrived. After the last step the accumulators go to their owners."""
    steps, world = run.active_steps, run.schedule.world_size
    side = backward_side(run, douts, qs, ks, vs, outs, lses)
    local = range(len(run.ranks))
    acc_cur = [list(x) for x in zip(*(side.accumulators(i, True) for i in local))]  # [group][local rank]
    acc_nxt = [list(x) for x in zip(*(side.accumulators(i, False) for i in local))]
    hops: list = [None] * side.groups
    home = -(steps - 1) * side.step % world  # after the last step: back to the owner
    # in place in head groups, the travelling data rides with group 0's accumulators (one transfer: one
    # NCCL batch, one loopback copy), posted after group 0's blocks and hidden behind the other groups'
    fused, waited = side.in_place and side.groups > 1, None
    for t in range(steps):
        more = t + 1 < steps
        data_hop = run.transport.shift(*side.ring.send_recv(), side.step) if more and not fused else None
        held = [side.held(i, r, t) for i, r in enumerate(run.ranks)]
        offset = side.step if more else home
        for g in range(side.groups):
            if side.in_place and hops[g] is not None:  # this group's accumulators, from the ranks before us
                if hops[g] is not waited:
                    run.transport.wait(hops[g])
                acc_cur[g], acc_nxt[g] = acc_nxt[g], acc_cur[g]
            made = [side.compute(g, i, r, t, held[i], acc_cur[g][i] if side.in_place else None)
                    for i, r in enumerate(run.ranks)]
            if not side.in_place and hops[g] is not None:
                run.transport.wait(hops[g])
                acc_cur[g], acc_nxt[g] = acc_nxt[g], acc_cur[g]
            for i, mine in enumerate(made):
                side.fold(i, mine, acc_cur[g][i], held[i])
            if fused and more and g == 0:
                send, recv = side.ring.send_recv()
                hops[0] = data_hop = run.transport.shift(_with(send, acc_cur[0]), _with(recv, acc_nxt[0]), offset)
            else:
                hops[g] = run.transport.shift(acc_cur[g], acc_nxt[g], offset) if offset else None
        if data_hop is not None:
            run.transport.wait(data_hop)
            side.ring.swap()
        waited = data_hop  # a fused hop: group 0's accumulators arrived with the data
    mine = side.local()  # what never travelled: runs while the last hops do
    for g, hop in enumerate(hops):
        if hop is not None:
            run.transport.wait(hop)
            acc_cur[g] = acc_nxt[g]
    return side.results(mine, acc_cur)


def _with(data: list, accs: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Per local rank, the pieces of its travelling data and its accumulator: one hop's pieces."""
    return [(*(d if isinstance(d, tuple) else (d,)), a) for d, a in zip(data, accs, strict=True)]


def hop_bytes(run: RingRun, qs, ks, vs, states: list | None = None) -> dict[str, int]:
    """Bytes one hop moves per rank: ``kv`` (K, V and their dK/dV accumulators on the wire) and,
    where ``states`` can run the q side, ``q`` (its travelling pieces and fp32 dq)."""
    wire = (acc_dtype(ks[0]) if run.options.dkv_wire_fp32 else ks[0].dtype).itemsize
    out = {"kv": (ks[0].numel() + vs[0].numel()) * (ks[0].element_size() + wire)}
    if states is not None and q_side_possible(run, qs, states):
        dq = states[0].dq_empty(0, qs[0].shape[2])
        out["q"] = sum(p.numel() * p.element_size() for p in states[0].travel()) + dq.numel() * dq.element_size()
    return out


def backward_side(run: RingRun, douts, qs, ks, vs, outs, lses) -> BackwardSide:
    """The side this backward runs (every rank alike; see the module doc)."""
    choice = run.options.bwd_ring
    states = accum_states(run, douts, qs, outs, lses)
    if choice != "kv":
        sizes = hop_bytes(run, qs, ks, vs, states)
        if "q" in sizes and (choice == "q" or sizes["q"] < sizes["kv"]):
            return make_q_side(run, states, qs, ks, vs)
    return KVSide(run, douts, qs, ks, vs, outs, lses, states)
