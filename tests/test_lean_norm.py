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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lean_rmsnorm_matches_transformers(dtype):
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
