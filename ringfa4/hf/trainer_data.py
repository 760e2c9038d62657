"""Batch preparation and run metrics for :mod:`ringfa4.hf.trainer` (no transformers import).

A batch from a Trainer's dataloader (``input_ids (b, S)``, optional ``labels (b, S)``,
``attention_mask (b, S)`` right padding, ``position_ids (b, S)`` restarting at 0 per document for
packed rows with b = 1, ``cu_seq_lens_q``) becomes a :class:`Prepared`: the rank's
:class:`~ringfa4.hf.CPBatch` plus the counts the loss and the logs need. Dense rows are padded to
the layout multiple here (pad tokens get mask 0, so no target); every problem is a message, not an
exception, so that :func:`agree` can raise the same ``ValueError`` on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel import ContextParallel
from .batch import IGNORE, CPBatch, shard_batch

__all__ = ["Prepared", "agree", "attention_length", "prepare_batch", "step_flops"]

PACK_KEYS = ("cu_seq_lens_q", "cu_seqlens")


@dataclass
class Prepared:
    """One micro-batch made ready for CP: ``shard`` (this rank's part), ``length`` (the unpadded
    sequence length S of the full batch), ``tokens`` (real tokens of the full batch),
    ``attn_tokens`` (sum over real tokens of the length of the document each attends within: the
    T of the attention FLOPs times the tokens) and ``packed`` (the row holds packed documents)."""

    shard: CPBatch
    length: int
    tokens: int
    attn_tokens: float
    packed: bool = False  # the row holds packed documents (cu_seqlens, or position_ids that restart)


def attention_length(position_ids: torch.Tensor) -> float:
    """Sum of len^2 over the documents of one packed row ``position_ids (S,)`` (restarts at 0)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    if starts[0] != 0:
        starts = [0] + starts
    return float(sum((b - a) ** 2 for a, b in zip(starts, starts[1:])))


def _cu_from_batch(batch: dict) -> torch.Tensor | None:
    for key in PACK_KEYS:
        cu = batch.get(key)
        if cu is not None:
            return cu.reshape(-1)
    return None


def _check(batch: dict) -> str | None:
    """The first problem of a batch (what to change), or None."""
    ids = batch.get("input_ids")
    if ids is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = None if ids is None else tuple(getattr(ids, "shape", ()))
        return f"the batch needs input_ids of shape (batch, seq), got {shape}: give the trainer a causal-LM dataset"
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            return (f"the batch has a {mask.dim()}-D attention_mask {tuple(mask.shape)}: ringfa4 builds causal and "
                    "document masks itself; give a 2-D right-padding mask (padding_side='right') or pack the "
                    "documents with position_ids (SFTConfig(padding_free=True) or DataCollatorWithFlattening)")
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            return ("the batch's attention_mask is not causal right padding (ones then zeros in every row): set "
                    "tokenizer.padding_side='right', or pack the documents with position_ids "
                    "(SFTConfig(padding_free=True) or DataCollatorWithFlattening)")
    pos = batch.get("position_ids")
    packed = _cu_from_batch(batch) is not None or (pos is not None and bool((pos[:, 1:] == 0).any()))
    if packed and ids.shape[0] != 1:
        return (f"a packed batch (position_ids restarting at 0) must be one row, got {ids.shape[0]} rows: set "
                "per_device_train_batch_size=1 / per_device_eval_batch_size=1, or use padding_free=True, which "
                "flattens a batch into one row")
    if not packed and pos is not None and not torch.equal(pos, torch.arange(pos.shape[1], device=pos.device)
                                                          .expand_as(pos)):
        return ("the position_ids of an unpacked batch must be 0..S-1 in every row (left padding is not supported): "
                "set tokenizer.padding_side='right'")
    if packed and mask is not None and not bool(mask.all()):
        return "a packed batch must not have padding in its attention_mask: drop attention_mask (padding_free=True)"
    return None


def _pad_dense(batch: dict, multiple: int, pad_id: int) -> dict:
    """Right-pad a dense batch to a multiple of ``multiple`` tokens; pads get attention_mask 0."""
    ids = batch["input_ids"]
    b, S = ids.shape
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    labels = batch.get("labels", ids)
    extra = -S % multiple
    if extra:
        ids = torch.cat([ids, ids.new_full((b, extra), pad_id)], 1)
        mask = torch.cat([mask, mask.new_zeros((b, extra))], 1)
        labels = torch.cat([labels, labels.new_full((b, extra), IGNORE)], 1)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def prepare_batch(batch: dict, cp: ContextParallel, pad_id: int = 0) -> tuple[Prepared | None, str | None]:
    """``(prepared, None)`` or ``(None, message)`` for one full micro-batch (see the module doc)."""
    problem = _check(batch)
    if problem is not None:
        return None, problem
    ids = batch["input_ids"]
    b, S = ids.shape
    cu = _cu_from_batch(batch)
    pos = batch.get("position_ids")
    try:
        if cu is not None or (pos is not None and bool((pos[:, 1:] == 0).any())):
            full = {"input_ids": ids, "labels": batch.get("labels", ids)}
            if cu is not None:
                full["cu_seqlens"] = cu.to(torch.int32)
            else:
                full["position_ids"] = pos
            shard = shard_batch(full, cp)
            if cu is not None:
                lengths = torch.diff(cu.long().cpu())
                attn = float((lengths * lengths).sum())
            else:
                attn = attention_length(pos[0].cpu())
            return Prepared(shard, S, S, attn, packed=True), None
        mask = batch.get("attention_mask")
        real = mask.sum(1).cpu() if mask is not None else torch.full((b,), S)
        padded = _pad_dense(batch, cp.layout.multiple, pad_id)
        shard = shard_batch(padded, cp)
        return Prepared(shard, S, int(real.sum()), float((real * real).sum())), None
    except ValueError as exc:
        return None, str(exc)


def agree(problems: list[str | None], counts: list[float], device: torch.device) -> list[float]:
    """Sum ``counts`` over all ranks (the default group) and raise, on every rank, the first rank's
    problem if any rank has one: ``ValueError("rank r: ...")``. One all-reduce when no rank fails."""
    mine = next((p for p in problems if p is not None), None)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if mine is not None:
            raise ValueError(f"ringfa4.hf trainer: {mine}")
        return counts
    stats = torch.tensor([*counts, float(mine is not None)], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    if stats[-1] > 0:
        everyone: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rank, message = next((r, m) for r, m in enumerate(everyone) if m is not None)
        raise ValueError(f"ringfa4.hf trainer, rank {rank}: {message}")
    return stats[:-1].tolist()


def step_flops(config, tokens: float, attention_tokens: float) -> float:
    """Training FLOPs of ``tokens`` tokens by torchtitan's convention for a decoder config: 6 N per
    token (N: non-embedding parameters) + 12 L H Q per (token, attended key), where
    ``attention_tokens`` = sum over tokens of the length T of the document each attends within
    (causal not discounted)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, layers = config.hidden_size, config.num_hidden_layers
    inter, heads = config.intermediate_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * inter
    return 6 * layers * per_layer * tokens + 12 * layers * heads * head_dim * attention_tokens
