"""Context-parallel algorithms: layouts, schedules, transports, the ring executor, Ulysses and the
(U, R) planner."""

from .blocks import Block, band_block, coalesce
from .context import DEFAULT_TIMEOUT, ContextParallel
from .executor import RingRun, ring_backward, ring_forward
from .layouts import ContiguousLayout, HybridLayout, Layout, ZigzagLayout, make_layout
from .planner import CPPlan, detect_nvlink_domain, plan_cp
from .ring import RingSchedule
from .transport import LoopbackTransport, P2PTransport
from .ulysses import HeadSplit

__all__ = [
    "DEFAULT_TIMEOUT", "Block", "CPPlan", "ContextParallel", "ContiguousLayout", "HeadSplit", "HybridLayout", "Layout",
    "LoopbackTransport", "P2PTransport", "RingRun", "RingSchedule", "ZigzagLayout", "band_block", "coalesce",
    "detect_nvlink_domain", "make_layout", "plan_cp", "ring_backward", "ring_forward",
]
