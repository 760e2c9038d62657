"""FlashAttention-4 backward accumulated in float32 across ring steps (one preprocess, one postprocess).

A ring backward runs FA4's backward once per (q-block, kv-block) pair with the same q, out, dout and
final lse. ``_flash_attn_bwd`` would run its preprocess (D = rowsum(dO * O), lse * log2(e), zeroing
the fp32 ``dq_accum``) and its postprocess (fp32 accumulators -> bf16) on every step, and hand back
bf16 block gradients. Here FA4's own compiled kernels are called directly:

* :func:`prepare` runs FA4's preprocess (``interface._bwd_preprocess``'s kernel) once over the whole local q;
  the state holds ``dq_accum (b, h, s_q_r * d_r)``, ``dpsum`` / ``lse_log2 (b, h, s_q_r)`` float32
  in FA4's layout (``s_q_r``: s_q rounded up to tile_m; ``d_r``: d rounded up to 32, 64 with
  dKV_swapAB). ``dq_accum`` is FA4-internal: per tile_m rows one tile of tile_m * d_r floats in the
  dQ MMA's register order, split per warp group.
* :func:`accumulate` runs FA4's main kernel (``FlashAttentionBackwardSm90`` / ``Sm100``) for one block:
  dQ is reduce-added (``cp.reduce.async.bulk .add.f32``) into the state's ``dq_accum`` rows of the
  block, dK / dV are reduce-added into fp32 ``(b, h_kv, s_k_r * d_r)`` buffers (FA4's GQA layout,
  tile_n rows per tile, register order), which are then gathered into the caller's fp32
  ``(b, s_k, h_kv, d)`` accumulators. MHA: FA4 selects the fp32 dK/dV path only through
  ``qhead_per_kvhead > 1`` (sm90, compile-time) or an attribute set from it in ``__call__`` (sm100);
  :mod:`.bwd_plan` builds the kernels that take that path for MHA too, and holds each
  generation's tiles, roundings and postprocess arguments (:class:`~.bwd_plan.BwdPlan`).
* :func:`finish` runs FA4's dQ postprocess once (bf16 / fp16 dq), or gathers fp32 dq.

The tile orders are read from FA4's postprocess itself: run once per layout on a tile whose
entries encode their own index (base-256 digits, exact in 16-bit floats), the postprocess tells
where each (row, column) lives. A block's q range is widened down to a tile_m boundary with the
extra rows (and rows past the block inside its last tile) given ``lse_log2 = +inf``: their P, and so
their dS, dQ, dK, dV contributions, are exactly 0, and bottom-right causal / window alignment is
unchanged. All blocks of a state share one tile configuration (on sm90 FA4's causal config), so
they agree on the dq_accum layout.

Supported: dense fp16 / bf16, ``d == d_v``, causal / windows / softcap, not deterministic; sm90:
d % 8 == 0 in [8, 256] where FA4's kernel and accumulator roundings of d agree; sm100: d % 8 == 0
up to 128 (2-CTA clusters from 128: kv accumulators and block starts in tile pairs). The sm100
kernels compile in CI but have not run on a Blackwell GPU: the ring uses them there only with
``RINGFA4_FP32_GRADS=1`` (see :func:`~ringfa4.parallel.executor.fp32_grads`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..spec import group_stride, write_each_group
from ..tape import launch
from .bwd_plan import BwdPlan, make_kernel, plan, postprocess, preprocess, supported
from .launch import PlanCache, aligned, plain, signature

__all__ = ["AccumKey", "BwdAccumState", "TileKVLayout", "accumulate", "accumulate_tiles", "add_kv_accum_",
           "can_implement", "finish", "prepare", "state_signature", "tile_plan"]

_DTYPES = (torch.float16, torch.bfloat16)
_BASE = 256  # digit base of the tile-order probe (0..255 are exact in fp16 and bf16)


@dataclass(frozen=True)
class AccumKey:
    """What one compiled main kernel is specialized on (also its cache key). Window sizes, the
    softmax scale and all sizes but head_dim are runtime arguments."""

    arch: int
    dtype: torch.dtype
    head_dim: int
    qhead_per_kvhead: int
    causal: bool
    local: bool
    has_window_left: bool
    has_window_right: bool
    softcap: float | None
    broadcast: tuple  # stride-0 dims of q, k, v, dout
    single_q_block: bool  # as FA4's key: guards TVM stride specialization of one-tile dims
    single_k_block: bool
    varlen: bool = False  # packed documents with cu_seqlens (kernels/fa4/varlen_bwd.py)


def _rup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def can_implement(arch: int, dtype: torch.dtype, head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether prepare / accumulate / finish run for this arch (FA4 number: 90, 100...) and shape."""
    return supported(arch, dtype, head_dim, head_dim if head_dim_v is None else head_dim_v)


