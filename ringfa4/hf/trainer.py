"""Context parallelism inside transformers' ``Trainer`` (and, in :mod:`ringfa4.hf.sft`, TRL's
``SFTTrainer``), packed documents included.

    trainer = ringfa4.hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                 cp_size=4, cp_options=ringfa4.RingOptions())
    trainer.train()                      # torchrun --nproc-per-node 8 ...: dp 2 x cp 4

:class:`ContextParallelMixin` does the work and goes in front of any ``transformers.Trainer``
subclass (``class MyTrainer(ContextParallelMixin, MyBaseTrainer)``):

- a ``(dp, cp)`` DeviceMesh over the world (cp inner, so a CP group shares NVLink) and a
  :class:`~ringfa4.ContextParallel` on its ``cp`` dimension (``ringfa4.hf.auto_cp``: Ulysses x ring
  from the model's heads);
- ``attn_implementation="ringfa4"`` on the model (transformers' defaults "sdpa"/"eager" are
  replaced; any other implementation is a ``ValueError``);
- the dataloaders shard over the dp ranks only: every CP rank of a dp group gets the same batches;
- each micro-batch ``(b, S)`` is checked, dense rows right-padded to the layout multiple (pads are
  no target) and sharded with :func:`~ringfa4.hf.shard_batch` (packed rows through their
  ``position_ids`` or ``cu_seq_lens_q``); a bad batch on any rank raises the same ``ValueError``
  on every rank before the step's first forward;
- the loss. Rank r backpropagates ``world * sum(r's token losses) / N`` where N counts the valid
  targets of the whole optimizer step (all dp ranks, all accumulated micro-batches: the Trainer's
  ``num_items_in_batch``). DDP (accelerate's multi-process default) and FSDP2 (accelerate's
  ``fully_shard`` over the world) both *average* gradients over the ``world = dp x cp`` ranks, so
  the reduced gradient is the sum over ranks of ``sum_r / N``: the single-process gradient of the
  global batch, and the norm that ``max_grad_norm`` clips is the global norm. The logged loss (the
  Trainer's mean over ranks of what each returns) is the global token mean;
- ``evaluate()`` / ``prediction_step``: the loss over all tokens of each step's dp-global batch;
  logits are all-gathered along the sequence (and over dp) only when predictions are asked for;
- logs gain ``tokens_per_s_per_device``, ``tflops_per_device`` and ``mfu`` (torchtitan's 6N + 12LHQT
  per token over ``peak_tflops``); FLOPs and ``num_input_tokens_seen`` count each token once;
- checkpoints and resume are the Trainer's own (weights, optimizer, scheduler, RNG, data position).
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from ..options import RingOptions
from ..parallel import ContextParallel
from .attention import NAME, auto_cp, register
from .batch import IGNORE, CPBatch
from .long_context import LongContext, enable_long_context
from .trainer_data import Prepared, agree, prepare_batch, step_flops

__all__ = ["ContextParallelMixin", "Trainer"]

PREPARED = "ringfa4_prepared"  # the key under which a batch carries its Prepared
REPLACEABLE = ("sdpa", "eager", None)  # transformers' own defaults: the trainer selects ringfa4 instead
H100_BF16_TFLOPS = 989.0  # dense bf16 datasheet peak of an H100/H200 (hf-facts: ~788 measured)


def _base_model(model):
    """The transformers model under a peft wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_model(model, args) -> None:
    """The model-level bad inputs: another attention implementation, attention dropout, an MoE
    auxiliary loss. (bf16 / fp16 autocast of float32 weights is fine: the attention casts q, k, v
    alike, as SDPA does.)"""
    base = _base_model(model)
    config = base.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in REPLACEABLE and impl != NAME:
        raise ValueError(f"the model was loaded with attn_implementation={impl!r}; the ringfa4 trainers run attention "
                         f"as {NAME!r}: load it with attn_implementation={NAME!r} (or with the default sdpa/eager, "
                         "which the trainer replaces)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0)
    if dropout:
        raise ValueError(f"model.config.attention_dropout is {dropout}: ringfa4 attention has no dropout; set "
                         "model.config.attention_dropout = 0.0")
    if getattr(text, "output_router_logits", False):
        raise ValueError(f"{type(base).__name__} returns router logits for an auxiliary load-balancing loss, which "
                         "the ringfa4 trainers do not add: set model.config.output_router_logits = False")


def _check_args(args, cp_size: int, world: int, kwargs: dict) -> None:
    """The argument-level bad inputs (the same on every rank)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or world % cp_size:
        options = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"cp_size must divide the world size {world} (dp x cp, cp inner), got {cp_size!r}: "
                         f"use one of {options}")
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and (getattr(pc, "cp_size", 1) > 1 or getattr(pc, "sp_size", 1) > 1):
        raise ValueError("TrainingArguments.parallelism_config sets cp_size/sp_size, but ringfa4 does the context "
                         "parallelism: remove cp_size/sp_size from parallelism_config and pass cp_size= to the trainer")
    if kwargs.get("compute_loss_func") is not None:
        raise ValueError("compute_loss_func is not supported by the ringfa4 trainers (the loss is computed on CP "
                         "shards): override _cp_loss_sum instead")
    if args.label_smoothing_factor:
        raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor} is not supported by the ringfa4 "
                         "trainers: set label_smoothing_factor=0")
    if cp_size > 1 and getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError("train_sampling_strategy='batch_rebalance' shards over all ranks, not over the dp ranks: use "
                         "'random', 'sequential' or 'group_by_length' with cp_size > 1")
    acc = args.accelerator_config
    if getattr(acc, "dispatch_batches", None):
        raise ValueError("accelerator_config.dispatch_batches=True slices each batch over all ranks: set it to False "
                         "(every CP rank of a dp group loads the same batch)")
    if hasattr(acc, "dispatch_batches"):
        acc.dispatch_batches = False


def _packed_rows(args, collator) -> bool:
    """Whether the trainer's batches are packed documents, from what it is given: TRL's
    ``SFTConfig.packing`` / ``padding_free``, or transformers' ``DataCollatorWithFlattening``."""
    flattening = getattr(transformers, "DataCollatorWithFlattening", None)
    return bool(getattr(args, "packing", False) or getattr(args, "padding_free", False)
                or (flattening is not None and isinstance(collator, flattening)))


class ContextParallelMixin:
    """Put in front of a ``transformers.Trainer`` (sub)class; see the module doc.

    Keyword arguments besides the Trainer's: ``cp_size`` (CP degree; dp = world / cp_size),
    ``cp_options`` (the :class:`~ringfa4.RingOptions` of every attention call; None: the defaults with
    ``metadata_check="new_shapes"``, since every CP rank of a dp group runs the same agreed batch
    through the same model, so the ranks compare a call's metadata once per batch shape, not once a
    layer, as the recipes do), ``cp_layout`` ("zigzag" or "contiguous"), ``cp_packed`` (the batches
    are packed documents, so the planner runs the ring alone, no Ulysses; None: whether TRL's
    SFTConfig sets ``packing`` or ``padding_free`` or the data collator is transformers'
    ``DataCollatorWithFlattening``), ``long_context`` (a :class:`~ringfa4.hf.LongContext`, applied to
    the model), ``peak_tflops`` (per device, for the logged MFU). ``model`` must be a model object."""

    def __init__(self, *args, cp_size: int = 1, cp_options: RingOptions | None = None, cp_layout: str = "zigzag",
                 cp_packed: bool | None = None, long_context: LongContext | None = None,
                 peak_tflops: float = H100_BF16_TFLOPS, **kwargs) -> None:
        if len(args) > 2:
            raise TypeError("pass the trainer's arguments after model and args by keyword")
        kwargs.update(zip(("model", "args"), args))
        model = kwargs.get("model")
        if model is None or isinstance(model, str):
            raise ValueError("the ringfa4 trainers need model= a loaded model object (not a name, not model_init): "
                             f"load it with attn_implementation={NAME!r}")
        if kwargs.get("args") is None:
            kwargs["args"] = self._cp_default_args(model)
        targs = kwargs["args"]
        if cp_options is not None and not isinstance(cp_options, RingOptions):
            raise ValueError(f"cp_options must be a ringfa4.RingOptions, got {type(cp_options).__name__}")
        if cp_options is None:  # the ranks make the same calls (see the class doc)
            cp_options = RingOptions(metadata_check="new_shapes")
        if cp_packed is not None and not isinstance(cp_packed, bool):
            raise ValueError(f"cp_packed must be a bool or None, got {cp_packed!r}")
        packed = _packed_rows(targs, kwargs.get("data_collator")) if cp_packed is None else cp_packed
        if long_context is not None and not isinstance(long_context, LongContext):
            raise ValueError(f"long_context must be a ringfa4.hf.LongContext, got {type(long_context).__name__}")
        if long_context is not None and long_context.checkpoint and targs.gradient_checkpointing:
            raise ValueError("long_context checkpoints the decoder layers itself: set gradient_checkpointing=False "
                             "or LongContext(checkpoint=False)")
        device = targs.device  # sets up the process group (torchrun) as the Trainer would
        world = targs.world_size
        _check_args(targs, cp_size, world, kwargs)
        self._cp_check_args(targs, kwargs)
        _check_model(model, targs)
        self._cp_setup(model, device, cp_size, world, (cp_layout, cp_options, packed))
        if long_context is not None:
            enable_long_context(model, long_context)
        self._cp_peak_tflops = float(peak_tflops)
        self._cp_window = [0.0, 0.0]  # tokens, FLOPs since the last log
        self._cp_clock: float | None = None
        super().__init__(**kwargs)
        self.loss_is_scaled_for_ga = True  # the loss is over the whole step's target count

    # -- setup ---------------------------------------------------------------------------------------
    def _cp_default_args(self, model):
        return transformers.TrainingArguments(output_dir="tmp_trainer")

    def _cp_check_args(self, args, kwargs: dict) -> None:
        """Trainer-specific checks of the arguments (``kwargs``: the Trainer's); raise ValueError."""

    def _cp_setup(self, model, device: torch.device, cp_size: int, world: int, layout_options: tuple) -> None:
        """The mesh, the ContextParallel, the attention implementation; ``layout_options``: (layout,
        RingOptions, packed)."""
        layout, options, packed = layout_options
        base = _base_model(model)
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
            cp = auto_cp(base.config.get_text_config(), group=mesh["cp"], layout=layout, options=options,
                         packed=packed)
            self._cp_mesh, self._cp_dp_group = mesh, mesh["dp"].get_group()
            self._cp_dp_rank = mesh["dp"].get_local_rank()
        else:
            cp = ContextParallel.simulated(1, layout=layout, options=options)
            self._cp_mesh, self._cp_dp_group, self._cp_dp_rank = None, None, 0
        self.cp, self.cp_size, self.dp_size, self._cp_world = cp, cp_size, world // cp_size, world
        self._cp_planned_packed = packed  # planned for packed rows, or the mismatch was said (_cp_prepare)
        register(cp)
        base.set_attn_implementation(NAME)
        if base.config._attn_implementation != NAME:
            raise ValueError(f"{type(base).__name__} does not accept attn_implementation={NAME!r} (it does not use "
                             "transformers' AttentionInterface)")
        base.config.use_cache = False
        self._cp_pad_id = int(getattr(base.config.get_text_config(), "pad_token_id", None) or 0)

    # -- data ---------------------------------------------------------------------------------------
    def _get_dataloader(self, *args, **kwargs):
        """The Trainer's dataloader, sharded over the dp ranks only (accelerate shards over all)."""
        loader = super()._get_dataloader(*args, **kwargs)
        if self.dp_size == self._cp_world:
            return loader
        from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

        found = False
        for part in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                     getattr(loader, "dataset", None)):
            if isinstance(part, (BatchSamplerShard, IterableDatasetShard)):
                part.num_processes, part.process_index = self.dp_size, self._cp_dp_rank
                found = True
        if not found:
            raise ValueError(f"the {type(loader).__name__} is not sharded by accelerate's BatchSamplerShard or "
                             "IterableDatasetShard, so the CP ranks of a dp group would not share batches: use a "
                             "map-style or iterable dataset with dispatch_batches=False")
        return loader

    def _cp_prepare(self, batches: list[dict], device: torch.device) -> list[float]:
        """Prepare (check, pad, shard) every batch in place under ``PREPARED``; on every rank, the
        same ValueError if any rank's batch is bad; returns the dp-global (targets, tokens,
        attention tokens) of the batches."""
        problems, local = [], [0.0, 0.0, 0.0]
        for batch in batches:
            prep, problem = prepare_batch(batch, self.cp, self._cp_pad_id)
            problems.append(problem)
            if prep is not None:
                batch[PREPARED] = prep
                local = [local[0] + prep.shard.num_targets, local[1] + prep.tokens, local[2] + prep.attn_tokens]
                if prep.packed:
                    self._cp_check_packed_plan()
        totals = agree(problems, local, device)
        return [x / self.cp_size for x in totals]  # every CP rank of a dp group counted the same batch

    def _cp_check_packed_plan(self) -> None:
        """A batch of packed documents met a plan made for unpacked rows with Ulysses in it: say once
        that ``cp_packed=True`` plans the ring alone (the trainer cannot tell packed rows from its
        arguments when the user packs them; the batches still run, more slowly)."""
        if self._cp_planned_packed or self.cp.ulysses == 1:
            return
        self._cp_planned_packed = True  # said once: never again
        warnings.warn(f"ringfa4.hf trainer: the batches hold packed documents (position_ids that restart, or "
                      f"cu_seqlens) but the CP plan was made for unpacked rows: Ulysses {self.cp.ulysses} x ring "
                      f"{self.cp_size // self.cp.ulysses}. Packed documents run faster on the ring alone "
                      f"(docs/performance.md, 'Packed documents and Ulysses'): pass cp_packed=True.", UserWarning,
                      stacklevel=3)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The step's micro-batches, prepared, and their dp-global target count (the loss divisor)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if self._cp_clock is None:
            self._cp_clock = time.perf_counter()
        targets, tokens, attn = self._cp_prepare(batches, device)
        config = _base_model(self.model).config
        self._cp_step_tokens = tokens
        self._cp_window[0] += tokens
        self._cp_window[1] += step_flops(config, tokens, attn)
        return batches, int(round(targets))

    def _cp_batch(self, inputs: dict) -> tuple[Prepared, int]:
        """The batch's Prepared and the dp-global target count (preparing it now if needed)."""
        prep = inputs.get(PREPARED)
        if prep is None:
            targets = self._cp_prepare([inputs], self.args.device)[0]
            return inputs[PREPARED], int(round(targets))
        return prep, None

    # -- loss -----------------------------------------------------------------------------------------
    def _cp_loss_sum(self, model, shard: CPBatch) -> tuple[torch.Tensor, object]:
        """``(sum of this rank's token losses, model outputs)``; logits ``(b, s_local, vocab)``."""
        outputs = model(**shard.model_inputs())
        logits = outputs.logits
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shard.labels.reshape(-1),
                                ignore_index=IGNORE, reduction="sum")
        return total, outputs

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """``world * sum(local token losses) / num_items_in_batch`` (see the module doc). Called
        outside the training loop on a raw batch without ``num_items_in_batch``, the divisor is
        this batch's dp-global target count (one all-reduce)."""
        prep, targets = self._cp_batch(inputs)
        if num_items_in_batch is None:
            num_items_in_batch = targets if targets is not None else prep.shard.num_targets
        total, outputs = self._cp_loss_sum(model, prep.shard)
        loss = total * (self._cp_world / max(float(num_items_in_batch), 1.0))
        return (loss, outputs) if return_outputs else loss

    # -- evaluation -----------------------------------------------------------------------------------
    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        """``(loss over all tokens of the dp-global batch, logits (b, S, vocab) or None, labels)``."""
        inputs = self._prepare_inputs(inputs)
        prep, _ = self._cp_batch(inputs)
        with torch.no_grad():
            total, outputs = self._cp_loss_sum(model, prep.shard)
            stats = torch.stack([total.detach().double(),
                                 (prep.shard.labels != IGNORE).sum().double()])
            if self._cp_world > 1:
                dist.all_reduce(stats)
            loss = (stats[0] / stats[1].clamp(min=1)).to(total.dtype)
            if prediction_loss_only:
                return loss, None, None
            logits = self._cp_full_logits(model, prep, outputs)
        labels = inputs.get("labels")
        return loss, logits, labels

    def _cp_full_logits(self, model, prep: Prepared, outputs) -> torch.Tensor:
        """The full batch's logits ``(b, S, vocab)`` on every CP rank (all-gathered along the sequence)."""
        logits = getattr(outputs, "logits", None)
        if logits is None:  # a loss-only forward (TRL's fused head): run the plain one
            logits = model(**prep.shard.model_inputs()).logits
        meta = prep.shard.meta
        if meta.packing is not None:
            return meta.packing.unshard(logits[0].contiguous(), 0).unsqueeze(0)
        return self.cp.unshard(logits.contiguous(), 1)[:, :prep.length]

    def _cp_gather(self, data, **_):
        """gather_for_metrics over the dp ranks only (CP ranks of a dp group hold the same values)."""
        if self._cp_dp_group is not None and self.dp_size > 1:
            if isinstance(data, torch.Tensor):
                parts = [torch.empty_like(data) for _ in range(self.dp_size)]
                dist.all_gather(parts, data.contiguous(), group=self._cp_dp_group)
                data = torch.cat(parts, 0)
            else:
                parts = [None] * self.dp_size
                dist.all_gather_object(parts, data, group=self._cp_dp_group)
                data = [x for part in parts for x in part]
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[:state.remainder]
        return data

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = self._cp_gather
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics

    # -- accounting -----------------------------------------------------------------------------------
    def floating_point_ops(self, inputs: dict) -> int:
        """The Trainer's estimate for the batch, split over the CP ranks that share it."""
        return super().floating_point_ops(inputs) // self.cp_size

    def _track_num_input_tokens(self, inputs) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.cp_size

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """The Trainer's logs plus tokens/s and TFLOP/s per device and MFU over the logging window."""
        if "loss" in logs and self._cp_clock is not None and self._cp_window[0] > 0:
            now = time.perf_counter()
            seconds = max(now - self._cp_clock, 1e-9)
            tokens, flops = self._cp_window
            logs["tokens_per_s_per_device"] = tokens / seconds / self._cp_world
            logs["tflops_per_device"] = flops / seconds / self._cp_world / 1e12
            logs["mfu"] = logs["tflops_per_device"] / self._cp_peak_tflops
            self._cp_window, self._cp_clock = [0.0, 0.0], now
        super().log(logs, start_time)


class Trainer(ContextParallelMixin, transformers.Trainer):
    """``transformers.Trainer`` with ringfa4 context parallelism (``cp_size``, ``cp_options``,
    ``cp_layout``, ``long_context``, ``peak_tflops``; see :class:`ContextParallelMixin`)."""
