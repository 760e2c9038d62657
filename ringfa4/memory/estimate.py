"""Peak GPU memory of one checkpointed training step, from measurements on the H200.

A step's peak is the weights and trainable state, the checkpointed layer inputs on the GPU, and one
layer's working set in backward (its recomputed activations, their gradients, FA4's fp32 dq/dk/dv
accumulators; or, at short lengths, the loss chunk). In units of one hidden-size tensor of the
local sequence, ``u = n * H * bytes``:

    peak = state + (gpu + (group - 1) + [any input on host]) * u + max(FLOOR, SLOPE * u + INTERCEPT)

- ``gpu``: inputs the plan keeps on the GPU; ``group - 1``: inputs rebuilt at once inside a group;
  one more while a host input is copied back for its layer.
- ``SLOPE``/``INTERCEPT``/``EXTRA_UNITS``: least squares (benchmarks/memory_formula.py) on the working
  sets (measured peak less state, GPU inputs and cached attention) of the measured Llama-3.1-8B-shape
  steps on the line: with the current defaults (lean RMSNorms, MLP norm folded into the tiles, bf16
  LoRA factors) 2 layers at 512k and 1M tokens and 32 layers at 256k; with the old settings (fp32
  LoRA, transformers' norms) 32 layers at 128k (with and without cached attention) and 256k.
  Model: ``SLOPE * u + INTERCEPT + old * OLD_EXTRA * u``, giving 11.38 u - 2.62 GiB. Working sets
  within 0.5 GiB of the floor are not fitted, nor is a step the fitted line puts under the floor
  (the 32-layer 64k step, 1.1 GiB above it): the formula predicts the floor there.
- ``FLOOR``: the 32-layer steps at 32k (16.4-16.8 GiB besides weights and inputs): the loss chunk
  and the optimizer dominate there; they are not in the fit.
- Other settings add what they keep (``EXTRA_UNITS``). All old-settings steps had fp32 LoRA factors
  and transformers' RMSNorm together, so only their sum is measured: 16.51 u. It is split between
  ``lora_fp32`` and ``plain_norms`` in the 7:13 ratio of the earlier counts (fp32 LoRA keeps an fp32
  copy of each adapted input, 7 u on the CPU; transformers' norm an fp32 copy of its input, 3 u on the
  CPU, plus fp32 temporaries over the whole sequence in backward, 10 u in the allocator trace); the
  split itself is not measured.

Errors (benchmarks/results/memory_formula_h200.json; peak, predicted against measured): in-sample
-2.3% to +0.7% for every 32-layer step, -0.7% for the 2-layer 1M step and +4.4% for the 2-layer 512k
step (its working set, 40.6 GiB, is under the line). Leave-one-out (refit without the step): every
32-layer step within 3.9%; the 2-layer 512k and 1M steps +6.4% and -5.3%: they are the only points at
u = 4 and 8 GiB and carry the extrapolation to full-size steps, which is therefore the least checked part.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
SLOPE, INTERCEPT_GIB, FLOOR_GIB = 11.38, -2.62, 16.7
# fp32 LoRA + transformers' norms: 16.51 u, measured only together; split 7:13 (see the module doc)
EXTRA_UNITS = {"lora_fp32": 5.78, "plain_norms": 10.73}

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
