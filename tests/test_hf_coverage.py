"""Model coverage in ``ringfa4.hf``: gpt-oss (learnable sinks; sliding and full layers) and
bidirectional layers (Gemma3 with bidirectional attention, ModernBERT's encoder with masked-LM
labels and key padding) under ring, Ulysses and hybrid CP, packed and not: loss equal to the
single-process eager model within 1e-5, gradients (sinks included) within 1e-5 relative."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import hf_models  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ringfa4  # noqa: E402
import ringfa4.hf as rhf  # noqa: E402

TOL = 1e-5


def _compare(model, ref_grads, ref_loss, loss):
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    for name, p in model.named_parameters():
        r = ref_grads.get(name)
        if r is not None and r.norm() > 0:
            assert ((p.grad - r).norm() / r.norm()).item() < TOL, name


def _cp_loss(model, batch, P, U, **shard_kw):
    rhf.register()
    model.set_attn_implementation("ringfa4")
    model.zero_grad()
    cp = ringfa4.ContextParallel.simulated(P, backend="reference", ulysses=U)
    shard = rhf.shard_batch(batch, cp, **shard_kw)
    loss, _ = rhf.causal_lm_loss(model(**shard.model_inputs()).logits, shard)
    loss.backward()
    return loss


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma3_bidi"])
@pytest.mark.parametrize("lengths", [None, [10, 1, 20, 17]], ids=["dense", "packed"])
@pytest.mark.parametrize("P,U", [(2, 1), (4, 1), (4, 2)])
def test_simulated_cp_equals_eager(kind, lengths, P, U):
    ref = hf_models.make_model(kind)
    batch = hf_models.batch_for(lengths, 48)
    ref_loss, ref_grads = hf_models.reference_loss_and_grads(ref, batch["input_ids"], lengths)
    model = copy.deepcopy(ref)
    _compare(model, ref_grads, ref_loss, _cp_loss(model, batch, P, U))
    if kind == "gpt_oss":
        assert all(layer.self_attn.sinks.grad.abs().sum() > 0 for layer in model.model.layers)


def _masked_lm_reference(model, ids, labels, mask):
    model.set_attn_implementation("eager")
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("P,U", [(2, 1), (4, 2)])
@pytest.mark.parametrize("padded", [False, True])
def test_masked_lm_encoder(P, U, padded):
    """ModernBERT (bidirectional, local layers |i - j| <= 4) with masked-LM labels
    (``shift_labels=False``); with right padding masked as keys (``key_padding=True``: each row and
    its padding become documents of one packed row) against eager with the attention mask."""
    ref = hf_models.make_model("modernbert")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    labels = torch.where(torch.rand(2, 40, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, 31:] = 0
        mask[1, 23:] = 0
        labels = labels.masked_fill(mask == 0, -100)
    ref_loss, ref_grads = _masked_lm_reference(ref, ids, labels, mask)
    model = copy.deepcopy(ref)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    loss = _cp_loss(model, batch, P, U, shift_labels=False, key_padding=True)
    _compare(model, ref_grads, ref_loss, loss)


def test_key_padding_documents():
    """key_padding turns each row's real tokens and its padding into documents of one packed row."""
    cp = ringfa4.ContextParallel.simulated(2, backend="reference")
    ids = torch.arange(12).view(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    shard = rhf.shard_batch({"input_ids": ids, "attention_mask": mask}, cp, shift_labels=False, key_padding=True)
    assert list(shard.meta.packing.packing.doc_lengths) == [4, 2, 6, 0]
    assert shard.input_ids.shape == (1, 12) and shard.num_targets == 10
    assert shard.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5]]


def test_gloo_gpt_oss_cp2(pools):
    res = pools(2).run("hf_case", "gpt_oss", None, 32, 1, timeout=240)
    assert all(status == "ok" for status, _ in res), res
    for _, v in res:
        assert abs(v["logged"] - v["ref"]) <= TOL * abs(v["ref"]), v
        assert v["grad_rel"] < TOL, v


def test_autocast_casts_q_k_v_alike():
    """Under bf16 autocast on float32 weights, RoPE leaves q / k in float32 and v in bf16: the
    attention casts all three to the autocast dtype (as SDPA does), and the CP loss matches the
    eager model's under the same autocast to bf16 accuracy."""
    rhf.register()
    ref = hf_models.make_model("llama")
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref.set_attn_implementation("eager")
        logits = ref(input_ids=ids).logits
        want = F.cross_entropy(logits[:, :-1].float().reshape(-1, 128), ids[:, 1:].reshape(-1))
        model = copy.deepcopy(ref)
        model.set_attn_implementation("ringfa4")
        cp = ringfa4.ContextParallel.simulated(2, backend="reference")
        shard = rhf.shard_batch({"input_ids": ids}, cp)
        loss, _ = rhf.causal_lm_loss(model(**shard.model_inputs()).logits, shard)
    assert abs(loss.item() - want.item()) <= 2e-2 * abs(want.item()), (loss.item(), want.item())
