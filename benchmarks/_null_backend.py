"""A block backend whose kernels do nothing, for timing the executor's own host work
(``executor_floor.py``): every method of :class:`~ringfa4.kernels.spec.BlockBackend` and of its
accumulating backward answers as FA4 on sm90 does (fp32 block outputs, the merge in the kernel, an
AccumBackward with a layout of its own, so the ring takes FA4's paths: the epilogue merge, the
in-place head-group backward), and returns its buffers untouched. Outputs are meaningless; never a
backend for results.

Its kernels go through :func:`ringfa4.kernels.tape.launch` (a no-op, one entry of a launch tape each,
as FA4's launches are), and the forward zeroes the outputs it is given (so the ring's results are
fixed values and a tape of it passes its check): ``executor_floor.py``'s taped rows replay what an
FA4 ring's tape replays, less the kernels' own launch cost."""

from __future__ import annotations

import torch

from ringfa4.kernels.spec import AttnSpec, group_stride, write_each_group
from ringfa4.kernels.tape import launch

__all__ = ["NullBackend"]


class NullBackend:
    """Kernels that return at once (a :class:`~ringfa4.kernels.spec.BlockBackend`)."""

    name = "null"
    tile = 128

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        if out is None:
            out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        if lse is None:
            lse = q.new_empty((q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1]),
                              dtype=torch.float32)
        launch(_null_forward, q, k, v, out, lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, spec: AttnSpec):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def backward_accumulate(self, dout, q, k, v, out, lse, spec: AttnSpec, grads) -> bool:
        return True

    def fp32_block_outputs(self, device: torch.device) -> bool:
        return True

    def begin_backward(self, dout, q, out, lse, spec: AttnSpec):
        return _NullAccum(q, dout) if q.dim() == 4 else None

    def can_forward_merge(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        return q.dim() == 4

    def forward_merge(self, q, k, v, spec: AttnSpec, out_acc, planes):
        launch(_null_merge, q, k, v, out_acc, planes)
        return planes

    def merge_replay(self, q, k, v, spec: AttnSpec, out_acc, planes):
        return _null_merge_launch

    def launches_taped(self, device: torch.device) -> bool:
        """Its no-op kernels go through ``launch``."""
        return True


def _null_forward(q, k, v, out, lse) -> None:
    out.zero_()
    lse.zero_()


def _null_merge(q, k, v, out_acc, planes) -> None:
    pass


def _null_merge_launch(q, k, v, out_acc, planes) -> None:
    launch(_null_merge, q, k, v, out_acc, planes)


class _NullLayout:
    """dK / dV as a flat fp32 ``[dk | dv]`` of ``cap`` dense rows (a KVGradLayout of the state's own)."""

    align, dtype = 1, torch.float32

    def __init__(self, k: torch.Tensor, cap: int) -> None:
        self.shape = (k.shape[0], cap, k.shape[2], k.shape[3])
        self.half = self.shape[0] * cap * k.shape[2] * k.shape[3]
        self.numel = 2 * self.half
        self._cols: dict[tuple, tuple] = {}  # made once per buffer and rows, as FA4's TileKVLayout does

    def cols(self, buf: torch.Tensor, rows: int, k0: int, k1: int):
        key = (id(buf), buf.data_ptr(), buf.numel(), k0, k1)
        got = self._cols.get(key)
        if got is None:
            dk, dv = buf[: self.half].view(self.shape), buf[self.half:].view(self.shape)
            got = self._cols[key] = (dk[:, k0:k1], dv[:, k0:k1], buf)
        return got[:2]

    def write(self, buf: torch.Tensor, rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        dk.copy_(buf[: self.half].view(self.shape)[:, :rows])
        dv.copy_(buf[self.half:].view(self.shape)[:, :rows])

    def write_groups(self, bufs: list[torch.Tensor], rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """As FA4's tile layout: one pass a tensor for all groups where they are evenly spaced in one
        buffer (b = 1), else a write a group."""
        step = group_stride(bufs, self.numel) if self.shape[0] == 1 else None
        if step is None:
            write_each_group(self, bufs, rows, dk, dv)
            return
        G, (_, cap, h, d) = len(bufs), self.shape
        for i, out in enumerate((dk, dv)):
            acc = bufs[0].as_strided((G, cap, h, d), (step, h * d, d, 1), bufs[0].storage_offset() + i * self.half)
            out.view(out.shape[1], G, h, d).permute(1, 0, 2, 3).copy_(acc[:, :rows])


def _null_block(k, v, dk_acc, dv_acc) -> None:
    pass


def _null_replay(state, k, v, dk_acc, dv_acc) -> None:
    launch(_null_block, k, v, dk_acc, dv_acc)


class _NullAccum:
    """An AccumBackward whose blocks add nothing."""

    def __init__(self, q: torch.Tensor, dout: torch.Tensor) -> None:
        self.q, self.dout = q, dout

    def add_block(self, q0, q1, k, v, spec, dk_acc, dv_acc) -> None:
        launch(_null_block, k, v, dk_acc, dv_acc)

    def replay(self, q0, q1, k, v, spec, dk_acc, dv_acc):
        return _null_replay

    def replay_class(self) -> int:
        return 0

    def dq(self, dtype=None) -> torch.Tensor:
        return torch.zeros(self.q.shape, dtype=dtype or torch.float32)

    def heads(self, h0: int, h1: int) -> _NullAccum:
        return _NullAccum(self.q.narrow(2, h0, h1 - h0), self.dout.narrow(2, h0, h1 - h0))

    def kv_layout(self, k: torch.Tensor, cap: int) -> _NullLayout:
        return _NullLayout(k, cap)

    def travel(self) -> tuple[torch.Tensor, ...]:
        return self.q.contiguous(), self.dout.contiguous()

    def dq_zeros(self, h0: int, h1: int) -> torch.Tensor:
        return torch.zeros(self.q.shape[0], h1 - h0, self.q.shape[1] * self.q.shape[3])

    def dq_empty(self, h0: int, h1: int) -> torch.Tensor:
        return torch.empty(self.q.shape[0], h1 - h0, self.q.shape[1] * self.q.shape[3])

    def visiting(self, pieces, h0: int, h1: int, dq: torch.Tensor) -> _NullAccum:
        return self

    def dq_from(self, bufs, heads, dtype) -> torch.Tensor:
        return torch.zeros(self.q.shape, dtype=dtype)