@dataclass
class BwdAccumState:
    """One ring backward's FA4 state (see the module doc). ``q``, ``dout (b, s_q, h, d)`` in the
    input dtype; ``dq_accum (b, h, s_q_r * d_r)``, ``dpsum``, ``lse_log2 (b, h, s_q_r)`` float32."""

    arch: int
    q: torch.Tensor
    dout: torch.Tensor
    softmax_scale: float
    softcap: float | None
    dq_accum: torch.Tensor
    dpsum: torch.Tensor
    lse_log2: torch.Tensor
    scratch: dict = field(default_factory=dict)  # fp32 dK / dV accumulators by shape, reused

    @property
    def plan(self) -> BwdPlan:
        return plan(self.arch, self.q.shape[-1])

    @property
    def head_dim_rounded(self) -> int:
        return self.plan.head_dim_rounded

    def heads(self, h0: int, h1: int) -> BwdAccumState:
        """The state of q heads ``[h0, h1)`` alone: views of this one's tensors (dQ still adds into
        the shared ``dq_accum``), for blocks run on a slice of the heads (k / v of the matching kv
        heads)."""
        h = self.q.shape[2]
        if not 0 <= h0 < h1 <= h:
            raise ValueError(f"need 0 <= h0 < h1 <= {h}, got h0={h0}, h1={h1}")
        n = h1 - h0
        return BwdAccumState(self.arch, self.q.narrow(2, h0, n), self.dout.narrow(2, h0, n), self.softmax_scale,
                             self.softcap, self.dq_accum.narrow(1, h0, n), self.dpsum.narrow(1, h0, n),
                             self.lse_log2.narrow(1, h0, n))


def _arch() -> int:
    from flash_attn.cute import interface

    return interface._get_device_arch()


def _check(t: torch.Tensor, name: str, shape: tuple, dtypes: tuple, device) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or t.device != device:
        raise ValueError(f"{name} must be {tuple(shape)} of {dtypes} on {device}, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have last-dim stride 1, got strides {t.stride()}")


def prepare(q: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, *,
            softmax_scale: float, softcap: float = 0.0, deterministic: bool = False) -> BwdAccumState:
    """FA4's backward preprocess, once: ``q, out, dout (b, s_q, h, d)`` (out / dout of another float
    dtype are cast to q's), ``lse (b, h, s_q)`` float32 natural log (the final, merged one)."""
    if q.dtype not in _DTYPES or q.dim() != 4:
        raise ValueError(f"q must be (b, s, h, d) fp16/bf16, got {tuple(q.shape)} {q.dtype}")
    b, s_q, h, d = q.shape
    floats = (torch.float16, torch.bfloat16, torch.float32)
    _check(out, "out", q.shape, floats, q.device)
    _check(dout, "dout", q.shape, floats, q.device)
    _check(lse, "lse", (b, h, s_q), (torch.float32,), q.device)
    if deterministic:
        raise ValueError("fa4.bwd_accum has no deterministic mode (dq / dk / dv are atomically reduced)")
    arch = _arch()
    if not can_implement(arch, q.dtype, d):
        raise ValueError(f"fa4.bwd_accum cannot run sm{arch} {q.dtype} head_dim={d} (see can_implement)")
    from flash_attn.cute.cute_dsl_utils import maybe_contiguous
    from flash_attn.cute.testing import is_fake_mode

    q, out, dout, lse = (maybe_contiguous(t) for t in (q, out.to(q.dtype), dout.to(q.dtype), lse))
    p = plan(arch, d)
    d_r, s_r = p.head_dim_rounded, _rup(max(s_q, 1), p.tile_m)
    f32 = dict(dtype=torch.float32, device=q.device)
    state = BwdAccumState(arch, q, dout, float(softmax_scale), float(softcap) if softcap else None,
                          torch.empty(b, h, s_r * d_r, **f32), torch.empty(b, h, s_r, **f32),
                          torch.empty(b, h, s_r, **f32))
    if s_q and b:
        preprocess(p, out, dout, (state.dpsum, state.lse_log2, state.dq_accum), lse, fake_mode=is_fake_mode())
    return state


