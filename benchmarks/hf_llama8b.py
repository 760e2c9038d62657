"""A Llama-3.1-8B-shaped model (random weights from config, bf16) through transformers with
``attn_implementation="ringfa4"`` against the same model with sdpa: one forward+backward step at
``--seq`` tokens (gradient checkpointing on, all weights trained, the same tiled loss for every
row so that only attention differs). Reports loss, gradient norm, gradient difference against the
sdpa step, step time and peak GPU memory.

    python benchmarks/hf_llama8b.py --seq 32768 --out results.json         # on the H200

Rows: ``sdpa`` (cuDNN/flash through torch), ``ringfa4 cp=1`` (one fa4 call a layer), ``ringfa4
simulated P`` (the ring executor with P ranks in one process, loopback hops). Gradients of the
first row stay on the host; each later row reports ``|g - g_sdpa| / |g_sdpa|`` over all weights
and the worst single weight; ``--floor`` adds sdpa restricted to its flash kernel, whose difference
from the default sdpa kernel is the noise floor of that comparison (bf16 kernels round differently).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import ringfa4
import ringfa4.hf as rhf
from ringfa4.memory import tiled_causal_lm_loss

LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{**LLAMA31_8B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def step(model, ids, meta):
    """One forward+backward; returns the loss (float). Same tiled loss for every row."""
    S = ids.shape[1]
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    kwargs = {} if meta is None else {rhf.NAME: meta}
    pos = torch.arange(S, device=ids.device)[None]
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).last_hidden_state
    loss = tiled_causal_lm_loss(hidden, model.lm_head.weight, targets, S - 1)
    loss.backward()
    return loss.item()


def run_row(model, ids, impl: str, meta, reps: int, ref_grads, sdpa_backend=None):
    import contextlib

    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(sdpa_backend) if sdpa_backend is not None else contextlib.nullcontext():
        return _run_row(model, ids, impl, meta, reps, ref_grads)


def _run_row(model, ids, impl: str, meta, reps: int, ref_grads):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    step(model, ids, meta)  # warm-up (FA4 compiles on first use)
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = step(model, ids, meta)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    params = [p for p in model.parameters() if p.grad is not None]
    gnorm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params])).item()
    row = {"impl": impl, "loss": loss, "grad_norm": gnorm, "step_s": sorted(times)[len(times) // 2],
           "peak_gib": peak / 2**30, "peak_over_weights_gib": (peak - base) / 2**30}
    if ref_grads is None:
        return row, [p.grad.detach().to("cpu") for p in params]
    num = den = worst = 0.0
    for p, g in zip(params, ref_grads):
        g = g.to(p.device, torch.float32)
        d = (p.grad.float() - g).norm().item()
        n = g.norm().item()
        num, den = num + d * d, den + n * n
        worst = max(worst, d / max(n, 1e-30))
    row.update(grad_rel_diff=(num / den) ** 0.5, worst_weight_rel_diff=worst)
    return row, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sim", type=int, default=4, help="simulated ring world size (0: skip)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--floor", action="store_true", help="add sdpa forced to its flash kernel (noise floor)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    model = build(a.layers)
    rhf.register()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA31_8B["vocab_size"], (1, a.seq), generator=g).cuda()
    rows = []
    row, ref = run_row(model, ids, "sdpa", None, a.reps, None)
    rows.append(row)
    if a.floor:  # two correct bf16 kernels differ this much: the noise floor of the comparison
        from torch.nn.attention import SDPBackend

        row, _ = run_row(model, ids, "sdpa", None, a.reps, ref, SDPBackend.FLASH_ATTENTION)
        row["impl"] = "sdpa (flash only)"
        rows.append(row)
    cps = [("ringfa4 cp=1", ringfa4.ContextParallel(backend="fa4"))]
    if a.sim:
        cps.append((f"ringfa4 simulated P={a.sim}", ringfa4.ContextParallel.simulated(a.sim, backend="fa4")))
    for name, cp in cps:
        row, _ = run_row(model, ids, rhf.NAME, rhf.CPMeta(cp), a.reps, ref)
        row["impl"] = name
        rows.append(row)
        print(row, flush=True)
    meta = {"seq": a.seq, "layers": a.layers, "device": torch.cuda.get_device_name(),
            "transformers": __import__("transformers").__version__, "torch": torch.__version__}
    print(f"\nLlama-3.1-8B shape, {a.layers} layers, {a.seq} tokens, bf16, full fine-tune, checkpointing")
    print(f"{'impl':<26}{'loss':>10}{'grad norm':>11}{'|dg|/|g|':>10}{'worst w':>9}{'step s':>8}{'peak GiB':>9}")
    for r in rows:
        print(f"{r['impl']:<26}{r['loss']:>10.5f}{r['grad_norm']:>11.4f}{r.get('grad_rel_diff', 0):>10.2e}"
              f"{r.get('worst_weight_rel_diff', 0):>9.1e}{r['step_s']:>8.2f}{r['peak_gib']:>9.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
