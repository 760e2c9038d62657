"""FlashAttention-4 block backend: flash-attn-4's CuTe DSL kernels (Hopper sm90, Blackwell sm100).

Shapes and dtypes (fp16 / bf16 only; FA4 has no fp32 or fp64 path, and its backward rejects fp32):
dense ``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)`` -> ``out (b, s_q, h, d)`` in q's dtype and
``lse (b, h, s_q)`` float32; varlen ``q (total_q, h, d)``, ``k, v (total_k, h_kv, d)`` with int32
``cu_seqlens`` -> ``out (total_q, h, d)``, ``lse (h, total_q)``. Rows that see no key get
``lse = -inf`` and ``out = 0``. Causal is bottom-right aligned; windows are runtime values.

flash_attn and cutlass are imported on first use, never when ``ringfa4`` is imported. The kernels
compile on their first call for each configuration (a few seconds each) and are cached per process.
Under ``torch._subclasses.fake_tensor.FakeTensorMode`` with ``FLASH_ATTENTION_ARCH``,
``CUTE_DSL_ARCH`` and ``FLASH_ATTENTION_NUM_SMS`` set, the same calls compile without a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..eager import eager_boundary
from ..sinks import apply_sinks_
from ..spec import AttnSpec, BackendUnsupported, check_grads, materialized
from ..tape import launch
from ..validate import known_empty_segment, validate_block, validate_varlen
from .launch import PlanCache, aligned, signature

__all__ = ["Fa4Backend", "Fa4Unsupported"]

_DTYPES = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Fa4Unsupported(BackendUnsupported):
    """A call that flash-attn-4 cannot run (dtype, device, head dim, output layout...)."""


@functools.cache
def _kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(_flash_attn_fwd, _flash_attn_bwd)`` from flash_attn.cute.interface (imported lazily)."""
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        raise ImportError(
            "the fa4 backend needs flash-attn-4 and nvidia-cutlass-dsl (pip install 'ringfa4[gpu]'); "
            f"importing flash_attn.cute failed: {exc}") from exc
    return interface._flash_attn_fwd, interface._flash_attn_bwd


def _check_inputs(q: torch.Tensor, spec: AttnSpec) -> None:
    if q.dtype not in _DTYPES:
        raise Fa4Unsupported(f"fa4 backend runs fp16/bf16 only (flash-attn-4 has no {q.dtype} "
                             "kernels); use the sdpa or reference backend, or cast the inputs")
    if q.device.type != "cuda":
        raise Fa4Unsupported(f"fa4 backend needs CUDA tensors, got device {q.device}")
    d = q.shape[-1]
    if d % 8 != 0 or not 8 <= d <= 256:
        raise Fa4Unsupported(f"fa4 backend needs head_dim a multiple of 8 in [8, 256] "
                             f"(sm100: <= 128 or 256), got {d}")
    if spec.varlen:
        for name, cu in (("cu_seqlens_q", spec.cu_seqlens_q), ("cu_seqlens_k", spec.cu_seqlens_k)):
            if cu.device != q.device:
                raise Fa4Unsupported(f"{name} must be on q's device {q.device}, got {cu.device}")


def _check_buffer(t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  q: torch.Tensor) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} on {q.device}, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise Fa4Unsupported(f"{name} must have last-dim stride 1, got strides {t.stride()}")


def _forward_fp32(q, k, v, spec: AttnSpec, out: torch.Tensor, lse: torch.Tensor | None, plans: PlanCache,
                  key: tuple | None):
    """Dense calls through :func:`ringfa4.kernels.fa4.fp32_forward.prepare_forward`, varlen calls
    through :func:`ringfa4.kernels.fa4.varlen_fwd.prepare_forward_varlen` (sm90; it raises
    NotImplementedError on sm100, where the caller widens FA4's own forward instead): the checked
    path, its plan kept in ``plans`` under ``key`` when given and replayable."""
    if spec.varlen:
        from .varlen_fwd import prepare_forward_varlen

        prepared = prepare_forward_varlen(q, k, v, spec, out=out, lse=lse)
    else:
        from .fp32_forward import prepare_forward

        prepared = prepare_forward(q, k, v, spec.replace(window=(spec.window_left, spec.window_right)), out, lse)
    prepared.run()
    if key is not None and prepared.replayable:
        plans.put(key, prepared.plan)
    return prepared.tensors[3], prepared.tensors[4]