_CACHE: dict[AccumKey, Any] = {}


def _args(tensors: list, scale: float, wl, wr) -> list:
    """The main kernel's arguments after the kernel object, as _flash_attn_bwd passes them (dense:
    no varlen, semaphores, aux tensors, block sparsity or tile cumsum; the env stream implicit)."""
    from flash_attn.cute.utils import AuxData

    q, k, v, do, lse_log2, dpsum, dq_acc, dk_acc, dv_acc = tensors
    return [q, k, v, do, lse_log2, dpsum, dq_acc, dk_acc, dv_acc, scale, None, None, None, None, wl, wr,
            None, None, None, AuxData(None, None), None, None]


def _compile(key: AccumKey, tensors: list, scale: float, wl, wr) -> Any:
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = _args([to_cute_tensor(t) for t in tensors], scale, wl, wr)
    return cute.compile(make_kernel(plan(key.arch, key.head_dim), key), *args, stream, options="--enable-tvm-ffi")


def _scratch(state: BwdAccumState, shape: tuple, device, fake: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed fp32 dK / dV accumulators in FA4's layout, reused across steps of the same shape."""
    if shape not in state.scratch:
        state.scratch[shape] = tuple(torch.empty(shape, dtype=torch.float32, device=device) for _ in "kv")
    dk, dv = state.scratch[shape]
    return (dk, dv) if fake else (dk.zero_(), dv.zero_())


def _check_kv(state: BwdAccumState, k: torch.Tensor, v: torch.Tensor) -> None:
    b, _, h, d = state.q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or k.dtype != state.q.dtype \
            or v.dtype != state.q.dtype or k.shape[2] == 0 or h % k.shape[2] != 0:
        raise ValueError(f"need k = v (b={b}, s_k, h_kv | {h}, d={d}) {state.q.dtype}, got {tuple(k.shape)} "
                         f"{k.dtype}, {tuple(v.shape)} {v.dtype}")


def accumulate(state: BwdAccumState, k: torch.Tensor, v: torch.Tensor, dk_acc: torch.Tensor,
               dv_acc: torch.Tensor, *, q0: int = 0, q1: int | None = None, causal: bool = False,
               window: tuple[int | None, int | None] = (None, None)) -> AccumKey | None:
    """One block: the state's query rows ``[q0, q1)`` against ``k, v (b, s_k, h_kv, d)`` (views of
    the held kv rows) with FA-convention ``causal`` / ``window`` (bottom-right, None or -1 =
    unbounded). dQ adds into the state; dK / dV add into ``dk_acc, dv_acc (b, s_k, h_kv, d)``
    float32 (strided views allowed), through a zeroed FA4-layout scratch that is then gathered
    (:func:`accumulate_tiles` adds into FA4-layout accumulators directly, without those passes).
    Returns the kernel's cache key (None when nothing ran)."""
    _check_kv(state, k, v)
    for name, t in (("dk_acc", dk_acc), ("dv_acc", dv_acc)):
        _check(t, name, k.shape, (torch.float32,), state.q.device)
    b, s_k, h_kv = k.shape[:3]
    from flash_attn.cute.testing import is_fake_mode

    fake = is_fake_mode()
    dk_buf, dv_buf = _scratch(state, (b, h_kv, _rup(s_k, state.plan.kv_align) * state.head_dim_rounded),
                              state.q.device, fake)
    key = accumulate_tiles(state, k, v, dk_buf, dv_buf, q0=q0, q1=q1, causal=causal, window=window)
    if key is not None and not fake:
        add_kv_accum_(dk_acc, dk_buf, state, scale=state.softmax_scale)
        add_kv_accum_(dv_acc, dv_buf, state, scale=1.0)
    return key


def accumulate_tiles(state: BwdAccumState, k: torch.Tensor, v: torch.Tensor, dk_tiles: torch.Tensor,
                     dv_tiles: torch.Tensor, *, q0: int = 0, q1: int | None = None, causal: bool = False,
                     window: tuple[int | None, int | None] = (None, None)) -> AccumKey | None:
    """As :func:`accumulate`, with dK / dV reduce-added by the kernel straight into FA4-layout fp32
    accumulators ``dk_tiles, dv_tiles (b, h_kv, >= rup(s_k, tile_n) * d_r)`` (last-dim stride 1;
    tile j of kv rows at ``[j * tile_n * d_r, (j + 1) * tile_n * d_r)``; dK without the softmax
    scale, as FA4 keeps it): the kv rows of the block are tiles 0.. of these views, so a block
    that starts at kv row k0 of a larger accumulator passes its narrow at ``k0 * d_r`` with k0 a
    multiple of tile_n (:class:`TileKVLayout`). Rows past s_k in the last tile get exact zeros.

    A call whose signature (the state's tensors, k, v, the accumulators, the rows and mask) was
    checked before replays that call's prepared launch (:mod:`.launch`)."""
    key = _tiles_key(state, k, v, dk_tiles, dv_tiles, q0, q1, causal, window)
    plan = _PLANS.get(key)
    if plan is not None and aligned((k, v), 16):
        plan(state, k, v, dk_tiles, dv_tiles)
        return plan.key
    q_all = state.q
    b, s_q, h, d = q_all.shape
    q1 = s_q if q1 is None else q1
    if not 0 <= q0 <= q1 <= s_q:
        raise ValueError(f"need 0 <= q0 <= q1 <= {s_q}, got q0={q0}, q1={q1}")
    _check_kv(state, k, v)
    s_k, h_kv = k.shape[1], k.shape[2]
    p, d_r = state.plan, state.head_dim_rounded
    tm, tn, kv_r = p.tile_m, p.tile_n, p.kv_align
    for name, t in (("dk_tiles", dk_tiles), ("dv_tiles", dv_tiles)):
        if t.dim() != 3 or t.shape[:2] != (b, h_kv) or t.shape[2] < _rup(s_k, kv_r) * d_r or t.dtype != torch.float32 \
                or t.device != q_all.device or t.stride(-1) != 1:
            raise ValueError(f"{name} must be ({b}, {h_kv}, >= {_rup(s_k, kv_r) * d_r}) float32 on {q_all.device} "
                             f"with last-dim stride 1, got {tuple(t.shape)} {t.dtype} on {t.device}, "
                             f"strides {t.stride()}")
    wl, wr = (None if w == -1 else w for w in window)
    if any(w is not None and w < 0 for w in (wl, wr)):
        raise ValueError(f"window sizes must be >= 0, None or -1 (unbounded), got {window}")
    if q1 == q0 or s_k == 0 or b == 0:
        return None
    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import get_broadcast_dims, maybe_contiguous
    from flash_attn.cute.testing import is_fake_mode

    fake = is_fake_mode()
    given = (k, v)
    k, v = (maybe_contiguous(t) for t in (k, v))
    rows = _RowRange.of(state, q0, q1)
    q, do, lse_log2, dpsum, dq_acc = rows.views(state, fake)
    size = _rup(s_k, kv_r) * d_r
    tensors = [q, k, v, do, lse_log2, dpsum, dq_acc, dk_tiles.narrow(2, 0, size), dv_tiles.narrow(2, 0, size)]
    causal, local, wl, wr = interface._resolve_causal_local_window(causal, wl, wr)
    acc_key = AccumKey(arch=state.arch, dtype=q.dtype, head_dim=d, qhead_per_kvhead=h // h_kv, causal=causal,
                       local=local, has_window_left=wl is not None, has_window_right=wr is not None,
                       softcap=state.softcap, broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v, do)),
                       single_q_block=rows.n_r == tm, single_k_block=size == tn * d_r)
    if acc_key not in _CACHE:
        _CACHE[acc_key] = _compile(acc_key, tensors, state.softmax_scale, wl, wr)
    if fake:
        return acc_key
    plan = _TilePlan(_CACHE[acc_key], acc_key, rows, size, tuple(_args([None] * 9, state.softmax_scale, wl, wr)[9:]))
    plan(state, k, v, dk_tiles, dv_tiles)
    if all(a is b for a, b in zip(given, (k, v))):
        _PLANS.put(key, plan)
    return acc_key


