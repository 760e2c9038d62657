"""Ulysses: an all-to-all inside a group of U ranks turns ``(b, s/U, h, d)`` into
``(b, s, h/U, d)`` (all of the group's tokens, 1/U of the heads); the inverse all-to-all returns
the output. q, k and v travel in one all-to-all; tensors travel in their input dtype.

GQA: when the U ranks cannot split the h_kv K/V heads evenly (e.g. h_kv < U), K/V heads are
replicated by the smallest factor f (f | h/h_kv, U | h_kv*f) so each rank holds exactly the K/V
heads its q heads need; the replicas' gradients are summed back in fp32.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["HeadSplit", "expand_kv_heads", "heads_to_seq", "heads_to_seq_packed", "lse_heads_to_seq",
           "lse_heads_to_seq_packed", "seq_to_heads", "seq_to_heads_packed", "split_heads"]


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


def split_heads(x: torch.Tensor, degree: int, u: int) -> torch.Tensor:
    """Rank u's head slice of ``(b, s, h, d)`` (what the all-to-all gives it)."""
    n = x.shape[2] // degree
    return x[:, :, u * n:(u + 1) * n]


# -- row packing: one row per peer of the group ------------------------------------------------------
def _rows_by_head_group(x, U):  # (b, s_l, H, d) -> (U, b*s_l*H/U*d), row j = head group j
    b, s, h, d = x.shape
    return x.reshape(b, s, U, h // U, d).permute(2, 0, 1, 3, 4).reshape(U, -1)


def _seq_from_rows(rows, b, s, h, d, U):  # rows j = piece j of the sequence, heads h -> (b, U*s, h, d)
    return rows.reshape(U, b, s, h, d).permute(1, 0, 2, 3, 4).reshape(b, U * s, h, d)


def _rows_by_seq_piece(y, U):  # (b, U*s_l, h_u, d) -> (U, ...), row j = sequence piece j
    b, s, h, d = y.shape
    return y.reshape(b, U, s // U, h, d).permute(1, 0, 2, 3, 4).reshape(U, -1)


def _heads_from_rows(rows, b, s, h, d, U):  # rows j = head group j of my piece -> (b, s, U*h, d)
    return rows.reshape(U, b, s, h, d).permute(1, 2, 0, 3, 4).reshape(b, s, U * h, d)


def _all_to_all(rows: torch.Tensor, group, timeout: datetime.timedelta, on_fail) -> torch.Tensor:
    out = torch.empty_like(rows)
    work = dist.all_to_all_single(out, rows.contiguous(), group=group, async_op=True)
    try:
        work.wait(timeout)
    except Exception as exc:
        raise on_fail(exc) from exc
    return out


def _exchange(tensors, group, U, timeout, on_fail, to_heads: bool):
    """All-to-all of several (b, s, H, d) tensors in one message."""
    pack = _rows_by_head_group if to_heads else _rows_by_seq_piece
    rows = [pack(t, U) for t in tensors]
    sizes = [r.shape[1] for r in rows]
    got = _all_to_all(torch.cat(rows, dim=1), group, timeout, on_fail).split(sizes, dim=1)
    out = []
    for t, r in zip(tensors, got):
        b, s, h, d = t.shape
        out.append(_seq_from_rows(r, b, s, h // U, d, U) if to_heads else _heads_from_rows(r, b, s // U, h, d, U))
    return out


class _AllToAll(torch.autograd.Function):
    """``exchange(tensors, *args, to_heads=...)`` forward; the inverse exchange backward."""

    @staticmethod
    def forward(ctx, exchange, args, to_heads, *tensors):
        ctx.exchange, ctx.args, ctx.to_heads = exchange, args, to_heads
        return tuple(exchange(tensors, *args, to_heads=to_heads))

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.exchange([g.contiguous() for g in grads], *ctx.args, to_heads=not ctx.to_heads)
        return (None, None, None, *back)


# -- packed (t, H, d) tensors: the U pieces of a group may differ in length ------------------------
def _exchange_packed(tensors, group, U, timeout, on_fail, pieces: list[int], me: int, to_heads: bool):
    """One all-to-all of several packed tensors. to_heads: my piece (n_me, H, d) -> the group's
    rows (sum(pieces), H/U, d); else the inverse."""
    sends, recv_sizes, shapes = [], [0] * U, []
    for t in tensors:
        h, d = t.shape[1], t.shape[2]
        if to_heads:  # peer j gets my rows x its head group
            sends.append(t.reshape(t.shape[0], U, h // U * d).transpose(0, 1).reshape(U, -1))
            shapes.append((h // U, d))
        else:  # peer j gets its piece's rows x my heads
            sends.append([p.reshape(-1) for p in t.split(pieces, dim=0)])
            shapes.append((h, d))
    if to_heads:
        send_sizes = [sum(s.shape[1] for s in sends)] * U
        flat = torch.cat([torch.cat([s[j] for s in sends]) for j in range(U)])
        for j in range(U):
            recv_sizes[j] = pieces[j] * sum(hh * dd for hh, dd in shapes)
    else:
        send_sizes = [sum(s[j].numel() for s in sends) for j in range(U)]
        flat = torch.cat([torch.cat([s[j] for s in sends]) for j in range(U)])
        recv_sizes = [pieces[me] * sum(hh * dd for hh, dd in shapes)] * U
    out = flat.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=group, async_op=True)
    try:
        work.wait(timeout)
    except Exception as exc:
        raise on_fail(exc) from exc
    per_peer = out.split(recv_sizes)
    results = []
    offsets = [0] * U
    for hh, dd in shapes:
        parts = []
        for j in range(U):
            n = (pieces[j] if to_heads else pieces[me]) * hh * dd
            parts.append(per_peer[j][offsets[j]:offsets[j] + n])
            offsets[j] += n
        if to_heads:  # rows of peer j's piece, my heads
            results.append(torch.cat([p.view(-1, hh, dd) for p in parts], dim=0))
        else:  # my rows, head group j from peer j
            rows = pieces[me]
            results.append(torch.stack([p.view(rows, hh, dd) for p in parts], 1).reshape(rows, U * hh, dd))
    return results


def seq_to_heads_packed(tensors, group, degree, timeout, on_fail, pieces: list[int], me: int):
    """Packed ``(n_me, H, d)`` each -> ``(sum(pieces), H/U, d)`` (uneven pieces allowed)."""
    return _AllToAll.apply(_exchange_packed, (group, degree, timeout, on_fail, pieces, me), True, *tensors)


def heads_to_seq_packed(x, group, degree, timeout, on_fail, pieces: list[int], me: int):
    return _AllToAll.apply(_exchange_packed, (group, degree, timeout, on_fail, pieces, me), False, x)[0]


def lse_heads_to_seq_packed(lse, group, degree, timeout, on_fail, pieces: list[int], me: int):
    """``(h/U, n_group)`` -> ``(h, n_me)`` (no gradient)."""
    y = lse.t().unsqueeze(-1).contiguous()
    return _exchange_packed([y], group, degree, timeout, on_fail, pieces, me, to_heads=False)[0].squeeze(-1).t()


def seq_to_heads(tensors, group, degree: int, timeout: datetime.timedelta, on_fail):
    """``(b, s/U, H, d)`` each -> ``(b, s, H/U, d)``: one all-to-all for all of them (same dtype)."""
    return _AllToAll.apply(_exchange, (group, degree, timeout, on_fail), True, *tensors)


def heads_to_seq(x: torch.Tensor, group, degree: int, timeout: datetime.timedelta, on_fail) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads` for one tensor (the output), differentiable."""
    return _AllToAll.apply(_exchange, (group, degree, timeout, on_fail), False, x)[0]


def lse_heads_to_seq(lse: torch.Tensor, group, degree: int, timeout: datetime.timedelta, on_fail) -> torch.Tensor:
    """``(b, h/U, s)`` float32 -> ``(b, h, s/U)`` (no gradient)."""
    y = lse.transpose(1, 2).unsqueeze(-1)  # (b, s, h/U, 1)
    return _exchange([y.contiguous()], group, degree, timeout, on_fail, to_heads=False)[0].squeeze(-1).transpose(1, 2)
