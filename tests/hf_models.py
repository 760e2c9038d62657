"""Tiny transformers models from config (random weights, seeded) and their float32 reference loss
and gradients on the full batch, for the HF integration tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_model(kind: str, seed: int = 0):
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, use_cache=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":  # layer 0 slides (window 7), layer 1 is full
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=7,
                                             layer_types=["sliding_attention", "full_attention"]))
    elif kind == "gemma2":  # softcap, alternating sliding layers
        model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=16, attn_logit_softcapping=30.0,
                                               final_logit_softcapping=None, sliding_window=6,
                                               query_pre_attn_scalar=16))
    elif kind == "mistral":  # sliding window on every layer
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=9))
    elif kind == "qwen3":  # q/k norms, layer 0 slides
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, use_sliding_window=True, sliding_window=5,
                                             layer_types=["sliding_attention", "full_attention"]))
    elif kind == "gemma3":  # local (sliding) and global layers with their own RoPE
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                                   layer_types=["sliding_attention", "full_attention"]))
    elif kind == "gemma3_bidi":  # bidirectional attention (EmbeddingGemma-style), sliding |i - j| < 6
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                                   layer_types=["sliding_attention", "full_attention"],
                                                   use_bidirectional_attention=True))
    elif kind == "gpt_oss":  # learnable sinks, sliding and full layers, a small MoE
        from transformers import GptOssConfig, GptOssForCausalLM

        cfg = dict(common, intermediate_size=64, max_position_embeddings=131072)
        model = GptOssForCausalLM(GptOssConfig(**cfg, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=6, layer_types=["sliding_attention", "full_attention"]))
        with torch.no_grad():  # sinks that matter (the init draws them near 0)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.5)
    elif kind == "modernbert":  # encoder: bidirectional global and local (|i - j| <= 4) layers
        from transformers import ModernBertConfig, ModernBertForMaskedLM

        model = ModernBertForMaskedLM(ModernBertConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=512, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, attention_dropout=0.0))
    else:
        raise ValueError(kind)
    return model.float()


def reference_loss_and_grads(model, ids: torch.Tensor, lengths: list[int] | None):
    """Single-process eager attention: mean next-token loss over the batch (per document when
    packed) and the parameter gradients."""
    model.set_attn_implementation("eager")
    model.zero_grad()
    if lengths is None:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    else:
        total, count, start = 0.0, 0, 0
        for n in lengths:
            if n > 1:
                logits = model(input_ids=ids[:, start:start + n], use_cache=False).logits
                total = total + F.cross_entropy(logits[0, :-1].float(), ids[0, start + 1:start + n], reduction="sum")
                count += n - 1
            start += n
        loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batch_for(lengths: list[int] | None, S: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        return {"input_ids": torch.randint(0, 128, (2, S), generator=g)}
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=g)
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}
