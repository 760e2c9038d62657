"""TRL's ``SFTTrainer`` with ringfa4 context parallelism, packing included.

    trainer = ringfa4.hf.SFTTrainer(model=model, args=SFTConfig(packing=True, max_length=131072,
                                    per_device_train_batch_size=1), train_dataset=ds,
                                    processing_class=tokenizer, cp_size=8)

Packed rows (``packing=True``, ``padding_free=True``) arrive as one row with restarting
``position_ids`` and are placed on the CP ranks by ``cp.pack``: documents never attend across their
boundaries, unlike accelerate's CP, which TRL refuses together with packing. The loss goes through
TRL's fused LM head on each rank's shard (per-token log-probabilities, no full logits), with the
Trainer's normalization of :class:`~ringfa4.hf.trainer.ContextParallelMixin`; ``entropy``,
``mean_token_accuracy`` and ``num_tokens`` are logged over all ranks, each token once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import trl

from .batch import CPBatch
from .trainer import ContextParallelMixin

__all__ = ["SFTTrainer"]


class SFTTrainer(ContextParallelMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with ringfa4 context parallelism (``cp_size``, ``cp_options``,
    ``cp_layout``, ``long_context``, ``peak_tflops``; see :class:`~ringfa4.hf.ContextParallelMixin`)."""

    def _cp_default_args(self, model):
        name = getattr(model.config, "_name_or_path", "") or "model"
        return trl.SFTConfig(output_dir=f"{name.split('/')[-1]}-SFT")

    def _cp_check_args(self, args, kwargs: dict) -> None:
        if getattr(args, "packing", False) and args.per_device_train_batch_size > 1:
            raise ValueError(f"per_device_train_batch_size={args.per_device_train_batch_size} with packing=True: a "
                             "packed CP batch is one row; set per_device_train_batch_size=1 and raise max_length (or "
                             "gradient_accumulation_steps) instead")
        eval_packing = args.packing if getattr(args, "eval_packing", None) is None else args.eval_packing
        if eval_packing and args.per_device_eval_batch_size > 1 and kwargs.get("eval_dataset") is not None:
            raise ValueError(f"per_device_eval_batch_size={args.per_device_eval_batch_size} with packed evaluation: a "
                             "packed CP batch is one row; set per_device_eval_batch_size=1")
        if getattr(args, "loss_type", "nll") != "nll":
            raise ValueError(f"loss_type={args.loss_type!r} is not supported by ringfa4.hf.SFTTrainer: set "
                             "loss_type='nll'")
        if getattr(args, "activation_offloading", False):
            raise ValueError("activation_offloading is not supported with ringfa4 CP: use long_context="
                             "ringfa4.hf.LongContext(host_budget_gib=...) to offload checkpointed layer inputs")

    def _cp_loss_sum(self, model, shard: CPBatch) -> tuple[torch.Tensor, object]:
        """Sum of this rank's token losses through TRL's fused head (no full logits); records the
        step's entropy and token accuracy over all ranks."""
        outputs = model(**shard.model_inputs(), shift_labels=shard.labels, fused_lm_head=True)
        total = -outputs.log_probs.sum()
        stats = torch.stack([outputs.label_mask.sum().double(), outputs.entropy.detach().sum().double(),
                             outputs.is_top1.sum().double()])
        if self._cp_world > 1:
            dist.all_reduce(stats)
        valid, entropy, correct = stats.tolist()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return total, outputs

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The mixin's, counting the step's dp-global tokens into TRL's ``num_tokens``."""
        batches, targets = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._total_train_tokens += int(round(self._cp_step_tokens))
        return batches, targets
