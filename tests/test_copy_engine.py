"""Same-GPU hops on the copy engines (parallel/copy_engine.py).

CPU: the switch's values, and pairs the batch cannot take fall back to ``copy_``.
GPU: batched copies are exact for several pieces and dtypes (mixed with non-contiguous pairs),
and keep stream order: a copy posted after a slow producer on the same stream sees its result.
"""

import pytest
import torch

from ringfa4.parallel.copy_engine import engine_copy_, loopback_copy


def test_switch_values(monkeypatch):
    monkeypatch.delenv("RINGFA4_LOOPBACK_COPY", raising=False)
    assert loopback_copy() == "engine"
    monkeypatch.setenv("RINGFA4_LOOPBACK_COPY", "torch")
    assert loopback_copy() == "torch"
    monkeypatch.setenv("RINGFA4_LOOPBACK_COPY", "ce")
    with pytest.raises(ValueError, match="RINGFA4_LOOPBACK_COPY"):
        loopback_copy()


def test_cpu_pairs_fall_back_to_copy():
    src = [torch.randn(5, 3), torch.arange(12).view(3, 4).t()]
    dst = [torch.zeros(5, 3), torch.zeros(4, 3, dtype=torch.long)]
    engine_copy_(list(zip(dst, src)), stream=None)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)


@pytest.mark.gpu
def test_engine_copies_are_exact_and_stream_ordered():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    src = [torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16),
           torch.randn(3, 4099, device="cuda", generator=g),
           torch.randn(64, 32, device="cuda", generator=g).t(),  # not contiguous: copy_
           torch.randint(0, 1 << 30, (777,), device="cuda", dtype=torch.int32, generator=g)]
    dst = [torch.full_like(s, 7) for s in src]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # ~10 ms: the copies must wait for the fills after it
        for s in src:
            s.add_(1)
        engine_copy_(list(zip(dst, src)), stream)
        done = stream.record_event()
    torch.cuda.current_stream().wait_event(done)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
