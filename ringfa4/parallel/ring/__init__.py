"""The ring: its schedule, the run state, and the one loop forward and backward (K/V or the q
side travelling, gradients into the backend's accumulators).

    run = RingRun(schedule, ranks, backend, spec, transport, options)
    outs, lses = ring_forward(run, qs, ks, vs)
    dqs, dks, dvs = ring_backward(run, douts, qs, ks, vs, outs, lses)
"""

from .backward import backward_side, hop_bytes, ring_backward
from .forward import ExactLse, ring_forward
from .graphs import RingGraphs
from .run import RingRun
from .schedule import RingSchedule, ring_schedule
from .tapes import RingTapes

__all__ = ["ExactLse", "RingGraphs", "RingRun", "RingSchedule", "RingTapes", "backward_side", "hop_bytes",
           "ring_backward", "ring_forward", "ring_schedule"]