_PLANS = PlanCache()  # accumulate_tiles' prepared launches by call signature


def _tiles_key(state: BwdAccumState, k, v, dk_tiles, dv_tiles, q0: int, q1: int | None, causal: bool,
               window: tuple) -> tuple:
    """accumulate_tiles' plan key: what its checks read of the call."""
    return _state_signature(state), signature(k, v, dk_tiles, dv_tiles), q0, q1, causal, tuple(window)


def tile_plan(state: BwdAccumState, k: torch.Tensor, v: torch.Tensor, dk_tiles: torch.Tensor,
              dv_tiles: torch.Tensor, *, q0: int = 0, q1: int | None = None, causal: bool = False,
              window: tuple[int | None, int | None] = (None, None)) -> _TilePlan | None:
    """The prepared launch a checked :func:`accumulate_tiles` call with these arguments left (it
    replays that call: ``plan(state, k, v, dk_tiles, dv_tiles)``, valid for any state whose
    :func:`state_signature` is this one's and tensors of these shapes, strides, dtypes and
    alignment), or None (no such call yet, or k / v not 16-byte aligned)."""
    plan = _PLANS.get(_tiles_key(state, k, v, dk_tiles, dv_tiles, q0, q1, causal, window))
    return plan if plan is not None and aligned((k, v), 16) else None


