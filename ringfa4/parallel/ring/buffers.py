"""The buffers a ring step reads and sends: K/V (and dK/dV) of every local rank, sized for the
largest rank (packed ranks hold different counts)."""

from __future__ import annotations

import math

import torch

from ..memo import ViewMemo
from .run import row_dim, with_rows

__all__ = ["KVBuffers", "KVRing", "own_kv", "travelling"]

class KVBuffers:
    """Flat buffers ``[k | v]`` sized for the largest rank (ranks may hold different counts: packed
    documents, uneven dense lengths); ``view(buf, rows)`` gives (k, v) of a rank with ``rows``
    tokens: the first ``rows`` along the token dim of the ``cap``-row tensors (a prefix of the flat
    memory for packed ``(t, h, d)``; strided for dense ``(b, s, h, d)`` with b > 1 when rows < cap);
    ``pieces(buf)`` the (k, v) of all ``cap`` rows (what travels). Both are made once per buffer
    and row count (a :class:`~ringfa4.parallel.memo.ViewMemo`: make a KVBuffers per call)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cap_rows: int, dtype: torch.dtype | None = None):
        self.cap = cap_rows
        self.k_shape, self.v_shape = with_rows(k, cap_rows), with_rows(v, cap_rows)
        self.k_cap = math.prod(self.k_shape)
        self.numel = self.k_cap + math.prod(self.v_shape)
        self.dtype = dtype or k.dtype
        self._views = ViewMemo()

    def empty(self, device) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=device)

    def zeros(self, device) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=device)

    def view(self, buf, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._views.get(buf if isinstance(buf, tuple) else (buf,), rows, self._rows, buf, rows)

    def _rows(self, buf, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = buf if isinstance(buf, tuple) else self.pieces(buf)
        return tuple(x if x.shape[row_dim(x)] == rows else x.narrow(row_dim(x), 0, rows) for x in (k, v))

    def filled(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        buf = self.empty(k.device)
        kb, vb = self.view(buf, k.shape[row_dim(k)])
        kb.copy_(k)
        vb.copy_(v)
        return buf

    def pieces(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._views.get((buf,), "pieces", self._split, buf)

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return buf[: self.k_cap].view(self.k_shape), buf[self.k_cap:].view(self.v_shape)


def travelling(run, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple[list, list]:
    """The travelling prefix of each local rank's K and V (views; all of them on the dense path)."""
    ranks, sched = run.ranks, run.schedule
    cut = lambda x, r: x if sched.travel_rows(r) == x.shape[row_dim(x)] else x.narrow(  # noqa: E731
        row_dim(x), 0, sched.travel_rows(r))
    return [cut(k, r) for k, r in zip(ks, ranks)], [cut(v, r) for v, r in zip(vs, ranks)]


def own_kv(run, bufs: KVBuffers, ring: KVRing, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> list[tuple]:
    """Per local rank the (k, v) its step 0 reads: the ring's current buffer where every row
    travels (the dense path: the inputs themselves, or their contiguous copy), else its own K/V
    whole (a balanced pack's whole documents are past the travelling prefix), made contiguous."""
    out = []
    for i, r in enumerate(run.ranks):
        if run.schedule.travel_rows(r) == run.schedule.rows(r):
            out.append(bufs.view(ring.cur[i], run.schedule.rows(r)))
        else:
            out.append((ks[i].contiguous(), vs[i].contiguous()))
    return out


class KVRing:
    """The K/V a rank holds while they travel: ``cur`` (this step's: the inputs as a ``(k, v)``
    pair, or a flat ``[k | v]`` buffer of ``cap`` rows), ``nxt`` (the next hop's flat receive
    buffer); ``swap`` after the hop. Where every rank holds ``cap`` rows and the inputs are
    contiguous, step 0 reads (and the first hop sends) the inputs themselves, with no copy into a
    buffer; a spare buffer takes their place after the first hop, so the inputs are never received
    into. The first hop moves (k, v) as two pieces, every later one the flat buffer as one
    (:meth:`send_recv`: by the hop count, the same on every rank): one transfer a hop."""

    def __init__(self, bufs: KVBuffers, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        direct = all(k.shape[row_dim(k)] == bufs.cap and k.is_contiguous() and v.is_contiguous()
                     for k, v in zip(ks, vs))
        self.bufs, self.hops = bufs, 0
        self.cur = [(k, v) if direct else bufs.filled(k, v) for k, v in zip(ks, vs)]
        self.nxt = [bufs.empty(k.device) for k in ks]
        self.spare = [bufs.empty(k.device) for k in ks] if direct else None

    def send_recv(self) -> tuple[list, list]:
        if self.hops == 0:
            pieces = lambda x: x if isinstance(x, tuple) else self.bufs.pieces(x)  # noqa: E731
            return [pieces(c) for c in self.cur], [self.bufs.pieces(n) for n in self.nxt]
        return self.cur, self.nxt

    def swap(self) -> None:
        old = self.cur if self.spare is None else self.spare
        self.cur, self.nxt, self.spare = self.nxt, old, None
        self.hops += 1
