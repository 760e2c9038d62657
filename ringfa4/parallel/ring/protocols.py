"""The two strategies the one ring backward loop (:func:`~.backward.ring_backward`) runs through:
what travels (:class:`BackwardSide`) and, for the K/V side, where the block gradients go
(:class:`GradSink`). Every method is required; one implementation a file (``kv_side.py``,
``q_side.py``, ``block_sink.py``, ``accum_sink.py``), chosen once per backward by
:func:`~.backward.backward_side` and :func:`~.kv_side.grad_sink`."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["BackwardSide", "GradSink", "TravellingData"]


class TravellingData(Protocol):
    """The data a side moves each step: ``cur`` (per local rank, this step's), ``nxt`` (the next
    hop's receive buffers); ``send_recv`` the next hop's (send, recv) lists as the transport takes
    them (the same pieces on every rank); ``swap`` after the hop."""

    cur: list
    nxt: list

    def send_recv(self) -> tuple[list, list]: ...

    def swap(self) -> None: ...


class BackwardSide(Protocol):
    """What travels in a ring backward, with its fp32 gradient accumulators.

    groups: how many head groups the travelling accumulators move in; in_place: the kernels add
    into the travelling accumulator itself (else a step's blocks go to a scratch, folded in after
    the hop); step: the hop offset (1, or world - 1 for the q side); ring: the travelling data.
    """

    groups: int
    in_place: bool
    step: int
    ring: TravellingData

    def held(self, i: int, r: int, t: int) -> Any:
        """What local rank ``i`` (global ``r``) needs at step ``t`` of the data it holds."""

    def accumulators(self, i: int, zeroed: bool) -> list[torch.Tensor]:
        """Local rank ``i``'s travelling accumulators, one a group, zeroed (step 0's) or not (the
        receive buffers)."""

    def compute(self, g: int, i: int, r: int, t: int, held: Any, dst: torch.Tensor | None) -> Any:
        """Local rank ``i``'s blocks of step ``t`` for group ``g`` (into ``dst`` when in place);
        what :meth:`fold` adds after the hop."""

    def fold(self, i: int, mine: Any, buf: torch.Tensor, held: Any) -> None:
        """What :meth:`compute` returned, into the arrived accumulator ``buf``."""

    def local(self) -> Any:
        """The results that never travel (computed while the last hops run)."""

    def results(self, local: Any, accs: list[list[torch.Tensor]]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per local rank dq, dk, dv in the inputs' dtypes, once the accumulators are home."""


class GradSink(Protocol):
    """Where the K/V side's block gradients go (groups / in_place as in :class:`BackwardSide`)."""

    groups: int
    in_place: bool

    def accumulators(self, device: torch.device, zeroed: bool) -> list[torch.Tensor]:
        """One travelling dK/dV accumulator a group (:meth:`BackwardSide.accumulators`)."""

    def compute(self, g: int, i: int, blocks: tuple, k: torch.Tensor, v: torch.Tensor, rows: int,
                dst: torch.Tensor | None, travelled: bool) -> Any:
        """Local rank ``i``'s ``blocks`` against the held ``k, v`` (``rows`` of them); ``travelled``:
        they came by a hop, in the ring's own buffers (every step but the first)."""

    def fold(self, i: int, mine: Any, buf: torch.Tensor, rows: int) -> None: ...

    def dq(self) -> list[torch.Tensor]:
        """dq per local rank in q's dtype (needs no dK/dV hop)."""

    def dkv(self, bufs: list[list[torch.Tensor]], rows: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """dk, dv per local rank in the inputs' dtypes from the accumulators back home."""
