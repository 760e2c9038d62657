"""The lean RMSNorm equals transformers' Llama RMSNorm (forward bit for bit; gradients to rounding)
and keeps less for backward (its 16-bit input and one float a token instead of an fp32 copy)."""

import pytest
import torch

from ringfa4.memory import lean_rmsnorm, lean_rmsnorm_in_place

transformers = pytest.importorskip("transformers")


def _norm(dtype, seed=0):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    m = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
    return m


@pytest.mark.parametrize("rows_per_slice", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lean_rmsnorm_matches_transformers(dtype, rows_per_slice, monkeypatch):
    """Also with the rows in slices of 5 (74 rows: 15 slices, the last one short)."""
    from ringfa4.memory import lean_norm

    if rows_per_slice:
        monkeypatch.setattr(lean_norm, "SLICE_ELEMENTS", 64 * rows_per_slice)
    ref = _norm(dtype)
    x = (torch.randn(2, 37, 64, dtype=torch.float64) * 3).to(dtype)
    dy = torch.randn(2, 37, 64, dtype=torch.float64).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = ref(x1)
    y2 = lean_rmsnorm(x2, ref.weight, ref.variance_epsilon)
    assert torch.equal(y1, y2)  # same ops in the same order
    gw1 = torch.autograd.grad(y1, (x1, ref.weight), dy)
    gw2 = torch.autograd.grad(y2, (x2, ref.weight), dy)
    # transformers computes this norm in fp32 whatever the input (float64 too): fp32-level agreement
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(gw1, gw2):
        assert (a.double() - b.double()).norm() <= tol * a.double().norm(), (dtype, a.dtype)


@pytest.mark.parametrize("rows_per_slice", [None, 5])
def test_lean_rmsnorm_fp32_weight_on_bf16_input(rows_per_slice, monkeypatch):
    """An fp32 weight on bf16 activations (peft's k-bit preparation upcasts norms) gives an fp32
    output, as transformers' norm does: equal values, gradients to rounding."""
    from ringfa4.memory import lean_norm

    if rows_per_slice:
        monkeypatch.setattr(lean_norm, "SLICE_ELEMENTS", 64 * rows_per_slice)
    ref = _norm(torch.float32)
    x = (torch.randn(2, 37, 64) * 3).to(torch.bfloat16)
    dy = torch.randn(2, 37, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), lean_rmsnorm(x2, ref.weight, ref.variance_epsilon)
    assert y1.dtype == y2.dtype == torch.float32 and torch.equal(y1, y2)
    for a, b in zip(torch.autograd.grad(y1, (x1, ref.weight), dy), torch.autograd.grad(y2, (x2, ref.weight), dy)):
        assert a.dtype == b.dtype and (a.double() - b.double()).norm() <= 1e-2 * a.double().norm()


def test_lean_rmsnorm_gradient_against_float64_math():
    """Against the exact derivative (float64 autograd of the same formula): fp32-level error."""
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    dy = torch.randn(3, 5, 64, dtype=torch.float64)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    exact = wa * (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + 1e-6))
    want = torch.autograd.grad(exact, (xa, wa), dy)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(lean_rmsnorm(xb, wb, 1e-6), (xb, wb), dy)
    for a, b in zip(want, got):
        assert (a - b).norm() <= 1e-6 * a.norm()


def test_lean_rmsnorm_saves_less_and_patches_in_place():
    ref = _norm(torch.bfloat16)
    x = torch.randn(1, 256, 64, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x)
        return sum(seen.values())

    plain = saved_bytes(ref)
    model = torch.nn.Sequential(ref)
    assert lean_rmsnorm_in_place(model) == 1
    lean = saved_bytes(ref)
    hidden = x.numel() * 2
    assert plain >= 3 * hidden and lean <= hidden + 256 * 4 + 64 * 2 + 64, (plain, lean)


def _saved_units(lora_fp32: bool, lean: bool) -> float:
    """Bytes a Llama decoder layer (LoRA r=16 on q/k/v/o, tiled MLP) keeps for backward, in units of
    one (tokens x hidden) bf16 tensor, weights excluded."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import ringfa4
    import ringfa4.hf as rhf

    torch.manual_seed(0)
    H, n = 256, 4096
    cfg = LlamaConfig(vocab_size=512, hidden_size=H, intermediate_size=896, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, use_cache=False)
    rhf.register(ringfa4.ContextParallel(backend="reference"))
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.set_attn_implementation(rhf.NAME)
    lora = LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    m = get_peft_model(m, lora, autocast_adapter_dtype=lora_fp32).train()
    rhf.enable_long_context(m, mlp_tile=1024, lean_norms=lean, fold_mlp_norm=lean)
    layer = m.get_base_model().model.layers[0]
    layer.gradient_checkpointing = False  # count what one forward keeps
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
    x = torch.randn(1, n, H, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(n)[None]
    pe = m.get_base_model().model.rotary_emb(x, pos)
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=pe, position_ids=pos)
    return sum(seen.values()) / (n * H * 2)


def test_decoder_layer_keeps_less_with_lean_norms_and_model_dtype_lora():
    """The working set that capped the H200 capacity runs: with peft's fp32 LoRA factors and
    transformers' norms a layer keeps ~16.3 hidden-size tensors per token; with LoRA in bf16, lean
    norms and the MLP's norm folded into its tiles ~6.1 (at 1M tokens and H = 4096, 80 GiB less)."""
    heavy, lean = _saved_units(True, False), _saved_units(False, True)
    assert heavy > 15 and lean < 6.5, (heavy, lean)
