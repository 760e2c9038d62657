"""Shard a causal-LM batch for CP and compute a loss whose gradients, summed over dp x cp, equal the
single-process gradients.

- labels are shifted on the *full* sequence first (target of token t is token t+1; -100 at every
  document end, at the sequence end, and at padding), then sharded with the same layout as the
  inputs; position_ids are the global values of the local tokens (per-document for packed rows);
- the loss is the sum of local token losses divided by the *global* count of valid targets, so
  gradients must be SUM-reduced across dp x cp (FSDP2: force sum reduction, see hf-facts; DDP:
  divide by nothing, i.e. use a comm hook that sums, or scale the loss by world size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel import ContextParallel
from ..parallel.packing import cu_seqlens_from_position_ids
from .attention import NAME, CPMeta

__all__ = ["CPBatch", "causal_lm_loss", "global_mean_loss", "shard_batch"]

IGNORE = -100


@dataclass
class CPBatch:
    """This rank's part of a batch: model inputs, shifted labels, and the global target count."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    num_targets: int
    meta: CPMeta

    def model_inputs(self) -> dict:
        """Keyword arguments for ``model(**...)`` (CP metadata included; no cache)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, NAME: self.meta, "use_cache": False}


def _shift(labels: torch.Tensor, doc_starts: torch.Tensor | None) -> torch.Tensor:
    """Targets of each token: the next token's label, -100 at the end of each row/document."""
    out = torch.full_like(labels, IGNORE)
    out[:, :-1] = labels[:, 1:]
    if doc_starts is not None:  # the token before a document start ends the previous document
        ends = doc_starts[doc_starts > 0] - 1
        out[:, ends] = IGNORE
    return out


def shard_batch(batch: dict, cp: ContextParallel, shift_labels: bool = True, key_padding: bool = False) -> CPBatch:
    """From a full batch (``input_ids (b, S)``, optional ``labels``, ``position_ids`` (restarting at
    0 per document for packed rows, which need b = 1), ``attention_mask`` (right padding only),
    ``cu_seqlens``) to this rank's :class:`CPBatch`.

    ``shift_labels``: targets are the next token's label (causal LM, the default); False: the labels
    as they are (masked LM: -100 except at the masked tokens). ``key_padding``: padding must be
    masked as *keys* too (bidirectional layers, where real tokens would otherwise see it): every
    row's real tokens and its padding become documents of one packed row (``input_ids (1, b*S)``
    sharded), so attention never crosses into the padding; the loss is unchanged (padding has no
    targets). Causal models need no key padding with right padding (no real token sees a later one)."""
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(ids.shape)}")
    b, S = ids.shape
    labels = batch.get("labels", ids)
    mask = batch.get("attention_mask")
    pos = batch.get("position_ids")
    cu = batch.get("cu_seqlens")
    if mask is not None:
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("attention_mask must be right padding (ones then zeros) for CP")
        labels = labels.masked_fill(mask == 0, IGNORE)
        if key_padding and bool((mask == 0).any()):
            if cu is not None or (pos is not None and bool((pos[:, 1:] == 0).any())):
                raise ValueError("key_padding: give either padding (attention_mask) or packed documents, not both")
            real = mask.sum(1).tolist()
            docs = [n for r in real for n in (r, S - r)]
            ids, labels = ids.reshape(1, b * S), labels.reshape(1, b * S)
            cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
            b, S, pos = 1, b * S, None
    packed = cu is not None or (pos is not None and bool((pos[:, 1:] == 0).any()))
    if packed:
        if b != 1:
            raise ValueError(f"packed documents need batch size 1, got {b}")
        if cu is None:
            cu = cu_seqlens_from_position_ids(pos[0])
        pack = cp.pack(cu.to(torch.int32).cpu())
        place = pack.placement
        empty = [r for r in range(place.world_size) if place.rows(r) == 0]
        if empty and not cp.is_simulated:  # the same on every rank: the pack is the batch's global one
            raise ValueError(f"shard_batch: the packed row of {place.total} tokens ({len(place.doc_lengths)} "
                             f"documents) leaves CP rank {empty[0]} of {place.world_size} without tokens (expected at "
                             "least 1 token a rank: a model's layers cannot run a zero-length shard); pack longer "
                             "rows or use a smaller cp")
        targets = _shift(labels, cu[:-1].long().cpu()) if shift_labels else labels
        local_ids, local_targets = pack.shard(ids, dim=1), pack.shard(targets, dim=1)
        positions = pack.positions(ids.device).unsqueeze(0)
        meta = CPMeta(cp, pack)
    else:
        if pos is not None and not torch.equal(pos, torch.arange(S, device=pos.device).expand_as(pos)):
            raise ValueError("position_ids of an unpacked batch must be 0..S-1 (restarts mean packing: b must be 1)")
        targets = _shift(labels, None) if shift_labels else labels
        local_ids, local_targets = cp.shard(ids, dim=1), cp.shard(targets, dim=1)
        positions = cp.positions(S, ids.device).unsqueeze(0).expand(b, -1)
        meta = CPMeta(cp)
    num = int((targets != IGNORE).sum())
    return CPBatch(local_ids, positions, local_targets, num, meta)


def causal_lm_loss(logits: torch.Tensor, batch: CPBatch, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logged)``: loss = sum of this rank's token losses / global target count (backprop
    this; SUM-reduce gradients over dp x cp); logged = the global mean loss, all-reduced over
    ``group`` (the dp x cp group; default: the whole world) and detached."""
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    loss = total / max(batch.num_targets, 1)
    return loss, global_mean_loss(loss, batch, group)


def global_mean_loss(loss: torch.Tensor, batch: CPBatch, group=None) -> torch.Tensor:
    """The logged loss: this rank's ``loss`` (already over the global target count) summed over
    ``group`` (default: the whole world), detached."""
    logged = loss.detach().clone()
    if dist.is_available() and dist.is_initialized() and not batch.meta.cp.is_simulated:
        dist.all_reduce(logged, group=group)
    return logged
