"""The kernel calls of one block: the executors (the ring loop, the all-gather mode) make them;
the block (:class:`~ringfa4.parallel.blocks.Block` dense, :class:`~ringfa4.parallel.varlen.VarlenCall`
packed) only says which rows, through its geometry: ``q_rows`` / ``k_rows`` / ``lse_rows``
(views, or gathered copies where ``q_is_view`` is False), ``put_*`` / ``add_*`` (back into the
full tensors) and ``spec(base, device)``.

Dense tensors: q ``(b, s, h, d)``, lse ``(b, h, s)``, planes ``(b, h, 2, s)``; packed: q
``(t, h, d)``, lse ``(h, t)``.
"""

from __future__ import annotations

import torch

from ...kernels.merge import merge_lse_, merge_planes_
from ...kernels.spec import AttnSpec, BlockBackend, Written

__all__ = ["accumulate", "accumulate_replay", "add_lse", "backward", "backward_fp32", "forward", "forward_merge",
           "join_rows", "kv_heads", "kv_rows", "merge", "merge_planes", "merge_replay", "merge_rows"]


def forward(backend: BlockBackend, blk, q, k, v, base: AttnSpec, scratch_o: torch.Tensor, scratch_l: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (out, lse), written into its rows of the scratch where those are views."""
    spec = blk.spec(base, q.device)
    qb, kb, vb = blk.q_rows(q), blk.k_rows(k), blk.k_rows(v)
    if blk.q_is_view:
        return backend.forward(qb, kb, vb, spec, out=blk.q_rows(scratch_o), lse=blk.lse_rows(scratch_l))
    n = qb.shape[blk.token_dim]  # gathered rows: fresh buffers of the scratch's dtypes (fp32 partials stay fp32)
    o = torch.empty(qb.shape[:-1] + (vb.shape[-1],), dtype=scratch_o.dtype, device=qb.device)
    l = torch.empty(tuple(scratch_l.shape[:-1]) + (n,), dtype=scratch_l.dtype, device=qb.device)
    return backend.forward(qb, kb, vb, spec, out=o, lse=l)


def merge_rows(blk, q: torch.Tensor, out_acc: torch.Tensor, planes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Dense: the block's rows of ``q``, of the fp32 accumulator ``out_acc`` and of the lse
    ``planes`` (views; the same for every block of a rank with these query rows)."""
    return blk.q_rows(q), blk.q_rows(out_acc), blk.lse_rows(planes)


def kv_heads(k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense: kv heads ``[a, b)`` of ``k, v (b, s, h_kv, d)`` (views; the tensors themselves for all heads)."""
    if a == 0 and b == k.shape[2]:
        return k, v
    return k.narrow(2, a, b - a), v.narrow(2, a, b - a)


def kv_rows(blk, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense: the block's key rows of ``k`` and ``v`` (views; the same for every block with these kv rows)."""
    return blk.k_rows(k), blk.k_rows(v)


def forward_merge(backend: BlockBackend, blk, rows: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, torch.Tensor],
                  base: AttnSpec):
    """Dense: the block merged into its rows of the accumulator and the lse planes inside the
    backend's kernel (``rows``: :func:`merge_rows`; ``kv``: :func:`kv_rows`); the planes, or None
    where the backend cannot."""
    q, out_acc, planes = rows
    return backend.forward_merge(q, *kv, blk.spec(base, q.device), out_acc, planes)


def merge_replay(backend: BlockBackend, blk, rows: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, torch.Tensor],
                 base: AttnSpec):
    """After :func:`forward_merge` with these arguments ran: the backend's replay of it
    (``fn(q, k, v, out_acc, planes)``), or None."""
    q, out_acc, planes = rows
    return backend.merge_replay(q, *kv, blk.spec(base, q.device), out_acc, planes)


def merge(blk, out_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, l: torch.Tensor, impl: str) -> None:
    """The block's (o, l) merged into its rows of the fp32 accumulator (``impl``: the merge kernel)."""
    acc_o, acc_l = blk.q_rows(out_acc), blk.lse_rows(lse_acc)
    merge_lse_(acc_o, acc_l, o, l, impl=impl)
    if not blk.q_is_view:
        blk.put_q(out_acc, acc_o)
        blk.put_lse(lse_acc, acc_l)


