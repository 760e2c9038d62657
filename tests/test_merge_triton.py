"""The fused Triton merge equals the torch merge: on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess since it is read at import), on the GPU natively."""

import pytest
import torch
from helpers import run_triton_script

SCRIPT = r"""
import math, torch
from ringfa4.kernels.merge import merge_lse_torch_
from ringfa4.kernels.merge_triton import merge_lse_triton_
g = torch.Generator().manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
worst = 0.0
for (b, s, h, d, dt, half) in [(2, 40, 3, 64, torch.bfloat16, False), (1, 33, 2, 80, torch.float32, True),
                               (2, 16, 4, 128, torch.float16, True)]:
    acc = torch.randn(b, 2 * s, h, d, generator=g).to(dev)
    lacc = torch.randn(b, h, 2 * s, generator=g).to(dev)
    blk = torch.randn(b, 2 * s, h, d, generator=g).to(dev, dt)
    lblk = torch.randn(b, h, 2 * s, generator=g).to(dev)
    lacc[:, :, :5] = -math.inf                      # empty accumulator rows
    lblk[:, :, 3:8] = -math.inf; blk[:, 3:8] = 0    # rows the block does not see
    sl = slice(s, 2 * s) if half else slice(0, 2 * s)
    a1, l1 = acc.clone(), lacc.clone()
    a2, l2 = acc.clone(), lacc.clone()
    merge_lse_torch_(a1[:, sl], l1[:, :, sl], blk[:, sl], lblk[:, :, sl])
    assert merge_lse_triton_(a2[:, sl], l2[:, :, sl], blk[:, sl], lblk[:, :, sl])
    assert not torch.isnan(a2).any() and not torch.isnan(l2).any()
    assert torch.equal(torch.isneginf(l1), torch.isneginf(l2))
    fin = torch.isfinite(l1)
    worst = max(worst, (a1 - a2).abs().max().item(), (l1[fin] - l2[fin]).abs().max().item())
    if not half:
        assert torch.equal(a2[:, 3:5], torch.zeros_like(a2[:, 3:5]))  # both sides empty: out 0
print("max abs diff", worst)
assert worst < 1e-5, worst
"""


def test_triton_merge_interpreted_on_cpu():
    pytest.importorskip("triton")
    r = run_triton_script(SCRIPT, interpret=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.gpu
def test_triton_merge_on_gpu():
    assert torch.cuda.is_available()
    r = run_triton_script(SCRIPT, interpret=False)
    assert r.returncode == 0, r.stdout + r.stderr
