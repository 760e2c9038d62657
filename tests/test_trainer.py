"""ringfa4.hf.Trainer and ringfa4.hf.SFTTrainer on CPU gloo with tiny Llama / Qwen2 models: loss
per step, gradient norm (clipped at 0.5), final weights and evaluate() equal, within 1e-5 relative,
to plain transformers.Trainer / trl.SFTTrainer on one process with the same global batch (dense and
packed; cp 2, cp 4, dp 2 x cp 2 under DDP; gradient accumulation 2); predictions gathered; resume
from a Trainer checkpoint; LoRA + gradient checkpointing + DataCollatorWithFlattening; the recipe;
the bad inputs, raised with the same message on every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

REL = 1e-5
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_REFERENCES: dict[tuple, dict] = {}


def _run(pool, spec: dict, out) -> list[dict]:
    res = pool.run("trainer_run", spec, str(out), timeout=300)
    assert all(status == "ok" for status, _ in res), res
    return [v for _, v in res]


def _reference(pools, tmp_path_factory, spec: dict) -> dict:
    """The plain trainer on one process (cached per spec)."""
    key = tuple(sorted((k, repr(v)) for k, v in spec.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(pools(1), spec, tmp_path_factory.mktemp("ref"))[0]
    return _REFERENCES[key]


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * abs(b)


def _assert_same_run(got: dict, ref: dict, clip: float = 0.5) -> None:
    assert len(got["losses"]) == len(ref["losses"]) >= 3, (got["losses"], ref["losses"])
    for a, b in zip(got["losses"], ref["losses"]):
        assert _close(a, b), (got["losses"], ref["losses"])
    for a, b in zip(got["grad_norms"], ref["grad_norms"]):
        assert _close(a, b), (got["grad_norms"], ref["grad_norms"])
    assert max(ref["grad_norms"]) > clip  # clipping was active
    rel = ((got["weights"] - ref["weights"]).norm() / ref["weights"].norm()).item()
    assert rel < REL, rel
    if "eval_loss" in ref:
        assert _close(got["eval_loss"], ref["eval_loss"]), (got["eval_loss"], ref["eval_loss"])


DENSE = {"kind": "llama", "eval": True, "predict": True}


@pytest.mark.parametrize("world,cp,per_device", [(2, 2, 2), (4, 4, 2), (4, 2, 1)], ids=["cp2", "cp4", "dp2xcp2"])
def test_trainer_dense_equals_single_process(pools, tmp_path_factory, tmp_path, world, cp, per_device):
    """Right-padded batches of 13..40 tokens (not layout multiples): global batch 2 rows a micro-batch."""
    ref = _reference(pools, tmp_path_factory, {**DENSE, "trainer": "plain", "per_device": 2})
    got = _run(pools(world), {**DENSE, "trainer": "trainer", "cp": cp, "per_device": per_device}, tmp_path)
    _assert_same_run(got[0], ref)
    assert got[0]["cp_plan"] == (cp, 1)  # dense rows, 4 heads, one node: Ulysses over the whole cp group
    assert got[0]["metadata_check"] == "new_shapes"  # no cp_options: checked once per batch shape
    assert all(_close(v["losses"][-1], ref["losses"][-1]) for v in got)  # every rank logs the global loss
    mine, theirs = got[0]["predictions"], ref["predictions"]
    assert mine.shape == theirs.shape, (mine.shape, theirs.shape)
    assert ((mine - theirs).norm() / theirs.norm()).item() < 1e-4  # logits of weights equal to ~1e-6
    row = got[0]["logs"][0]
    assert row["tokens_per_s_per_device"] > 0 and 0 < row["mfu"] < 1 and row["tflops_per_device"] > 0


SFT = {"kind": "qwen2", "trainer": "sft", "eval": True}


@pytest.mark.parametrize("world,cp", [(2, 2), (4, 4), (4, 2)], ids=["cp2", "cp4", "dp2xcp2"])
def test_sft_packed_equals_single_process(pools, tmp_path_factory, tmp_path, world, cp):
    """SFTConfig(packing=True): rows of up to 64 tokens holding several documents (Qwen2 with a
    sliding layer); the reference flattens the dp ranks' rows into one padding-free row (also in
    evaluation: the eval loss is over each step's dp-global batch). The trainer plans the ring alone
    for packed batches (``cp_packed`` from SFTConfig.packing), where dense rows get Ulysses."""
    dp = world // cp
    ref = _reference(pools, tmp_path_factory, {**SFT, "trainer": "plain_sft", "per_device": dp})
    import ringfa4

    got = _run(pools(world), {**SFT, "cp": cp, "per_device": 1, "cp_kwargs": {"cp_options": ringfa4.RingOptions()}},
               tmp_path)
    _assert_same_run(got[0], ref)
    assert got[0]["cp_plan"] == (1, cp)  # packing=True: the planner runs the ring alone
    assert got[0]["metadata_check"] == "every_call"  # given options are the run's own
    row = got[0]["logs"][0]
    assert _close(row["mean_token_accuracy"], ref["logs"][0]["mean_token_accuracy"], 1e-4), (row, ref["logs"][0])
    assert row["num_tokens"] == ref["logs"][0]["num_tokens"], (row, ref["logs"][0])


def test_resume_from_a_trainer_checkpoint(pools, tmp_path):
    """4 steps with a checkpoint at step 2; a fresh trainer resumed from it gives steps 3 and 4."""
    spec = {"kind": "llama", "trainer": "trainer", "cp": 2, "per_device": 2, "steps": 4, "save_steps": 2,
            "resume": 2}
    got = _run(pools(2), spec, tmp_path)[0]
    assert len(got["losses"]) == 4 and len(got["resumed"]) == 4, got  # (steps 1-2 from the checkpoint's state)
    for a, b in zip(got["resumed"], got["losses"]):
        assert _close(a, b, 1e-6), (got["losses"], got["resumed"])


def test_lora_checkpointing_and_flattening_collator(pools, tmp_path_factory, tmp_path):
    """peft LoRA, gradient checkpointing and transformers' DataCollatorWithFlattening (packed rows
    from a plain Trainer) at cp 2 equal the single-process run."""
    spec = {"kind": "llama", "lora": True, "checkpointing": True, "flatten": True, "per_device": 3, "lr": 2e-2,
            "clip": 0.1}
    ref = _reference(pools, tmp_path_factory, {**spec, "trainer": "plain"})
    got = _run(pools(2), {**spec, "trainer": "trainer", "cp": 2}, tmp_path)[0]
    _assert_same_run(got, ref, clip=0.1)
    assert got["cp_plan"] == (1, 2)  # the flattening collator's rows are packed: the ring alone


def test_long_context_option(pools, tmp_path_factory, tmp_path):
    """long_context=LongContext(mlp_tile=7) (tiled MLPs, our layer checkpointing) at cp 2 leaves
    the run unchanged."""
    import ringfa4.hf as rhf

    ref = _reference(pools, tmp_path_factory, {**DENSE, "trainer": "plain", "per_device": 2})
    spec = {**DENSE, "trainer": "trainer", "cp": 2, "per_device": 2, "predict": False,
            "cp_kwargs": {"long_context": rhf.LongContext(mlp_tile=7)}}
    _assert_same_run(_run(pools(2), spec, tmp_path)[0], {k: v for k, v in ref.items() if k != "predictions"})


@pytest.mark.parametrize("case,message", [
    ("cp_size", "cp_size must divide the world size 2 (dp x cp, cp inner), got 3: use one of [1, 2]"),
    ("dropout", "model.config.attention_dropout is 0.1"),
    ("implementation", "the model was loaded with attn_implementation='mine'"),
    ("packing_batch", "per_device_train_batch_size=2 with packing=True"),
    ("mask_4d", "the batch has a 4-D attention_mask"),
    ("mask_holes", "rank 1: the batch's attention_mask is not causal right padding"),
])
def test_bad_input_raises_on_every_rank(pools, tmp_path, case, message):
    res = pools(2).run("trainer_bad", case, str(tmp_path), timeout=180)
    assert all(status == "ValueError" for status, _ in res), res
    assert len({v for _, v in res}) == 1 and message in res[0][1], res


def test_recipe_trains_two_steps(pools):
    rows = pools(2).run("trainer_recipe_run", ["train.steps=2", "train.seq_len=256", "data.doc_tokens=100"],
                        timeout=300)
    assert all(status == "ok" for status, _ in rows), rows
    got = rows[0][1]
    assert [r["step"] for r in got] == [1, 2] and all(r["loss"] > 0 and r["mfu"] > 0 for r in got), got
    assert rows[1][1][-1]["loss"] == got[-1]["loss"]


def test_recipe_dry_run():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "trl_sft.py"),
                        os.path.join(ROOT, "recipes", "configs", "trl_sft_cpu.toml"), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "mesh: dp=1 x cp=2" in r.stdout and "SFTConfig: packing=True max_length=1024" in r.stdout, r.stdout


def test_import_is_lazy():
    code = ("import sys, ringfa4.hf as h; assert 'trl' not in sys.modules and 'accelerate' not in sys.modules; "
            "h.Trainer; assert 'trl' not in sys.modules; h.SFTTrainer; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_prepare_pads_dense_batches_and_checks_masks():
    """Dense rows pad to the layout multiple with no extra target; packed rows keep their length."""
    import ringfa4
    from ringfa4.hf.trainer_data import prepare_batch

    cp = ringfa4.ContextParallel.simulated(2, backend="reference")  # zigzag over 2: multiples of 4
    ids = torch.arange(2, 12).reshape(2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    prep, problem = prepare_batch({"input_ids": ids, "attention_mask": mask}, cp)
    assert problem is None and prep.shard.input_ids.shape == (2, 8) and prep.length == 5
    assert prep.shard.num_targets == 4 + 2 and prep.tokens == 8 and prep.attn_tokens == 25 + 9
    packed = {"input_ids": ids[:1], "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    prep, problem = prepare_batch(packed, cp)
    assert problem is None and prep.shard.num_targets == 3 and prep.attn_tokens == 9 + 4
    _, problem = prepare_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1, 2]] * 2)}, cp)
    assert "must be one row, got 2 rows" in problem
    _, problem = prepare_batch({"input_ids": ids, "attention_mask": mask.flip(1)}, cp)
    assert "not causal right padding" in problem


@pytest.mark.parametrize("planned_packed,ulysses,warns", [(False, 2, True), (True, 2, False), (False, 1, False)])
def test_packed_rows_under_a_ulysses_plan_say_cp_packed_once(planned_packed, ulysses, warns):
    """A trainer whose plan was made for unpacked rows with Ulysses in it (rows the user packed
    himself: no packing flag, no flattening collator) says once, at the first packed batch, to pass
    ``cp_packed=True``; dense batches, a plan made for packed rows or a ring-only plan say nothing."""
    import warnings

    import ringfa4
    from ringfa4.hf.trainer import ContextParallelMixin

    mixin = object.__new__(ContextParallelMixin)
    mixin.cp = ringfa4.ContextParallel.simulated(4, backend="reference", ulysses=ulysses)
    mixin.cp_size, mixin._cp_pad_id, mixin._cp_planned_packed = 4, 0, planned_packed
    ids = torch.arange(2, 10).reshape(1, 8)
    dense = {"input_ids": ids}
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mixin._cp_prepare([dense], torch.device("cpu"))
        assert not said
        for _ in range(2):
            mixin._cp_prepare([dict(packed)], torch.device("cpu"))
    told = [w for w in said if "cp_packed=True" in str(w.message)]
    assert len(told) == (1 if warns else 0), [str(w.message) for w in said]
    if warns:
        assert f"Ulysses {ulysses} x ring {4 // ulysses}" in str(told[0].message)