_STATE_SIGNATURES: dict[tuple, int] = {}  # interned: a plan key hashes one int for the state, not its tensors
_NEXT_SIGNATURE = itertools.count()  # never reused, also after a clear (a live state keeps its number)


def state_signature(state: BwdAccumState) -> int:
    """A small int, equal for states whose block calls one prepared launch replays (what the
    checks read of the state: arch, scale, softcap and its tensors' shapes, strides, dtypes)."""
    return _state_signature(state)


def _state_signature(state: BwdAccumState) -> int:
    """What a block call's checks read of ``state``, as a small int equal for equal signatures
    (computed once per state)."""
    sig = state.scratch.get("signature")
    if sig is None:
        full = (state.arch, state.softmax_scale, state.softcap, signature(
            state.q, state.dout, state.dq_accum, state.dpsum, state.lse_log2))
        if len(_STATE_SIGNATURES) >= _PLANS.limit:  # bounded like the plans (whose keys it numbers)
            _STATE_SIGNATURES.clear()
            _PLANS.clear()
        sig = state.scratch["signature"] = _intern(full)
    return sig


def _intern(full: tuple) -> int:
    got = _STATE_SIGNATURES.get(full)
    if got is None:
        got = _STATE_SIGNATURES[full] = next(_NEXT_SIGNATURE)
    return got


