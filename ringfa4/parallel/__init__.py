"""Context-parallel algorithms: layouts, schedules, transports and the ring executor."""

from .blocks import Block, band_block, coalesce
from .context import DEFAULT_TIMEOUT, ContextParallel
from .executor import RingRun, ring_backward, ring_forward
from .layouts import ContiguousLayout, Layout, ZigzagLayout, make_layout
from .ring import RingSchedule
from .transport import LoopbackTransport, P2PTransport

__all__ = [
    "DEFAULT_TIMEOUT", "Block", "ContextParallel", "ContiguousLayout", "Layout", "LoopbackTransport",
    "P2PTransport", "RingRun", "RingSchedule", "ZigzagLayout", "band_block", "coalesce", "make_layout",
    "ring_backward", "ring_forward",
]
