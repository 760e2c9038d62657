"""Packs of new document lengths compile no new kernel (issue 22 item 4), on the GPU (H200).

The public API, packed bf16 documents, forward and backward on a simulated CP of 4 ranks: after 3
warm-up packs, 20 more packs with other seeded random document lengths (1..3000 tokens, a few
thousand in all) leave ``ringfa4.kernels.fa4.compile_count()`` (ringfa4's and FA4's compile caches)
where it was.
"""

import random

import pytest
import torch
from helpers import random_cu_seqlens

import ringfa4

pytestmark = pytest.mark.gpu


def _lengths(rng: random.Random) -> list[int]:
    """Mixed document lengths (1..3000, many short) totalling about 3000-7000 tokens."""
    target, out = rng.randint(3000, 7000), []
    while sum(out) < target:
        out.append(rng.choice([rng.randint(1, 8), rng.randint(9, 300), rng.randint(301, 3000)]))
    return out


def _step(cp, lengths: list[int], seed: int) -> None:
    cu = random_cu_seqlens(lengths, device="cuda")
    total = sum(lengths)
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(total, n, 128, generator=g).to("cuda", torch.bfloat16) for n in (8, 2, 2, 8))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ringfa4.attention(q, k, v, cp=cp, causal=True, packing=cp.pack(cu))
    out.backward(do)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_new_packs_compile_nothing():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the pack-independent fp32 varlen kernels run on sm90 (Hopper)")
    from ringfa4.kernels.fa4 import compile_count

    cp = ringfa4.ContextParallel.simulated(world_size=4)
    rng = random.Random(22)
    for i in range(3):
        _step(cp, _lengths(rng), i)
    warm = compile_count()
    assert warm > 0, "nothing compiled: the fa4 backend did not run"
    grown = []
    for i in range(20):
        lengths = _lengths(rng)
        _step(cp, lengths, 100 + i)
        if compile_count() != warm:
            grown.append((i, len(lengths), max(lengths), compile_count() - warm))
            warm = compile_count()
    assert not grown, f"packs (index, documents, longest, new kernels) that compiled: {grown}"