def _common(q: torch.Tensor, spec: AttnSpec) -> dict[str, Any]:
    """Keyword arguments shared by FA4's forward and backward."""
    kw: dict[str, Any] = dict(
        softmax_scale=spec.scale(q.shape[-1]),
        causal=spec.causal,
        softcap=float(spec.softcap),  # fwd maps 0.0 to None; bwd needs a float
        window_size_left=spec.window_left,  # None = unbounded, passed through as None
        window_size_right=spec.window_right,  # 0 when causal
    )
    if spec.varlen:
        kw.update(cu_seqlens_q=spec.cu_seqlens_q.contiguous(), cu_seqlens_k=spec.cu_seqlens_k.contiguous(),
                  max_seqlen_q=int(spec.max_seqlen_q), max_seqlen_k=int(spec.max_seqlen_k))
    return kw


def _check_grad_inputs(q, v, spec: AttnSpec, out, dout, lse) -> None:
    """``out`` / ``dout`` like q's rows with v's head dim, ``lse (b, h, s_q)`` or varlen
    ``(h, total_q)``: float tensors on q's device, else a ValueError naming the tensor."""
    qs, os_, device = q.shape, out.shape, q.device
    lse_shape = (qs[1], qs[0]) if spec.varlen else (qs[0], qs[2], qs[1])
    if (os_ == dout.shape and os_[:-1] == qs[:-1] and os_[-1] == v.shape[-1] and lse.shape == lse_shape
            and out.dtype in _FLOATS and dout.dtype in _FLOATS and lse.dtype in _FLOATS
            and out.device == device and dout.device == device and lse.device == device):
        return  # the usual case in one expression; the loop below names what is wrong otherwise
    o_shape = tuple(qs[:-1]) + (v.shape[-1],)
    for name, t, shape in (("out", out, o_shape), ("dout", dout, o_shape), ("lse", lse, lse_shape)):
        if tuple(t.shape) != shape or t.dtype not in _FLOATS or t.device != q.device:
            raise ValueError(f"{name} must be a float {shape} tensor on {q.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")


