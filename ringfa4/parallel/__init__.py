"""Context-parallel algorithms: layouts, schedules, transports, the ring (``parallel.ring``),
Ulysses, the CP groups and the (U, R) planner."""

from .blocks import Block, band_block, coalesce
from .context import ContextParallel, Pack
from .groups import DistributedGroup, SimulatedGroup
from .layouts import ContiguousLayout, HybridLayout, Layout, ZigzagLayout, make_layout
from .planner import CPPlan, detect_nvlink_domain, plan_cp
from .ring import RingRun, RingSchedule, ring_backward, ring_forward
from .transport import LoopbackTransport, P2PTransport
from .ulysses import HeadSplit

__all__ = [
    "Block", "CPPlan", "ContextParallel", "ContiguousLayout", "DistributedGroup", "HeadSplit", "HybridLayout", "Layout",
    "LoopbackTransport", "P2PTransport", "Pack", "RingRun", "RingSchedule", "SimulatedGroup", "ZigzagLayout",
    "band_block", "coalesce", "detect_nvlink_domain", "make_layout", "plan_cp", "ring_backward", "ring_forward",
]
