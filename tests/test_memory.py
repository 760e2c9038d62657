"""Million-token memory tools equal the untiled computation (loss, outputs and gradients)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringfa4.memory import TiledMLP, tiled_apply, tiled_causal_lm_loss


def _loss_inputs(dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 37, 16, generator=g, dtype=dtype)
    w = torch.randn(50, 16, generator=g, dtype=dtype) * 0.3
    b = torch.randn(50, generator=g, dtype=dtype) if bias else None
    t = torch.randint(0, 50, (2, 37), generator=g)
    t[0, 5:9] = -100
    t[1, -1] = -100
    return h, w, b, t


def _untiled(h, w, b, t, n, softcap):
    logits = F.linear(h, w, b)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.reshape(-1, 50), t.reshape(-1), ignore_index=-100, reduction="sum") / n


@pytest.mark.parametrize("chunk", [1, 7, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_tiled_loss_equals_untiled(chunk, bias, softcap, dtype, tol):
    h, w, b, t = _loss_inputs(dtype, bias)
    n = int((t != -100).sum())
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    ref = _untiled(*[x.double() for x in leaves[:2]], leaves[2].double() if bias else None, t, n, softcap)
    ref.backward()
    mine = [x.detach().clone().requires_grad_() for x in leaves]
    got = tiled_causal_lm_loss(mine[0], mine[1], t, n, bias=mine[2] if bias else None, chunk=chunk,
                               logit_softcap=softcap)
    got.backward()
    assert abs(got.item() - ref.item()) <= tol * abs(ref.item())
    for a, r in zip(mine, leaves):
        assert ((a.grad.double() - r.grad.double()).norm() / r.grad.double().norm()).item() <= tol


def test_tiled_loss_token_weighting_across_cp_shards():
    """Per-shard losses over the global target count sum to the full loss (as CP ranks do)."""
    h, w, _, t = _loss_inputs(torch.float64, False, seed=3)
    n = int((t != -100).sum())
    full = tiled_causal_lm_loss(h, w, t, n, chunk=8)
    parts = sum(tiled_causal_lm_loss(h[:, i::3], w, t[:, i::3], n, chunk=5) for i in range(3))
    assert abs(full.item() - parts.item()) < 1e-12
    with pytest.raises(ValueError, match="targets must have hidden's leading shape"):
        tiled_causal_lm_loss(h, w, t[:, :3], n)


class _GatedMLP(nn.Module):
    def __init__(self, hidden=16, inter=40):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter), \
            nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("tile", [1, 5, 64])
def test_tiled_mlp_equals_untiled(tile):
    torch.manual_seed(0)
    mlp = _GatedMLP().double()
    ref_mlp = copy.deepcopy(mlp)
    x = torch.randn(2, 23, 16, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = tiled_apply(mlp, x, tile)
    yr = ref_mlp(xr)
    assert torch.allclose(y, yr, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    assert torch.allclose(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    for p, r in zip(mlp.parameters(), ref_mlp.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-10, atol=1e-12)


def test_tiled_mlp_in_a_transformers_model():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ref = LlamaForCausalLM(cfg).double()
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        layer.mlp = TiledMLP(layer.mlp, tile=7)
    ids = torch.randint(0, 64, (1, 30))
    a = model(input_ids=ids, labels=ids).loss
    b = ref(input_ids=ids, labels=ids).loss
    a.backward()
    b.backward()
    assert abs(a.item() - b.item()) < 1e-12
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = grads[name.replace("mlp.mlp.", "mlp.")].grad
        assert torch.allclose(p.grad, r, rtol=1e-9, atol=1e-12), name


def test_enable_long_context_keeps_names_and_values():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import ringfa4.hf as rhf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ref = LlamaForCausalLM(cfg).double()
    # (lean and folded norms do fp32 math: tested elsewhere at that tolerance)
    model = rhf.enable_long_context(copy.deepcopy(ref), mlp_tile=6, lean_norms=False, fold_mlp_norm=False)
    assert list(model.state_dict()) == list(ref.state_dict())
    calls = []
    real = model.model.layers[0].mlp.down_proj.forward
    model.model.layers[0].mlp.down_proj.forward = lambda x: calls.append(x.shape[1]) or real(x)
    ids = torch.randint(0, 64, (1, 20))
    a, b = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    a.backward()
    b.backward()
    assert max(calls) <= 6 and abs(a.item() - b.item()) < 1e-12
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-9, atol=1e-12), name