class Fa4Backend:
    """Block attention through FA4's kernels: ``flash_attn.cute.interface._flash_attn_fwd`` /
    ``_flash_attn_bwd``, or, where this module prepares the launch itself, FA4's kernel classes from
    a plan per call signature (sm90: a forward without given outputs runs FA4's own class, dense or
    varlen, one with
    fp32 outputs the fp32-output / merging / varlen variants of :mod:`.fp32_forward`; a backward,
    dense or varlen, FA4's own kernels, :mod:`.plain_backward`).

    ``forward`` returns ``(out, lse)`` (writing into ``out=`` / ``lse=`` when given: views with
    last-dim stride 1, e.g. slices of a bigger buffer). ``backward`` returns fresh ``dq, dk, dv`` in
    q's dtype, computed from the given (globally merged) ``out`` and ``lse``.
    Raises :class:`Fa4Unsupported` (a NotImplementedError) for calls FA4 cannot run.

    What this backend offers a ring beyond FA4's own calls depends on the GPU generation, and on
    whether that path has run on such a GPU: ``RAN_ON`` lists the generations (FA4 arch // 10)
    where the fp32-output forward and the accumulating backward passed the GPU tests (sm90: the
    H200). On others (sm100: compiled in CI, never run) the ring rounds block outputs to q's dtype
    and uses the per-block backward, unless ``untested_archs=True`` (for experiments on new
    hardware: ``get_backend("fa4", untested_archs=True)``). Likewise ``PACKED_RAN_ON``: where the
    packed single call's prepared plans (:func:`.varlen_fwd.prepare_plain_varlen`, the packed
    :mod:`.plain_backward`) passed the GPU tests; elsewhere that call takes FA4's entry points
    unless ``untested_archs=True``.
    """

    name = "fa4"
    tile = 128  # FA4's kv / q tiles on sm90 and sm100
    RAN_ON = (9,)
    PACKED_RAN_ON: tuple[int, ...] = (9,)  # test_single_call_varlen_*: one H100, session 32
    TAPED_RAN_ON: tuple[int, ...] = (9,)  # test_tapes_gpu.py (a replay launches eager's kernels): H100, session 34

    def __init__(self, untested_archs: bool = False) -> None:
        self.untested_archs = untested_archs
        self._plans = PlanCache()  # prepared launches of checked calls (.launch): forward, forward_merge, backward

    def _ran_here(self) -> bool:
        from .bwd_accum import _arch

        return self.untested_archs or _arch() // 10 in self.RAN_ON

    def _packed_plans_here(self) -> bool:
        """Whether a packed single call may be prepared here (see the class doc, ``PACKED_RAN_ON``)."""
        from .bwd_accum import _arch

        return self.untested_archs or _arch() // 10 in self.PACKED_RAN_ON

    def launches_taped(self, device: torch.device) -> bool:
        """Whether launch tapes may record ring calls here: every launch of this backend goes
        through :func:`ringfa4.kernels.tape.launch`, and a replay was shown to issue eager's kernels
        on this GPU generation (``TAPED_RAN_ON``)."""
        from .bwd_accum import _arch

        return device.type == "cuda" and (self.untested_archs or _arch() // 10 in self.TAPED_RAN_ON)

    def fp32_block_outputs(self, device: torch.device) -> bool:
        """Whether ring blocks on ``device`` get fp32 outputs (our fp32-epilogue forward) where it
        has run on this GPU generation (see the class doc)."""
        return device.type == "cuda" and self._ran_here()

    @eager_boundary
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q (b, s_q, h, d)``, ``k, v (b, s_k, h_kv, d)`` fp16/bf16 (varlen: ``(total, h, d)``)
        -> ``out`` like q, ``lse (b, h, s_q)`` float32 (varlen ``(h, total_q)``)."""
        key = None
        single = out is None and lse is None and spec.sinks is None  # cp=None, Ulysses
        if single and spec.varlen:  # the cu_seqlens are launch arguments: their values change per pack
            cu = (spec.cu_seqlens_q, spec.cu_seqlens_k)
            key = ("plain_varlen", spec, signature(q, k, v, *cu))
            plan = self._plans.get(key)
            if plan is not None and aligned((q, k, v), 16):
                validate_varlen(spec, q.shape[0], k.shape[0])  # values read once per tensor version
                return plan.launch_new(q, k, v, cu)
        elif single:
            key = ("plain", spec, signature(q, k, v))
            plan = self._plans.get(key)
            if plan is not None and aligned((q, k, v), 16):
                return plan.launch_new(q, k, v)
        if out is not None and lse is not None and spec.sinks is None:
            if spec.varlen:  # the cu_seqlens are launch arguments: their values change per pack
                cu = (spec.cu_seqlens_q, spec.cu_seqlens_k)
                key = ("varlen", spec, signature(q, k, v, out, lse, *cu))
            else:
                key = ("forward", spec, signature(q, k, v, out, lse))
            plan = self._plans.get(key)
            if plan is not None and aligned((q, k, v, out), 16) and aligned((lse,), 4):
                if spec.varlen:  # the values: read once per tensor version (ringfa4's own are trusted)
                    validate_varlen(spec, q.shape[0], k.shape[0])
                    plan(q, k, v, out, lse, cu)
                else:
                    plan(q, k, v, out, lse)
                return out, lse
        validate_block(q, k, v, spec)
        _check_inputs(q, spec)
        if single:
            got = self._forward_plain(q, k, v, spec, key)
            if got is not None:
                return got
        lead = tuple(q.shape[:-2])
        h = q.shape[-2]
        fp32_out = out is not None and out.dtype == torch.float32 and q.dtype != torch.float32
        if out is not None:
            _check_buffer(out, "out", lead + (h, v.shape[-1]), torch.float32 if fp32_out else q.dtype, q)
        if lse is not None:
            lse_shape = (h, lead[0]) if spec.varlen else (lead[0], h, lead[1])
            _check_buffer(lse, "lse", lse_shape, torch.float32, q)
        if fp32_out and spec.sinks is not None:  # the sink after the fp32 kernel, before any rounding
            o, l = self.forward(q, k, v, spec.replace(sinks=None), out=out, lse=lse)
            apply_sinks_(o, l, spec.sinks)
            return o, l
        if fp32_out:  # a float32 block output (no rounding before the merge): our fp32-epilogue kernel
            try:
                return _forward_fp32(q, k, v, spec, out, lse, self._plans, key)
            except AssertionError as exc:
                raise Fa4Unsupported(f"flash-attn-4 fp32-output forward refused this call: {exc}") from exc
            except (ValueError, TypeError, NotImplementedError):
                pass  # a call the fp32-output kernel does not cover (d != d_v, an arch...): FA4's own, widened
        fwd, _ = _kernels()
        try:
            sink = {} if spec.sinks is None else {"learnable_sink": spec.sinks.detach().contiguous()}
            res = launch(fwd, q, k, v, **_common(q, spec), return_lse=True, out=None if fp32_out else out, lse=lse,
                         **sink)
        except AssertionError as exc:
            raise Fa4Unsupported(f"flash-attn-4 forward refused this call: {exc}") from exc
        if fp32_out:
            out.copy_(res[0])
            return out, res[1]
        return res[0], res[1]

    def _forward_plain(self, q, k, v, spec: AttnSpec, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A checked call without given outputs on sm90: FA4's own forward kernel prepared
        (:func:`.fp32_forward.prepare_plain`, varlen :func:`.varlen_fwd.prepare_plain_varlen`), run,
        its plan kept under ``key``; None, nothing run,
        elsewhere or where it does not apply (head dims it lacks): the caller then runs FA4's entry point."""
        from .bwd_accum import _arch

        if _arch() // 10 != 9:
            return None
        from .fp32_forward import prepare_plain
        from .varlen_fwd import prepare_plain_varlen

        if spec.varlen and not self._packed_plans_here():
            return None
        try:
            if spec.varlen:
                prepared = prepare_plain_varlen(q, k, v, spec)
            else:
                prepared = prepare_plain(q, k, v, spec.replace(window=(spec.window_left, spec.window_right)))
        except AssertionError as exc:
            raise Fa4Unsupported(f"flash-attn-4 forward refused this call: {exc}") from exc
        except (ValueError, TypeError, NotImplementedError):  # raised before anything ran
            return None
        prepared.run()
        if prepared.replayable:
            self._plans.put(key, prepared.plan)
        return prepared.tensors[3], prepared.tensors[4]

    @eager_boundary
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients ``dq (like q), dk, dv (like k, v)`` in q's dtype of one block, given the merged
        ``out`` / ``dout`` (like q; fp32 ones are cast to q's dtype, which FA4 requires) and ``lse``
        (float32, ``(b, h, s_q)`` or varlen ``(h, total_q)``). sm90 calls, dense or packed
        (deterministic ones too), run FA4's own backward from a plan per call signature
        (:mod:`.plain_backward`), others FA4's entry point."""
        key = None
        if spec.sinks is None and spec.varlen:  # calls a plan may serve (:mod:`.plain_backward`)
            cu = (spec.cu_seqlens_q, spec.cu_seqlens_k)
            key = ("backward_varlen", spec, signature(q, k, v, out, dout, lse, *cu))
            plan = self._plans.get(key)
            if plan is not None and aligned((q, k, v, out, dout), 16):
                validate_varlen(spec, q.shape[0], k.shape[0])  # values read once per tensor version
                return plan.launch_varlen(q, k, v, out, dout, lse, cu)
        elif spec.sinks is None:
            key = ("backward", spec, signature(q, k, v, out, dout, lse))
            plan = self._plans.get(key)
            if plan is not None and aligned((q, k, v, out, dout), 16):
                return plan.launch_new(q, k, v, out, dout, lse)
        validate_block(q, k, v, spec)
        _check_inputs(q, spec)
        _check_grad_inputs(q, v, spec, out, dout, lse)
        given = (out, dout, lse)
        out, dout = (t if t.dtype == q.dtype else t.to(q.dtype) for t in (out, dout))
        lse = lse if lse.dtype == torch.float32 else lse.to(torch.float32)
        if key is not None:
            got = self._backward_plain(q, k, v, (out, dout, lse), spec,
                                       key if all(a is b for a, b in zip(given, (out, dout, lse))) else None)
            if got is not None:
                return got
        _, bwd = _kernels()
        try:
            grads = launch(bwd, q, k, v, out, dout, lse, **_common(q, spec), deterministic=spec.deterministic)
        except AssertionError as exc:
            raise Fa4Unsupported(f"flash-attn-4 backward refused this call: {exc}") from exc
        return grads[0], grads[1], grads[2]

    def _backward_plain(self, q, k, v, merged: tuple, spec: AttnSpec, key: tuple | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A checked backward of ``merged = (out, dout, lse)`` in q's dtype / float32 on sm90: FA4's
        own backward prepared (:func:`.plain_backward.prepare_backward`), run, its plan kept under
        ``key`` (None: the inputs were cast, so a later call of that signature is not this one); None,
        nothing run, where it does not apply (last-dim stride not 1, head dims...): the caller then
        runs FA4's entry point."""
        from .bwd_accum import _arch

        if _arch() // 10 != 9:
            return None
        from .plain_backward import prepare_backward

        if spec.varlen and not self._packed_plans_here():
            return None
        out, dout, lse = merged
        try:
            prepared = prepare_backward(q, k, v, out, dout, lse, spec)
        except AssertionError as exc:
            raise Fa4Unsupported(f"flash-attn-4 backward refused this call: {exc}") from exc
        except (ValueError, TypeError, NotImplementedError):  # raised before anything ran
            return None
        if prepared.plan is None:  # fake tensors: compiled, nothing to launch
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if spec.varlen:
            cu = (spec.cu_seqlens_q, spec.cu_seqlens_k)
            if not all(t.is_contiguous() for t in cu):  # FA4's entry point would copy them
                return None
            if key is not None:
                self._plans.put(key, prepared.plan)
            return prepared.plan.launch_varlen(q, k, v, out, dout, lse, cu)
        if key is not None:
            self._plans.put(key, prepared.plan)
        return prepared.plan.launch_new(q, k, v, out, dout, lse)

    @eager_boundary
    def backward_accumulate(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, spec: AttnSpec,
                            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
        """:meth:`backward`'s block gradients added into ``grads = (dq_acc, dk_acc, dv_acc)`` float32
        (like q / k / v; views with last-dim stride 1; any may be a :class:`~ringfa4.kernels.spec.Written`: varlen
        blocks then write their rows in the unpad pass), never rounded to bf16 before the sum: varlen blocks through
        :mod:`.varlen_bwd` (FA4's varlen backward into padded fp32 accumulators, gathered once),
        dense blocks through :mod:`.bwd_accum` (one preprocess, the main kernel, dq gathered in
        fp32). ``out`` / ``dout`` may be fp32 (cast to q's dtype for FA4's preprocess, as in
        :meth:`backward`); ``lse`` any layout of the right shape. Returns False, touching nothing,
        where it cannot: off sm90 (sm100 has not run these: see the class doc), deterministic
        specs, dtypes / head dims it lacks, a cu_seqlens_q known (without a sync) to hold an empty
        segment (FA4's varlen backward crashes on one)."""
        validate_block(q, k, v, spec)
        _check_grad_inputs(q, v, spec, out, dout, lse)
        dq_acc, dk_acc, dv_acc = check_grads(grads, q, k, v)
        if spec.deterministic or q.device.type != "cuda" or q.dtype not in _DTYPES or not self._ran_here():
            return False
        try:
            _check_inputs(q, spec)
        except Fa4Unsupported:
            return False
        from .bwd_accum import _arch

        arch, d = _arch(), q.shape[-1]
        if spec.varlen:
            from . import varlen_bwd

            if not varlen_bwd.can_implement(arch, q.dtype, d, v.shape[-1]) or known_empty_segment(spec.cu_seqlens_q):
                return False
            try:
                varlen_bwd.accumulate_varlen(dout, q, k, v, out, lse, spec, (dq_acc, dk_acc, dv_acc))
            except (ValueError, AssertionError):  # raised before anything was added
                return False
            return True
        from . import bwd_accum as acc

        if arch // 10 != 9 or not acc.can_implement(arch, q.dtype, d, v.shape[-1]):
            return False
        try:
            state = acc.prepare(q, out, dout, lse.float(), softmax_scale=spec.scale(d), softcap=float(spec.softcap))
        except (ValueError, AssertionError):
            return False
        (dq_acc, dq_w), (dk_acc, dk_w), (dv_acc, dv_w) = (materialized(g) for g in (dq_acc, dk_acc, dv_acc))
        acc.accumulate(state, k, v, dk_acc, dv_acc, causal=spec.causal, window=(spec.window_left, spec.window_right))
        dq_acc.add_(acc.finish(state, torch.float32))
        for written, got in ((dq_w, dq_acc), (dk_w, dk_acc), (dv_w, dv_acc)):
            if written is not None:
                written.put_(got)
        return True

    def can_forward_merge(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether :meth:`forward_merge` runs for dense blocks of these inputs (sm90, 16-bit,
        d == d_v): elsewhere (sm100) the ring merges with a kernel after each fp32 block."""
        from . import epilogue_merge
        from .bwd_accum import _arch

        return q.dim() == 4 and q.device.type == "cuda" and q.dtype in _DTYPES and v.shape[-1] == q.shape[-1] \
            and epilogue_merge.can_implement(_arch())

    @eager_boundary
    def forward_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                      out_acc: torch.Tensor, planes: torch.Tensor) -> torch.Tensor | None:
        """One ring block merged inside FA4's epilogue (:mod:`.epilogue_merge`, sm90): ``out_acc (b, s_q,
        h, d)`` float32 and the running ``planes (b, h, 2, s_q)`` (M, S) updated in place;
        returns ``planes``, or None, touching nothing, where it cannot run (varlen,
        not sm90, d != d_v, head dims FA4 lacks): the caller then runs forward and a merge."""
        key = ("merge", spec, signature(q, k, v, out_acc, planes))
        plan = self._plans.get(key)
        if plan is not None and aligned((q, k, v, out_acc), 16) and aligned((planes,), 4):
            plan(q, k, v, out_acc, planes.select(2, 0))
            return planes
        from . import epilogue_merge
        from .bwd_accum import _arch

        if spec.varlen or spec.sinks is not None or q.dim() != 4 or q.device.type != "cuda" or q.dtype not in _DTYPES \
                or v.shape[-1] != q.shape[-1] or not epilogue_merge.can_implement(_arch()):
            return None
        validate_block(q, k, v, spec)
        try:
            _check_inputs(q, spec)
        except Fa4Unsupported:  # forward raises it then, through the caller's fallback
            return None
        _check_buffer(out_acc, "out_acc", tuple(q.shape), torch.float32, q)
        epilogue_merge.check_planes(planes, q)
        try:
            prepared = epilogue_merge.prepare_merge(q, k, v, out_acc, planes,
                                                    spec.replace(window=(spec.window_left, spec.window_right)))
        except (ValueError, TypeError, NotImplementedError):  # head dims etc.: raised before anything ran
            return None
        prepared.run()
        if prepared.replayable:
            self._plans.put(key, prepared.plan)
        return planes

    def merge_replay(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                     out_acc: torch.Tensor, planes: torch.Tensor) -> _MergeReplay | None:
        """After a :meth:`forward_merge` of these arguments that ran: its prepared launch (the plan
        a later call of the same signature and alignment replays), or None (none was kept)."""
        plan = self._plans.get(("merge", spec, signature(q, k, v, out_acc, planes)))
        if plan is None or not (aligned((q, k, v, out_acc), 16) and aligned((planes,), 4)):
            return None
        return _MergeReplay(plan)

    def begin_backward(self, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       spec: AttnSpec) -> _Fa4Accum | None:
        """FA4's backward with fp32 dq / dk / dv across a ring (``fa4.bwd_accum``: one preprocess,
        dq reduce-added into one fp32 accumulator, one postprocess); None where it cannot run
        (not sm90 / sm100, varlen, deterministic, head dims it does not cover)."""
        from . import bwd_accum as acc

        if spec.varlen or q.dim() != 4 or spec.deterministic or q.device.type != "cuda" or q.dtype not in _DTYPES:
            return None
        if not self._ran_here() or not acc.can_implement(acc._arch(), q.dtype, q.shape[-1], out.shape[-1]):
            return None
        try:
            state = acc.prepare(q, out, dout, lse.float(), softmax_scale=spec.scale(q.shape[-1]),
                                softcap=float(spec.softcap))
        except (ValueError, AssertionError):  # inputs it does not take: the per-block path runs instead
            return None
        return _Fa4Accum(state)


class _MergeReplay:
    """A ring block's prepared merging forward (``fp32_forward.ForwardPlan``) as a replay:
    ``(q, k, v, out_acc, planes)``, no checks (the caller keeps the signature)."""

    __slots__ = ("plan",)

    def __init__(self, plan) -> None:
        self.plan = plan

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_acc: torch.Tensor,
                 planes: torch.Tensor) -> None:
        self.plan(q, k, v, out_acc, planes.select(2, 0))


class _TileReplay:
    """A ring block's prepared accumulating launch (``bwd_accum._TilePlan``) as an AccumBackward
    replay: ``(state, k, v, dk_acc, dv_acc)``, no checks (the caller keeps the signature)."""

    __slots__ = ("plan",)

    def __init__(self, plan) -> None:
        self.plan = plan

    def __call__(self, state: _Fa4Accum, k: torch.Tensor, v: torch.Tensor, dk_acc: torch.Tensor,
                 dv_acc: torch.Tensor) -> None:
        self.plan(state.state, k, v, dk_acc, dv_acc)


class _Fa4Accum:
    """AccumBackward over :mod:`.bwd_accum` (see there)."""

    def __init__(self, state) -> None:
        self.state = state

    def add_block(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                  dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> None:
        from . import bwd_accum as acc

        add = acc.accumulate_tiles if dk_acc.dim() == 3 else acc.accumulate  # FA4-layout (kv_layout) or dense
        add(self.state, k, v, dk_acc, dv_acc, q0=q0, q1=q1, causal=spec.causal,
            window=(spec.window_left, spec.window_right))

    def replay(self, q0: int, q1: int, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, dk_acc: torch.Tensor,
               dv_acc: torch.Tensor) -> _TileReplay | None:
        """After an :meth:`add_block` with these arguments into FA4-layout accumulators: its prepared
        launch (:func:`bwd_accum.tile_plan`), to repeat on states of this :meth:`replay_class`; None
        for dense accumulators (their add goes through a scratch) or where nothing was prepared."""
        from . import bwd_accum as acc

        if dk_acc.dim() != 3:
            return None
        plan = acc.tile_plan(self.state, k, v, dk_acc, dv_acc, q0=q0, q1=q1, causal=spec.causal,
                             window=(spec.window_left, spec.window_right))
        return None if plan is None else _TileReplay(plan)

    def replay_class(self) -> int:
        """Equal for states whose blocks one :meth:`replay` runs (FA4's state signature)."""
        from . import bwd_accum as acc

        return acc.state_signature(self.state)

    def kv_layout(self, k: torch.Tensor, cap: int):
        """dK / dV kept in FA4's tile layout across the ring (:class:`bwd_accum.TileKVLayout`):
        each block's kernel reduce-adds into the travelling accumulator; at the end FA4's
        postprocess writes them out (``write``)."""
        from . import bwd_accum as acc

        return acc.TileKVLayout(self.state, k, cap)

    def heads(self, h0: int, h1: int) -> _Fa4Accum:
        """The state of q heads ``[h0, h1)``: blocks on those heads (and their kv heads) add dQ into
        this state's accumulator and dK / dV into their own buffers (the ring's head groups)."""
        return _Fa4Accum(self.state.heads(h0, h1))

    def dq(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The accumulated dq: float32 by default, or straight to ``dtype`` (q's: FA4's dQ
        postprocess, one pass)."""
        from . import bwd_accum as acc

        return acc.finish(self.state, torch.float32 if dtype is None else dtype)

    # the q side's travel (parallel/ring/q_side.py QSide): FA4's q-side tensors and dq accumulators
    # of head groups (its dq_accum layout) that travel with them

    def travel(self) -> tuple[torch.Tensor, ...]:
        """``(q, dout, dpsum, lse_log2)`` of the state (contiguous): what another rank's blocks need."""
        st = self.state
        return st.q, st.dout, st.dpsum, st.lse_log2

    def dq_zeros(self, h0: int, h1: int) -> torch.Tensor:
        """A zeroed fp32 dq accumulator of q heads ``[h0, h1)`` in FA4's layout ``(b, n, s_r * d_r)``."""
        b, _, length = self.state.dq_accum.shape
        return torch.zeros(b, h1 - h0, length, dtype=torch.float32, device=self.state.q.device)

    def dq_empty(self, h0: int, h1: int) -> torch.Tensor:
        b, _, length = self.state.dq_accum.shape
        return torch.empty(b, h1 - h0, length, dtype=torch.float32, device=self.state.q.device)

    def _group(self, pieces, h0: int, h1: int, dq: torch.Tensor) -> _Fa4Accum:
        from . import bwd_accum as acc

        st, n = self.state, h1 - h0
        q, dout, dpsum, lse_log2 = pieces
        return _Fa4Accum(acc.BwdAccumState(st.arch, q.narrow(2, h0, n), dout.narrow(2, h0, n), st.softmax_scale,
                                           st.softcap, dq, dpsum.narrow(1, h0, n), lse_log2.narrow(1, h0, n)))

    def visiting(self, pieces: tuple[torch.Tensor, ...], h0: int, h1: int, dq: torch.Tensor) -> _Fa4Accum:
        """The state of q heads ``[h0, h1)`` of another rank's q side ``pieces`` (its :meth:`travel`),
        reduce-adding dQ into ``dq`` (that group's accumulator)."""
        return self._group(pieces, h0, h1, dq)

    def dq_from(self, bufs: list[torch.Tensor], heads: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        """dq of this state's q in ``dtype`` from the head groups' accumulators (back home): FA4's dQ
        postprocess once per group, into that group's heads."""
        from . import bwd_accum as acc

        dq = torch.empty(self.state.q.shape, dtype=dtype, device=self.state.q.device)
        for buf, (h0, h1) in zip(bufs, heads, strict=True):
            acc.finish(self._group(self.travel(), h0, h1, buf).state, dtype, out=dq.narrow(2, h0, h1 - h0))
        return dq