def merge_planes(blk, out_acc: torch.Tensor, planes: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Dense: the block's result merged into its rows of ``out_acc`` and the running (M, S) planes."""
    merge_planes_(blk.q_rows(out_acc), blk.lse_rows(planes), o, l)


def add_lse(blk, lse_exact: torch.Tensor, l: torch.Tensor) -> None:
    """``lse_exact`` (float64) rows of this block ``<- logaddexp(them, l)``."""
    rows = blk.lse_rows(lse_exact)
    torch.logaddexp(rows, l, out=rows)
    if not blk.q_is_view:
        blk.put_lse(lse_exact, rows)


def backward(backend: BlockBackend, blk, tensors: tuple[torch.Tensor, ...], base: AttnSpec):
    """The block's (dq, dk, dv) from ``tensors`` = (dout, q, k, v, out, lse) of the rank, with the
    global merged out / lse."""
    dout, q, k, v, out, lse = tensors
    l = blk.lse_rows(lse)
    if blk.token_dim == 0:
        l = l.contiguous()  # varlen lse (h, t): FA4 takes it contiguous
    return backend.backward(blk.q_rows(dout), blk.q_rows(q), blk.k_rows(k), blk.k_rows(v), blk.q_rows(out), l,
                            blk.spec(base, q.device))


def backward_fp32(backend: BlockBackend, blk, tensors: tuple[torch.Tensor, ...], base: AttnSpec,
                  dq_acc, dkv_acc: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block's gradients kept in fp32 (the backend's ``backward_accumulate``): dq added into
    the rank's fp32 ``dq_acc`` (its rows; gathered and put back where they are not a view); dk / dv
    added straight into ``dkv_acc = (dk_acc, dv_acc)`` (fp32, the held K/V's rows; the block's
    key rows must be a view) where given (then ``()`` is returned), else returned as fresh fp32
    tensors of the block's kv rows (the caller adds them: :meth:`add_k`); None, touching nothing,
    where the backend cannot (the caller then uses :func:`backward`). Any of ``dq_acc`` and
    ``dkv_acc`` may be a :class:`~ringfa4.kernels.spec.Written` of the whole tensor: the block's
    rows are then written (the block is their only contribution). ``tensors`` as for
    :func:`backward`."""
    dout, q, k, v, out, lse = tensors
    l = blk.lse_rows(lse)
    if blk.token_dim == 0:
        l = l.contiguous()
    kb, vb = blk.k_rows(k), blk.k_rows(v)
    dq_dst = dq_acc.out if isinstance(dq_acc, Written) else dq_acc
    if blk.q_is_view:
        dq = _rows_of(dq_acc, blk.q_rows)
    else:
        dq = torch.zeros(blk.q_rows(q).shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                         device=q.device)
    direct = dkv_acc is not None
    if direct:
        if not blk.k_is_view:
            raise ValueError("backward_fp32: gradients straight into dkv_acc need the block's key rows as a view")
        dk, dv = _rows_of(dkv_acc[0], blk.k_rows), _rows_of(dkv_acc[1], blk.k_rows)
    else:
        dk = torch.zeros(kb.shape, dtype=dq.dtype, device=kb.device)
        dv = torch.zeros(vb.shape, dtype=dq.dtype, device=vb.device)
    if not backend.backward_accumulate(blk.q_rows(dout), blk.q_rows(q), kb, vb, blk.q_rows(out), l,
                                       blk.spec(base, q.device), (dq, dk, dv)):
        return None
    if not blk.q_is_view:
        (blk.put_q if isinstance(dq_acc, Written) else blk.add_q)(dq_dst, dq)
    return () if direct else (dk, dv)


def _rows_of(acc, rows):
    """``rows(acc)``, a :class:`~ringfa4.kernels.spec.Written` kept written."""
    return Written(rows(acc.out)) if isinstance(acc, Written) else rows(acc)


def join_rows(head: torch.Tensor, tail: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cat([head, tail])`` along the packed token dim in ``dtype``: a rank's travelling rows
    (fp32 accumulated) followed by the rows one call wrote in full (:func:`~.run.direct_home`);
    ``tail`` itself where ``head`` has no rows."""
    if head.shape[0] == 0:
        return tail if tail.dtype == dtype else tail.to(dtype)
    out = torch.empty((head.shape[0] + tail.shape[0],) + tuple(tail.shape[1:]), dtype=dtype, device=tail.device)
    out[: head.shape[0]].copy_(head)
    out[head.shape[0]:].copy_(tail)
    return out


def accumulate(state, blk, kv: tuple[torch.Tensor, torch.Tensor], base: AttnSpec, dk_acc: torch.Tensor,
               dv_acc: torch.Tensor) -> None:
    """Dense: the block's gradients through an AccumBackward ``state``: dq into the state, dk / dv
    into ``dk_acc, dv_acc`` (the accumulators of this block's kv columns: the grad layout's
    ``cols``); ``kv``: the block's key rows (:func:`kv_rows`)."""
    k, v = kv
    state.add_block(blk.q0, blk.q1, k, v, blk.spec(base, k.device), dk_acc, dv_acc)


def accumulate_replay(state, blk, kv: tuple[torch.Tensor, torch.Tensor], base: AttnSpec, dk_acc: torch.Tensor,
                      dv_acc: torch.Tensor):
    """After :func:`accumulate` with these arguments: the state's replay of that block
    (``fn(state, k, v, dk_acc, dv_acc)``, see AccumBackward), or None."""
    k, v = kv
    return state.replay(blk.q0, blk.q1, k, v, blk.spec(base, k.device), dk_acc, dv_acc)