class _RowRange(NamedTuple):
    """A block's query rows ``[q0, q1)`` widened down to a tile: from ``lo``, ``n`` rows, ``n_r``
    rounded up to tile_m; ``padded``: rows outside ``[q0, q1)`` get ``lse_log2 = +inf``."""

    q0: int
    q1: int
    lo: int
    n: int
    n_r: int
    padded: bool

    @classmethod
    def of(cls, state: BwdAccumState, q0: int, q1: int) -> _RowRange:
        tm, s_q = state.plan.tile_m, state.q.shape[1]
        lo = q0 - q0 % tm
        n = q1 - lo
        n_r = _rup(n, tm)
        return cls(q0, q1, lo, n, n_r, not (lo == q0 and (q1 == s_q or n == n_r)))

    def views(self, state: BwdAccumState, fake: bool = False) -> tuple:
        """``(q, dout, lse_log2, dpsum, dq_accum)`` of these rows, made once per state (the ring's
        blocks of a backward share a few row ranges)."""
        key = ("rows", self)
        got = state.scratch.get(key)
        if got is None:
            lo, n, n_r, d_r = self.lo, self.n, self.n_r, state.head_dim_rounded
            b, h = state.q.shape[0], state.q.shape[2]
            if self.padded:
                lse_log2 = torch.full((b, h, n_r), float("inf"), dtype=torch.float32, device=state.q.device)
                if not fake:
                    lse_log2[:, :, self.q0 - lo:n] = state.lse_log2[:, :, self.q0:self.q1]
            else:
                lse_log2 = state.lse_log2.narrow(2, lo, n_r)  # narrow, not [], also works on fake CUDA tensors
            got = state.scratch[key] = (state.q.narrow(1, lo, n), state.dout.narrow(1, lo, n), lse_log2,
                                        state.dpsum.narrow(2, lo, n_r), state.dq_accum.narrow(2, lo * d_r, n_r * d_r))
        return got


class _TilePlan(NamedTuple):
    """accumulate_tiles' launch for one signature: the compiled kernel, its key, the rows, the
    accumulators' length and the arguments after the nine tensors."""

    fn: Any
    key: AccumKey
    rows: _RowRange
    size: int
    tail: tuple

    def __call__(self, state: BwdAccumState, k: torch.Tensor, v: torch.Tensor, dk_tiles: torch.Tensor,
                 dv_tiles: torch.Tensor) -> None:
        q, do, lse_log2, dpsum, dq_acc = self.rows.views(state)
        if dk_tiles.shape[2] != self.size:  # a block short of the accumulators' last rows
            dk_tiles, dv_tiles = dk_tiles.narrow(2, 0, self.size), dv_tiles.narrow(2, 0, self.size)
        launch(self.fn, plain(q), plain(k), plain(v), plain(do), lse_log2, dpsum, dq_acc, dk_tiles, dv_tiles,
               *self.tail)


