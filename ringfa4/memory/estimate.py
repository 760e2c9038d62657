"""Peak GPU memory of one checkpointed training step, from measurements on the H200.

A step's peak is the weights and trainable state, the checkpointed layer inputs on the GPU, and one
layer's working set in backward (its recomputed activations, their gradients, FA4's fp32 dq/dk/dv
accumulators; or, at short lengths, the loss chunk). In units of one hidden-size tensor of the
local sequence, ``u = n * H * bytes``:

    peak = state + (gpu + (group - 1) + [any input on host]) * u + max(FLOOR, SLOPE * u + INTERCEPT)

- ``gpu``: inputs the plan keeps on the GPU; ``group - 1``: inputs rebuilt at once inside a group;
  one more while a host input is copied back for its layer.
- ``SLOPE``/``INTERCEPT``: the line through the two 2-layer Llama-3.1-8B-shape steps at 512k and 1M
  tokens (defaults: lean RMSNorms, MLP norm folded into the tiles, bf16 LoRA factors; ``--memory-trace``
  of benchmarks/capacity.py): working sets 40.6 and 89.2 GiB, so 12.14 u - 7.95 GiB.
- ``FLOOR``: the 32-layer step at 32k (16.7 GiB besides weights and inputs): the loss chunk
  and the optimizer dominate there.
- Other settings add what they keep (``EXTRA_UNITS``): fp32 LoRA factors keep an fp32 copy of each
  adapted input (7 u, counted on the CPU); transformers' RMSNorm keeps an fp32 copy of its input
  (3 u, counted on the CPU) and makes fp32 temporaries over the whole sequence in backward (10 u,
  the allocator trace at 1M tokens before our norm ran on slices).

Validation (benchmarks/memory_formula.py): the 32-layer steps at 64k, 128k and 256k tokens, measured
with fp32 LoRA and transformers' norms, none of them used for the fit, are predicted within 3%.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
SLOPE, INTERCEPT_GIB, FLOOR_GIB = 12.14, -7.95, 16.7
EXTRA_UNITS = {"lora_fp32": 7.0, "plain_norms": 3.0 + 10.0}

__all__ = ["StepMemory", "step_peak_bytes"]


@dataclass(frozen=True)
class StepMemory:
    """What decides a step's peak. ``tokens``: local tokens n; ``hidden``: H; ``dtype_bytes``: 2 for
    bf16; ``state_bytes``: weights + trainable state; ``gpu``/``host``: checkpointed inputs the plan
    keeps there; ``group``: the plan's group size; ``lora_fp32``, ``plain_norms``: see the module doc;
    ``cached_attention_bytes``: kept attention outputs (out and lse of every layer), if cached."""

    tokens: int
    hidden: int
    dtype_bytes: int
    state_bytes: float
    gpu: int
    host: int = 0
    group: int = 1
    lora_fp32: bool = False
    plain_norms: bool = False
    cached_attention_bytes: float = 0.0


def step_peak_bytes(m: StepMemory) -> dict[str, float]:
    """Bytes: ``state``, ``inputs_gpu`` (held, rebuilding and fetched inputs), ``working_set``,
    ``cached_attention`` and ``total``; ``inputs_host`` is pinned host memory, not in the total."""
    u = m.tokens * m.hidden * m.dtype_bytes
    slope = SLOPE + sum(v for k, v in EXTRA_UNITS.items() if getattr(m, k))
    inputs_gpu = (m.gpu + m.group - 1 + (1 if m.host else 0)) * u
    working = max(FLOOR_GIB * GIB, slope * u + INTERCEPT_GIB * GIB)
    return {"state": float(m.state_bytes), "inputs_gpu": float(inputs_gpu), "working_set": working,
            "cached_attention": float(m.cached_attention_bytes), "inputs_host": float(m.host * u),
            "total": m.state_bytes + inputs_gpu + working + m.cached_attention_bytes}
