"""Jobs for tests/test_trainer.py, run on every rank of a gloo pool (tests/dist_pool.py finds them
through tests/dist_jobs.py). One job trains a tiny model with ``ringfa4.hf.Trainer`` /
``ringfa4.hf.SFTTrainer`` or, as the reference, with plain ``transformers.Trainer`` /
``trl.SFTTrainer`` on one process; each returns plain data (losses, grad norms, eval loss, and on
rank 0 the final weights as one flat tensor)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "recipes"))

__all__ = ["trainer_bad", "trainer_recipe_run", "trainer_run"]

VOCAB = 128


def _accelerate_env() -> None:
    """What torchrun would set, so that accelerate sees this gloo group as a MULTI_CPU run."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"})
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ["ACCELERATE_USE_CPU"] = "true"
    os.environ["WANDB_MODE"] = "disabled"


def dense_examples(n: int, seed: int) -> list[dict]:
    """``n`` token sequences of 13..40 tokens (not multiples of the CP layouts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(13, 41, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(2, VOCAB, (m,), generator=g).tolist()} for m in lengths]


def pad_collate(examples: list[dict]) -> dict:
    """Right padding (id 0, mask 0, label -100), as DataCollatorWithPadding with labels."""
    S = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _history(trainer) -> dict:
    logs = trainer.state.log_history
    steps = [r for r in logs if "loss" in r and "eval_loss" not in r]
    return {"losses": [r["loss"] for r in steps], "grad_norms": [r["grad_norm"] for r in steps],
            "logs": steps, "eval": [r for r in logs if "eval_loss" in r]}


def _training_args(spec: dict, out: str, sft: bool):
    common = dict(output_dir=out, per_device_train_batch_size=spec.get("per_device", 1),
                  per_device_eval_batch_size=spec.get("per_device_eval", spec.get("per_device", 1)),
                  gradient_accumulation_steps=spec.get("accum", 2), max_steps=spec.get("steps", 3),
                  learning_rate=spec.get("lr", 3e-3), max_grad_norm=spec.get("clip", 0.5), logging_steps=1,
                  save_strategy="steps" if spec.get("save_steps") else "no", save_steps=spec.get("save_steps") or 500,
                  report_to=[], disable_tqdm=True, use_cpu=True, seed=0, lr_scheduler_type="linear",
                  warmup_steps=0, dataloader_drop_last=True, activation_checkpointing=spec.get("checkpointing", False),
                  **spec.get("args", {}))
    if sft:
        from trl import SFTConfig

        return SFTConfig(packing=spec.get("packing", True), max_length=spec.get("max_length", 64),
                         dataset_num_proc=None, bf16=False, **common)
    from transformers import TrainingArguments

    return TrainingArguments(**common)


def _model(spec: dict):
    import hf_models

    model = hf_models.make_model(spec.get("kind", "llama"))
    model.set_attn_implementation("eager")
    for key, value in spec.get("config", {}).items():
        setattr(model.config, key, value)
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    return model


def _build(spec: dict, out: str):
    """The trainer of ``spec``: "trainer" / "sft" (ringfa4) or "plain" / "plain_sft" (reference)."""
    import datasets
    import transformers
    import trl
    from trl_sft import byte_tokenizer

    import ringfa4.hf as rhf

    what = spec["trainer"]
    sft = what in ("sft", "plain_sft")
    args = _training_args(spec, out, sft)
    model = _model(spec)
    cp = {} if what.startswith("plain") else {"cp_size": spec.get("cp", 1), **spec.get("cp_kwargs", {})}
    if sft:
        docs = dense_examples(spec.get("docs", 48), 3)
        train = datasets.Dataset.from_dict({"input_ids": [d["input_ids"] for d in docs]})
        evald = datasets.Dataset.from_dict({"input_ids": [d["input_ids"] for d in dense_examples(16, 4)]})
        cls = rhf.SFTTrainer if what == "sft" else trl.SFTTrainer
        return cls(model=model, args=args, train_dataset=train, eval_dataset=evald,
                   processing_class=byte_tokenizer(VOCAB), **cp)
    collate = pad_collate
    if spec.get("flatten"):
        collate = transformers.DataCollatorWithFlattening(return_position_ids=True)
    cls = rhf.Trainer if what == "trainer" else transformers.Trainer
    return cls(model=model, args=args, train_dataset=dense_examples(spec.get("examples", 16), 1),
               eval_dataset=dense_examples(8, 2), data_collator=collate, **cp)


def trainer_run(spec: dict, out: str) -> dict:
    """Train per ``spec`` (see _build); evaluate at the end when ``spec["eval"]``; with
    ``spec["resume"]`` (a step), also resume a fresh trainer from that checkpoint and report its
    losses as ``resumed``."""
    _accelerate_env()
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = _build(spec, out)
    trainer.train()
    res = _history(trainer)
    if spec.get("eval"):
        res["eval_loss"] = trainer.evaluate()["eval_loss"]
    if spec.get("predict"):
        pred = trainer.predict(trainer.eval_dataset)
        keep = torch.as_tensor(pred.label_ids) != -100  # real tokens (pad positions' logits mean nothing)
        res["predictions"] = torch.as_tensor(pred.predictions).float()[keep] if rank == 0 else None
    if spec.get("resume"):
        again = _build(spec, out)
        again.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{spec['resume']}"))
        res["resumed"] = _history(again)["losses"]
    res["weights"] = _flat(trainer.model) if rank == 0 else None
    if hasattr(trainer, "cp"):  # the planner's (U, R) for this trainer's batches
        res["cp_plan"] = (trainer.cp.ulysses, trainer.cp.ring_size)
        res["metadata_check"] = trainer.cp.options.metadata_check
    if dist.is_initialized():
        dist.barrier()
    return res


def trainer_bad(case: str, out: str) -> str:
    """Build (and train) a trainer with one bad input; the ValueError propagates."""
    _accelerate_env()
    spec = {"trainer": "trainer", "cp": 2, "per_device": 1}
    if case == "cp_size":
        spec["cp"] = 3
    elif case == "dropout":
        spec["config"] = {"attention_dropout": 0.1}
    elif case == "packing_batch":
        spec = {"trainer": "sft", "cp": 2, "per_device": 2}
    elif case == "implementation":
        from transformers import AttentionInterface

        AttentionInterface.register("mine", AttentionInterface._global_mapping["sdpa"])
        spec["implementation"] = "mine"
    trainer = _bad_trainer(spec, case, out)
    trainer.train()
    return "trained"


def _bad_trainer(spec: dict, case: str, out: str):
    if case == "implementation":
        import ringfa4.hf as rhf

        model = _model(spec)
        model.set_attn_implementation("mine")
        return rhf.Trainer(model=model, args=_training_args(spec, out, False), train_dataset=dense_examples(8, 1),
                           data_collator=pad_collate, cp_size=2)
    trainer = _build(spec, out)
    rank = dist.get_rank()
    if case in ("mask_4d", "mask_holes"):
        real = trainer.data_collator

        def collate(examples):
            batch = real(examples)
            if case == "mask_4d":
                S = batch["input_ids"].shape[1]
                batch["attention_mask"] = torch.ones(len(examples), 1, S, S).tril()
            elif rank == 1:  # a hole on one rank only: every rank must still raise
                batch["attention_mask"][:, 2] = 0
            return batch

        trainer.data_collator = collate
    return trainer


def trainer_recipe_run(overrides: list[str]) -> list[dict]:
    """recipes/trl_sft.py's run() on this gloo group: the Trainer's log rows."""
    _accelerate_env()
    import trl_sft

    cfg = trl_sft.load_config(os.path.join(HERE, "..", "recipes", "configs", "trl_sft_cpu.toml"),
                              ["log.progress=false", 'log.wandb="disabled"'] + list(overrides))
    rows = trl_sft.run(cfg)
    dist.barrier()
    return rows