class TileKVLayout:
    """dK / dV of ``cap`` kv rows ``(b, ·, h_kv, d)`` kept in FA4's tile layout across a ring: one
    flat float32 buffer ``[dk | dv]``, each ``(b, h_kv, rup(cap, tile_n) * d_r)``. Blocks add into
    it with :func:`accumulate_tiles` (no scratch, no gather); buffers of one layout add elementwise;
    :meth:`write` puts the finished sums into 16-bit dk / dv (FA4's postprocess), :meth:`dense`
    gathers them in fp32 (the fallback for a 16-bit buffer). The executor's KV-gradient layout
    protocol: ``numel``, ``align`` (every block's first kv row must be a multiple), ``cols``,
    ``dense``, ``write``."""

    dtype = torch.float32  # the travelling buffers' dtype

    def __init__(self, state: BwdAccumState, k: torch.Tensor, cap: int) -> None:
        self.state = state
        self.align = state.plan.kv_align
        self.b, self.h_kv = k.shape[0], k.shape[2]
        self.row_numel = state.head_dim_rounded
        self.length = _rup(max(cap, 1), self.align) * self.row_numel
        self.numel = 2 * self.b * self.h_kv * self.length
        self._cols: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (buffer, k0) -> views (keep buf alive)

    def _halves(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.numel // 2
        return tuple(buf.narrow(0, i * half, half).view(self.b, self.h_kv, self.length) for i in range(2))

    def cols(self, buf: torch.Tensor, rows: int, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulators of kv rows ``[k0, k1)`` (of ``rows`` held) for :func:`accumulate_tiles`:
        the whole tiles of those rows, ``rup(k1 - k0, align) * d_r`` wide from ``k0`` (views made once
        per buffer and row range: a ring's blocks reuse a few)."""
        if k0 % self.align or not 0 <= k0 <= k1 <= rows:
            raise ValueError(f"kv rows [{k0}, {k1}) of {rows}: k0 must be a multiple of {self.align}")
        key = (id(buf), buf.data_ptr(), buf.numel(), k0, k1)
        got = self._cols.get(key)
        if got is None:
            start, width = k0 * self.row_numel, _rup(k1 - k0, self.align) * self.row_numel
            got = self._cols[key] = tuple(t.narrow(2, start, width) for t in self._halves(buf))
        return got

    def write(self, buf: torch.Tensor, rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """The finished sums into ``dk, dv (b, rows, h_kv, d)`` (16-bit, strided views allowed): FA4's
        own dK / dV postprocess (one pass each: read fp32 tiles, scale, round, write) for an fp32
        buffer, else :meth:`dense` and a copy."""
        if buf.dtype == torch.float32 and dk.dtype in _DTYPES and dv.dtype == dk.dtype:
            acc_k, acc_v = self._halves(buf)
            _kv_postprocess(acc_k, dk, self.state, self.state.softmax_scale)
            _kv_postprocess(acc_v, dv, self.state, 1.0)
            return
        dk_f, dv_f = self.dense(buf, rows)
        dk.copy_(dk_f)
        dv.copy_(dv_f)

    def write_groups(self, bufs: list[torch.Tensor], rows: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """The finished sums of ``G = len(bufs)`` kv-head groups of this layout's width, in order, into
        ``dk, dv (1, rows, G * h_kv, d)`` (contiguous, 16-bit): FA4's dK and dV postprocess once each for
        all groups, the groups as the batch (``(G, h_kv, length)`` over the accumulators, ``(G, rows,
        h_kv, d)`` over dk / dv), where the buffers are evenly spaced in one fp32 allocation
        (:func:`~ringfa4.kernels.spec.group_stride`; a ring's accumulators are) and b = 1; else a write a
        group (:func:`~ringfa4.kernels.spec.write_each_group`)."""
        G, d = len(bufs), dk.shape[-1]
        step = group_stride(bufs, self.numel) if self.b == 1 and bufs[0].dtype == torch.float32 else None
        if (step is None or dk.dtype not in _DTYPES or dv.dtype != dk.dtype or dk.shape[2] != G * self.h_kv
                or not (dk.is_contiguous() and dv.is_contiguous())):
            write_each_group(self, bufs, rows, dk, dv)
            return
        first, half = bufs[0], self.numel // 2
        acc_k, acc_v = (first.as_strided((G, self.h_kv, self.length), (step, self.length, 1),
                                         first.storage_offset() + i * half) for i in range(2))
        out_k, out_v = (t.view(t.shape[1], G, self.h_kv, d).permute(1, 0, 2, 3) for t in (dk, dv))
        _kv_postprocess(acc_k, out_k, self.state, self.state.softmax_scale)
        _kv_postprocess(acc_v, out_v, self.state, 1.0)

    def dense(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``dk, dv (b, rows, h_kv, d)`` (dK scaled by the softmax scale, float32; dV in the buffer's dtype)."""
        dk, dv = self._halves(buf)  # dK unscaled (fp32 before scaling, also on a 16-bit wire: one rounding)
        return (_dense(dk, self.state, "dkv", rows).float() * self.state.softmax_scale,
                _dense(dv, self.state, "dkv", rows))


def _kv_postprocess(accum: torch.Tensor, out: torch.Tensor, state: BwdAccumState, scale: float) -> None:
    """``out (b, rows, h_kv, d)`` 16-bit <- ``scale *`` the FA4-layout fp32 accumulator ``(b, h_kv,
    >= rup(rows, tile_n) * d_r)``, through FA4's GQA dK / dV postprocess (as ``_flash_attn_bwd`` runs it)."""
    from flash_attn.cute.testing import is_fake_mode

    if out.numel() == 0:
        return
    postprocess(state.plan, "dkv", accum, out, scale, fake_mode=is_fake_mode())


@functools.cache
def _tile_order(arch: int, dtype: torch.dtype, head_dim: int, kind: str, device: torch.device) -> torch.Tensor:
    """``(tile * d,)`` int64: flat offset in an FA4 accumulator tile of each (row, column < d) of
    the tile (row-major), as FA4's own postprocess reads the tile ("dq": dQ, "dkv": GQA dK / dV)."""
    p = plan(arch, head_dim)
    tile = p.tile_m if kind == "dq" else p.tile_n
    size = tile * p.head_dim_rounded
    assert size <= _BASE * _BASE, size
    idx = torch.arange(size, device=device)
    probe = torch.stack([idx % _BASE, idx // _BASE]).to(torch.float32).unsqueeze(1)  # (2 "batches", 1 head, size)
    out = torch.empty(2, tile, 1, head_dim, dtype=dtype, device=device)
    postprocess(p, kind, probe, out, 1.0, fake_mode=False)
    order = (out[0, :, 0].long() + _BASE * out[1, :, 0].long()).flatten()
    if order.unique().numel() != order.numel():
        raise RuntimeError(f"FA4 postprocess probe gave no tile order for {kind} d={head_dim}")
    return order


def _dense(accum: torch.Tensor, state: BwdAccumState, kind: str, rows: int) -> torch.Tensor:
    """FA4-layout fp32 accumulator ``(b, heads, rows_r * d_r)`` -> ``(b, rows, heads, d)`` fp32 view."""
    d = state.q.shape[-1]
    order = _tile_order(state.arch, state.q.dtype, d, kind, accum.device)
    tile = order.numel() // d
    b, heads, _ = accum.shape
    tiles = accum.view(b, heads, -1, tile * state.head_dim_rounded)
    return tiles.index_select(-1, order).view(b, heads, -1, d)[:, :, :rows].permute(0, 2, 1, 3)


def add_kv_accum_(dst: torch.Tensor, accum: torch.Tensor, state: BwdAccumState, *, scale: float) -> torch.Tensor:
    """``dst (b, s_k, h_kv, d) float32 += scale * accum`` for an FA4 dK / dV accumulator
    ``(b, h_kv, s_k_r * d_r)`` (dK carries the softmax scale there, as in FA4's GQA path)."""
    return dst.add_(_dense(accum, state, "dkv", dst.shape[1]), alpha=scale)


def finish(state: BwdAccumState, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """dq ``(b, s_q, h, d)`` in ``dtype`` (q's by default: FA4's dQ postprocess; float32: the
    accumulator gathered and scaled, which rounds to the former). ``out``: optional destination."""
    from flash_attn.cute.testing import is_fake_mode

    q = state.q
    dtype = q.dtype if dtype is None else dtype
    if dtype not in (q.dtype, torch.float32):
        raise ValueError(f"dq dtype must be {q.dtype} or float32, got {dtype}")
    if out is not None:
        _check(out, "out", q.shape, (dtype,), q.device)
    if dtype == torch.float32:
        if is_fake_mode() or q.numel() == 0:
            return torch.zeros(q.shape, dtype=dtype, device=q.device) if out is None else out.zero_()
        dq = _dense(state.dq_accum, state, "dq", q.shape[1]) * state.softmax_scale
        return dq.contiguous() if out is None else out.copy_(dq)
    dq = torch.empty_like(q) if out is None else out
    if q.numel() == 0:
        return dq.zero_()
    postprocess(state.plan, "dq", state.dq_accum, dq, state.softmax_scale, fake_mode=is_fake_mode())
    return dq
