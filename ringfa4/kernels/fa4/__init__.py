"""ringfa4's FlashAttention-4 extensions, one file each, imported on first use (never when
``ringfa4`` is imported):

- :mod:`.backend`: ``Fa4Backend``, the block backend over FA4's entry points and the kernels below;
- :mod:`.fp32_forward`: FA4's forward with a float32 output (sm90 subclass, sm100 single split);
- :mod:`.epilogue_merge`: that forward merging into a ring's fp32 accumulator in its epilogue (sm90);
- :mod:`.bwd_accum`: FA4's backward into fp32 accumulators across ring steps, with
  :mod:`.bwd_plan` holding each generation's tiles, kernels and postprocess (sm90, sm100).

Imports go one way: backend -> the kernels; epilogue_merge -> fp32_forward; bwd_accum -> bwd_plan.
"""
