"""Ulysses: an all-to-all inside a group of U ranks turns ``(b, s/U, h, d)`` into
``(b, s, h/U, d)`` (all of the group's tokens, 1/U of the heads); the inverse all-to-all returns
the output. q, k and v travel in one all-to-all; tensors travel in their input dtype.

GQA: when the U ranks cannot split the h_kv K/V heads evenly (e.g. h_kv < U), K/V heads are
replicated by the smallest factor f (f | h/h_kv, U | h_kv*f) so each rank holds exactly the K/V
heads its q heads need; the replicas' gradients are summed back in fp32.
"""

from __future__ import annotations

import torch

__all__ = ["HeadSplit", "UlyssesComm", "exchange", "expand_kv_heads", "heads_to_seq", "lse_heads_to_seq",
           "seq_to_heads", "split_heads"]


class HeadSplit:
    """How h q heads and h_kv K/V heads split over U ranks: ``kv_factor`` replication of K/V."""

    def __init__(self, num_heads: int, num_kv_heads: int, degree: int, where: str = "") -> None:
        if degree < 1 or num_heads % degree != 0:
            valid = [u for u in range(1, num_heads + 1) if num_heads % u == 0]
            raise ValueError(f"{where}q heads {num_heads} cannot be split over a Ulysses degree of {degree}: "
                             f"valid degrees divide the head count: {valid}")
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"{where}k heads must divide q heads {num_heads}, got {num_kv_heads}")
        group = num_heads // num_kv_heads
        self.kv_factor = next(f for f in range(1, group + 1) if group % f == 0 and (num_kv_heads * f) % degree == 0)
        self.num_heads, self.num_kv_heads, self.degree = num_heads, num_kv_heads, degree

    @property
    def kv_heads_total(self) -> int:
        return self.num_kv_heads * self.kv_factor

    def __repr__(self) -> str:
        return (f"HeadSplit(h={self.num_heads}, h_kv={self.num_kv_heads}, U={self.degree}: "
                f"{self.num_heads // self.degree} q / {self.kv_heads_total // self.degree} kv heads per rank"
                f"{f', K/V replicated x{self.kv_factor}' if self.kv_factor > 1 else ''})")


class _ExpandKV(torch.autograd.Function):
    """repeat_interleave on the head dim; backward sums the replicas in fp32, one cast."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.repeat_interleave(factor, dim=2)

    @staticmethod
    def backward(ctx, g):
        b, s, h, d = g.shape
        acc = torch.promote_types(g.dtype, torch.float32)
        return g.view(b, s, h // ctx.factor, ctx.factor, d).to(acc).sum(3).to(g.dtype), None


def expand_kv_heads(x: torch.Tensor, factor: int) -> torch.Tensor:
    return x if factor == 1 else _ExpandKV.apply(x, factor)


def split_heads(x: torch.Tensor, degree: int, u: int, dim: int = 2) -> torch.Tensor:
    """Rank u's head slice of ``x`` along its head ``dim`` (what the all-to-all gives it)."""
    n = x.shape[dim] // degree
    return x.narrow(dim, u * n, n)


# -- the exchange: (B, n_me, H, d) pieces of a group of U ranks <-> (B, sum(pieces), H/U, d) -----------
def exchange(tensors: list[torch.Tensor], comm: UlyssesComm, to_heads: bool) -> list[torch.Tensor]:
    """One all-to-all of several ``(B, rows, H, d)`` tensors (dense: B = batch; packed: B = 1).
    ``to_heads``: my sequence piece ``(B, pieces[me], H, d)`` -> the group's rows in piece order
    for my head group ``(B, sum(pieces), H/U, d)``; else the inverse. The pieces may differ in
    length (packed documents); dense pieces are all equal."""
    U, pieces, me = comm.degree, comm.pieces, comm.me
    sends, shapes = [], []
    for t in tensors:
        b, _, h, d = t.shape
        if to_heads:  # peer j gets my rows x its head group
            sends.append(t.reshape(b, t.shape[1], U, h // U, d).permute(2, 0, 1, 3, 4).reshape(U, -1).unbind(0))
            shapes.append((b, h // U, d))
        else:  # peer j gets its piece's rows x my heads
            sends.append([p.reshape(-1) for p in t.split(pieces, dim=1)])
            shapes.append((b, h, d))
    flat = torch.cat([torch.cat([s[j] for s in sends]) for j in range(U)])
    send_sizes = [sum(s[j].numel() for s in sends) for j in range(U)]
    per_row = sum(b * h * d for b, h, d in shapes)
    recv_sizes = [pieces[j] * per_row for j in range(U)] if to_heads else [pieces[me] * per_row] * U
    per_peer = comm.all_to_all(flat, recv_sizes, send_sizes).split(recv_sizes)
    results, offsets = [], [0] * U
    for b, h, d in shapes:
        parts = []
        for j in range(U):
            n = b * (pieces[j] if to_heads else pieces[me]) * h * d
            parts.append(per_peer[j][offsets[j]:offsets[j] + n])
            offsets[j] += n
        if to_heads:  # peer j's piece rows, my heads
            results.append(torch.cat([p.view(b, -1, h, d) for p in parts], dim=1))
        else:  # my rows, head group j from peer j
            rows = pieces[me]
            results.append(torch.stack([p.view(b, rows, h, d) for p in parts], 2).reshape(b, rows, U * h, d))
    return results


class UlyssesComm:
    """The Ulysses group as the exchange needs it: ``degree`` U, this rank's index ``me``, the
    group's sequence ``pieces`` (rows of each rank), and ``all_to_all(flat, recv_sizes,
    send_sizes)`` (a blocking all-to-all with the group's timeout and failure reporting)."""

    def __init__(self, degree: int, me: int, pieces: list[int], all_to_all) -> None:
        self.degree, self.me, self.pieces, self.all_to_all = degree, me, pieces, all_to_all


class _AllToAll(torch.autograd.Function):
    """:func:`exchange` forward; the inverse exchange backward."""

    @staticmethod
    def forward(ctx, comm, to_heads, *tensors):
        ctx.comm, ctx.to_heads = comm, to_heads
        return tuple(exchange(list(tensors), comm, to_heads))

    @staticmethod
    def backward(ctx, *grads):
        back = exchange([g.contiguous() for g in grads], ctx.comm, not ctx.to_heads)
        return (None, None, *back)


def seq_to_heads(tensors: list[torch.Tensor], comm: UlyssesComm) -> list[torch.Tensor]:
    """``(B, pieces[me], H, d)`` each -> ``(B, sum(pieces), H/U, d)``: one all-to-all for all of
    them (same dtype), differentiable."""
    return list(_AllToAll.apply(comm, True, *tensors))


def heads_to_seq(x: torch.Tensor, comm: UlyssesComm) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads` for one tensor (the output), differentiable."""
    return _AllToAll.apply(comm, False, x)[0]


def lse_heads_to_seq(lse: torch.Tensor, comm: UlyssesComm) -> torch.Tensor:
    """lse ``(B, H/U, sum(pieces))`` float32 -> ``(B, H, pieces[me])`` (no gradient)."""
    y = lse.transpose(1, 2).unsqueeze(-1).contiguous()  # (B, s, H/U, 1)
    return exchange([y], comm, to_heads=False)[0].squeeze(-1).transpose(1, 2)
