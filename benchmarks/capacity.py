"""How long a sequence one GPU trains: a Llama-3.1-8B-shaped model (random weights from config), LoRA
r=16 on q/k/v/o, bf16, one optimizer step per row, with ringfa4's memory tools or plain transformers.

    python benchmarks/capacity.py --mode plain   --layers 32 --seqs 32768            # the baseline
    python benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 32768,65536      # full depth
    python benchmarks/capacity.py --mode ringfa4 --layers 2,4 --seqs 1048576 --host-budget-gib 100

plain: transformers with sdpa attention, gradient checkpointing and its own loss (full logits).
LoRA factors: plain mode keeps peft's default (fp32, which keeps an fp32 copy of every adapted
layer's input for backward; the first H200 runs of both modes used it); ringfa4 mode puts them in
the model's dtype unless ``--lora-fp32``.
ringfa4: attn_implementation="ringfa4" (one fa4 call a layer), lean RMSNorms, tiled MLP, tiled loss, layer
checkpointing with inputs placed by budget (GPU / pinned host / rebuilt), optionally cached
attention outputs. A row reports step time, tokens/s, MFU (torchtitan's convention, causal not
discounted, like the recipe), peak GPU memory (allocated and reserved), host memory (pinned pool
and peak RSS), where the checkpointed inputs went, and the time shares of attention, MLP and loss
from separate timings of one layer's attention and MLP (forward, recompute, backward) and of the
loss at the same length. Rows that run out of memory say so. Each row runs in a fresh process
(nothing of the previous row's model can stay on the GPU). ``--memory-trace`` lists what is alive
at the step's peak, by the source line that allocated it. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import resource
import subprocess
import sys
import time

import _memtrace
import torch

LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 21,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
GIB = 2**30


def build(layers: int, device, dtype, shape: dict, lora_fp32: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{**shape, "num_hidden_layers": layers, "use_cache": False})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora, autocast_adapter_dtype=lora_fp32).train()


def flops_per_token(shape: dict, layers: int, seq: int) -> float:
    H, inter, h, kv = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads"))
    d = H // h
    per_layer = H * d * (h + 2 * kv) + h * d * H + 3 * H * inter
    return 6 * layers * per_layer + 12 * layers * h * d * seq


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def component_times(model, seq: int, a, device) -> dict:
    """Seconds for one layer's attention and MLP (forward + recompute + backward; attention without
    the recompute when its outputs are cached) and for the loss, at ``seq`` tokens."""
    import ringfa4
    from ringfa4.memory import tiled_apply, tiled_causal_lm_loss

    base = model.get_base_model()
    cfg = base.config
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    dt = next(base.parameters()).dtype
    q = torch.randn(1, seq, h, d, device=device, dtype=dt, requires_grad=True)
    k, v = (torch.randn(1, seq, kv, d, device=device, dtype=dt, requires_grad=True) for _ in range(2))
    cp = ringfa4.ContextParallel(backend=a.backend)

    def attn():
        passes = 1 if a.cache_attention else 2
        for _ in range(passes):
            out = ringfa4.attention(q, k, v, cp=cp, causal=True)
        out.backward(torch.ones_like(out))

    x = torch.randn(1, seq, cfg.hidden_size, device=device, dtype=dt, requires_grad=True)
    mlp = base.model.layers[0].mlp

    def mlp_pass():
        with torch.no_grad():
            tiled_apply(mlp, x, a.mlp_tile)
        tiled_apply(mlp, x, a.mlp_tile).sum().backward()

    targets = torch.randint(0, cfg.vocab_size, (1, seq), device=device)

    def loss_pass():
        tiled_causal_lm_loss(x, base.lm_head.weight, targets, seq, chunk=a.loss_chunk).backward()

    out = {name: _timed(fn, device) for name, fn in (("attention", attn), ("mlp", mlp_pass), ("loss", loss_pass))}
    model.zero_grad(set_to_none=True)
    return out


def one_step(model, train, ids, a, device, opt):
    import ringfa4
    from ringfa4.hf import shard_batch

    if a.mode == "plain":
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    else:
        shard = shard_batch({"input_ids": ids}, ringfa4.ContextParallel(backend=a.backend))
        loss = train(shard)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run_row(layers: int, seq: int, a, device, shape: dict, warm: bool) -> dict:
    import ringfa4.hf as rhf

    row = {"mode": a.mode, "layers": layers, "seq": seq}
    model = train = opt = None
    try:
        model = build(layers, device, getattr(torch, a.dtype), shape, a.lora_fp32 or a.mode == "plain")
        if a.mode == "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            rhf.register(__import__("ringfa4").ContextParallel(backend=a.backend))
            model.get_base_model().set_attn_implementation(rhf.NAME)
            rhf.enable_long_context(model, rhf.LongContext(
                mlp_tile=a.mlp_tile, gpu_budget_gib=a.gpu_budget_gib, host_budget_gib=a.host_budget_gib,
                group=a.group, cache_attention=a.cache_attention, lean_norms=not a.plain_norms))
            train = rhf.TiledLossLM(model, a.loss_chunk)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        ids = torch.randint(0, shape["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
        if warm:  # compiles, pinned buffers, allocator warm
            one_step(model, train, ids, a, device, opt)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        row["weights_gib"] = (torch.cuda.memory_allocated() / GIB) if device.type == "cuda" else 0.0
        trace = a.memory_trace and device.type == "cuda"
        if trace:
            _memtrace.start()
        t = _timed(lambda: row.__setitem__("loss", one_step(model, train, ids, a, device, opt)), device)
        if trace:  # what the step's peak holds, by the line that made it (the traced step is slower)
            row["memory_at_peak"] = _memtrace.at_peak(_memtrace.snapshot())
        row.update(step_s=t, tokens_per_s=seq / t,
                   tflops=flops_per_token(shape, layers, seq) * seq / t / 1e12)
        row["mfu"] = row["tflops"] / a.peak_tflops
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        ckpt = getattr(model, "ringfa4_checkpointing", None)
        if ckpt is not None:
            row["host_pinned_gib"] = ckpt.peak_host_bytes / GIB
            row["placement"] = ckpt.describe()
        row["rss_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if a.shares and a.mode == "ringfa4":
            c = component_times(model, seq, a, device)
            row["shares"] = {"attention": layers * c["attention"] / t, "mlp": layers * c["mlp"] / t,
                             "loss": c["loss"] / t}
    except torch.OutOfMemoryError as exc:
        row["oom"] = str(exc).split("\n")[0][:200]
    finally:
        model = train = opt = None  # noqa: F841 (free before the next row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["plain", "ringfa4"], default="ringfa4")
    ap.add_argument("--layers", default="32")
    ap.add_argument("--seqs", default="32768")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--mlp-tile", type=int, default=8192)
    ap.add_argument("--loss-chunk", type=int, default=8192)
    ap.add_argument("--gpu-budget-gib", type=float, default=None)
    ap.add_argument("--host-budget-gib", type=float, default=None)
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--cache-attention", action="store_true")
    ap.add_argument("--lora-fp32", action="store_true", help="LoRA factors in fp32 (peft's default)")
    ap.add_argument("--plain-norms", action="store_true", help="transformers' RMSNorm (saves an fp32 copy)")
    ap.add_argument("--no-warm", action="store_true", help="time the first step (compiles included)")
    ap.add_argument("--shares", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (smoke test)")
    ap.add_argument("--memory-trace", action="store_true",
                    help="record the allocator during the timed step; list what is alive at its peak")
    ap.add_argument("--out", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    shape = copy.deepcopy(LLAMA31_8B)
    if a.tiny:
        shape.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2)
        a.dtype, a.backend = "float32", "reference"
    if a.one:  # one row in this process (the parent runs each row in a fresh one)
        layers, seq, warm = (int(x) for x in a.one.split(","))
        print("ROW " + json.dumps(run_row(layers, seq, a, device, shape, bool(warm))), flush=True)
        return
    rows = []
    for seq in (int(s) for s in a.seqs.split(",")):
        for layers in (int(x) for x in a.layers.split(",")):
            warm = int(not a.no_warm)  # every row is a fresh process: compiles and pinned pool are cold
            r = subprocess.run([sys.executable, *sys.argv, "--one", f"{layers},{seq},{warm}"], capture_output=True,
                               text=True)
            found = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
            if not found and a.memory_trace:  # the allocator trace is a diagnostic: retry the row without it
                print(f"row layers={layers} seq={seq} failed under --memory-trace; again without it:",
                      r.stderr[-1500:])
                argv = [x for x in sys.argv if x != "--memory-trace"]
                r = subprocess.run([sys.executable, *argv, "--one", f"{layers},{seq},{warm}"], capture_output=True,
                                   text=True)
                found = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
            if not found:
                print(r.stdout[-3000:], r.stderr[-3000:])
                print(f"row layers={layers} seq={seq} failed (exit {r.returncode})")
                rows.append({"mode": a.mode, "layers": layers, "seq": seq, "failed": r.stderr[-400:]})
                continue
            rows.append(json.loads(found[0]))
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{a.mode}: Llama-3.1-8B shape, LoRA r=16, {a.dtype}, {where}")
    print("| layers | seq | step s | tok/s | MFU | peak GiB | reserved | host pinned | attn/mlp/loss share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "oom" in r or "failed" in r:
            print(f"| {r['layers']} | {r['seq']} | {'OOM' if 'oom' in r else 'failed'} | | | | | | |")
            continue
        s = r.get("shares")
        share = "/".join(f"{s[k]:.2f}" for k in ("attention", "mlp", "loss")) if s else ""
        print(f"| {r['layers']} | {r['seq']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['mfu']:.3f} | "
              f"{r.get('peak_gib', 0):.1f} | {r.get('reserved_gib', 0):.1f} | {r.get('host_pinned_gib', 0):.1f} | "
              f"{share} |")
    for r in rows:
        if "memory_at_peak" in r:
            m = r["memory_at_peak"]
            print(f"\nalive at the step's peak, {r['layers']} layers x {r['seq']} tokens "
                  f"({m['peak_in_trace_gib']:.1f} GiB allocated during the step):")
            for item in m["live_at_peak"]:
                print(f"  {item['gib']:7.2f} GiB  {item['where']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
