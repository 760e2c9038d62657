"""recipes/finetune.py on CPU gloo with a tiny Llama: cp-invariance, exact resume, export, config
errors, and a dry run of every finetune config."""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys

import pytest
from dist_pool import Pool

pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "recipes"))

import config  # noqa: E402
import finetune  # noqa: E402

STEPS = ["train.steps=3", "train.seq_len=96"]


def _losses(res):
    assert all(status == "ok" for status, _ in res), res
    return [(m["loss"], m["grad_norm"]) for m in res[0][1]["metrics"]]


@pytest.fixture(scope="module")
def single():
    pool = Pool(1)
    yield pool
    pool.close()


def test_cp_invariance(pools, single):
    base = _losses(single.run("recipe_run", STEPS + ["parallel.cp=1"], timeout=240))
    for world, extra in ((2, ["parallel.cp=2"]), (4, ["parallel.cp=4"]), (4, ["parallel.cp=4", "parallel.ulysses=2"])):
        got = _losses(pools(world).run("recipe_run", STEPS + extra, timeout=240))
        for (l0, g0), (l1, g1) in zip(base, got):
            assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (world, extra, base, got)
    dp1 = _losses(pools(2).run("recipe_run", STEPS + ["parallel.dp=2"], timeout=240))
    dp2cp2 = _losses(pools(4).run("recipe_run", STEPS + ["parallel.dp=2", "parallel.cp=2"], timeout=240))
    for (l0, g0), (l1, g1) in zip(dp1, dp2cp2):
        assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (dp1, dp2cp2)


def test_resume_is_bit_exact(pools, tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    common = ["train.seq_len=96", "parallel.cp=2", "checkpoint.every=2"]
    full = _losses(pools(2).run("recipe_run", common + ["train.steps=4", f'checkpoint.dir="{full_dir}"']))
    _losses(pools(2).run("recipe_run", common + ["train.steps=4", "train.stop_after=2", f'checkpoint.dir="{cut_dir}"']))
    resumed = _losses(pools(2).run("recipe_run", common + ["train.steps=4", f'checkpoint.dir="{cut_dir}"']))
    assert resumed == full[2:], (full, resumed)


def test_export_reloads_with_from_pretrained(pools, tmp_path):
    res = pools(2).run("recipe_run", STEPS + ["parallel.cp=2", f'checkpoint.export="{tmp_path / "export"}"'], True)
    assert all(status == "ok" for status, _ in res), res
    assert res[0][1]["export_diff"] == 0.0


@pytest.mark.parametrize("overrides,message", [
    (["parallel.cp=3"], "parallel.dp x parallel.cp must equal the world size 2"),
    (["parallel.cp=2", "train.seq_len=90"], "train.seq_len must be a multiple of 4"),
    (["parallel.cp=2", "parallel.ulysses=3"], "parallel.ulysses must divide parallel.cp 2"),
])
def test_config_errors_fail_fast(overrides, message):
    cfg = finetune.load_config(None, overrides)
    with pytest.raises(ValueError, match=message):
        finetune.check_config(cfg, 2)


def test_unknown_keys_fail_fast(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key train.stepz \(known: \[.*'steps'"):
        finetune.load_config(None, ["train.stepz=3"])
    with pytest.raises(ValueError, match="section.key=value"):
        finetune.load_config(None, ["steps=3"])
    with pytest.raises(ValueError, match=r"unknown config section \[trian\] \(known: \[.*'train'"):
        finetune.load_config(None, ["trian.steps=3"])
    toml = tmp_path / "bad.toml"
    toml.write_text("[train]\nsteps = 3\n\n[lgo]\nwandb = 'disabled'\n")
    with pytest.raises(ValueError, match=r"unknown config section \[lgo\]"):
        finetune.load_config(str(toml))
    toml.write_text("[parallel]\ncp = 2\nrings = 2\n")
    with pytest.raises(ValueError, match=r"unknown config key parallel.rings \(known: \[.*'ulysses'"):
        finetune.load_config(str(toml))
    toml.write_text("train = 3\n")
    with pytest.raises(ValueError, match="config key train must be a table"):
        finetune.load_config(str(toml))


@pytest.mark.parametrize("override,message", [
    ("train.steps=1.5", "train.steps must be an int, got 1.5"),
    ("train.steps=true", "train.steps must be an int, got True"),
    ('train.lr="fast"', "train.lr must be a float"),
    ("log.progress=1", "log.progress must be a bool, got 1"),
    ("parallel.layout=2", "parallel.layout must be a string, got 2"),
    ("train.lora_targets=[1]", r"train.lora_targets\[0\] must be a string"),
    ("train.compile=3", "train.compile must be a bool or a string"),
    ("model.config=3", "model.config must be a table"),
])
def test_wrong_types_fail_fast(override, message):
    with pytest.raises(ValueError, match=message):
        finetune.load_config(None, [override])


def test_typed_config_values():
    cfg = finetune.load_config(None, ["train.lr=1", "train.ckpt_gpu_budget_gib=2", 'train.compile="aot_eager"',
                                      'model.config={model_type = "llama", hidden_size = 32}'])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # ints are taken for float fields
    assert cfg.train.ckpt_gpu_budget_gib == 2.0 and cfg.train.compile == "aot_eager"
    assert cfg.model.config == {"model_type": "llama", "hidden_size": 32}  # free-form, replaced whole
    assert finetune.FinetuneConfig().train.steps == 5 and finetune.load_config(None).parallel.layout == "zigzag"
    assert cfg.to_dict()["train"]["lr"] == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3


def test_cp_table_reaches_ring_options(tmp_path):
    from ringfa4.options import RingOptions

    recipe = RingOptions(metadata_check="new_shapes")  # the recipes' ranks shard one batch: checked once per key
    assert finetune.ring_options(finetune.load_config(None)) == recipe
    assert finetune.ring_options(finetune.load_config(None, ['cp.bwd_ring="q"'])) == recipe.replace(bwd_ring="q")
    told = finetune.load_config(None, ['cp.metadata_check="every_call"'])
    assert finetune.ring_options(told) == RingOptions()
    toml = tmp_path / "cp.toml"
    toml.write_text("[cp]\nbwd_ring = 'q'\ndkv_groups = 1\ntimeout_s = 60\nfp32_partials = false\n")
    cfg = finetune.load_config(str(toml), ['cp.bwd_ring="kv"', "cp.nvlink_domain=4"])
    opts = finetune.ring_options(cfg)
    assert opts == recipe.replace(bwd_ring="kv", dkv_groups=1, timeout_s=60.0, fp32_partials=False, nvlink_domain=4)
    assert isinstance(opts.timeout_s, float)


def test_run_uses_the_cp_table(pools):
    """The [cp] table reaches the run's ContextParallel; the q-side backward ring with one head group
    gives the default run's losses and gradient norms."""
    base = pools(2).run("recipe_run", STEPS + ["parallel.cp=2"], timeout=240)
    res = pools(2).run("recipe_run", STEPS + ["parallel.cp=2", 'cp.bwd_ring="q"', "cp.dkv_groups=1",
                                             "cp.timeout_s=90"], timeout=240)
    used = res[0][1]["metrics"][0]["cp_options"]
    assert used["bwd_ring"] == "q" and used["dkv_groups"] == 1 and used["timeout_s"] == 90.0, used
    assert base[0][1]["metrics"][0]["cp_options"]["bwd_ring"] == "auto"
    for (l0, g0), (l1, g1) in zip(_losses(base), _losses(res)):
        assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (base, res)


@pytest.mark.parametrize("toml_cp,override,message", [
    ("dkv_groups = 0", None, r"\[cp\].*dkv_groups"),
    (None, "cp.dkv_groups=0", r"\[cp\].*dkv_groups"),
    (None, 'cp.bwd_ring="sideways"', r"\[cp\].*bwd_ring"),
    (None, "cp.timeout_s=0", r"\[cp\].*timeout_s"),
    ("ring_slots = 2", None, r"\[cp\].*unknown option.*ring_slots.*known:.*bwd_ring"),
])
def test_bad_cp_values_fail_fast(tmp_path, toml_cp, override, message):
    path = None
    if toml_cp:
        path = tmp_path / "cp.toml"
        path.write_text(f"[cp]\n{toml_cp}\n")
    with pytest.raises(ValueError, match=message):
        finetune.load_config(path and str(path), [override] if override else [])


@pytest.mark.parametrize("path", sorted(p for p in glob.glob(os.path.join(ROOT, "recipes", "configs", "*.toml"))
                                        if "[train]" in open(p).read()))
def test_dry_run_every_config(path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune.py"), path, "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "mesh: dp=" in r.stdout and "CP plan" in r.stdout and "memory estimate" in r.stdout


def test_lora_is_cp_invariant_and_exports_merged(pools, single, tmp_path):
    lora = STEPS + ["train.lora_r=4", "train.lr=1e-2"]
    base = _losses(single.run("recipe_run", lora + ["parallel.cp=1"], timeout=240))
    got = pools(2).run("recipe_run", lora + ["parallel.cp=2", f'checkpoint.export="{tmp_path / "lora"}"'], True)
    for (l0, g0), (l1, g1) in zip(base, _losses(got)):
        assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (base, got)
    assert base[-1][0] < base[0][0]  # the adapters learn
    assert got[0][1]["export_diff"] == 0.0 and got[0][1]["lora_changed"]  # merged weights differ from base


def test_compiled_layers_match_eager(pools):
    eager = _losses(pools(2).run("recipe_run", STEPS + ["parallel.cp=2"], timeout=240))
    compiled = _losses(pools(2).run("recipe_run", STEPS + ["parallel.cp=2", 'train.compile="aot_eager"'],
                                    timeout=400))
    for (l0, g0), (l1, g1) in zip(eager, compiled):
        assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (eager, compiled)


def test_activation_checkpointing_and_text_data_are_cp_invariant(pools, single, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: " + "lorem ipsum dolor sit amet " * (i + 3) for i in range(6)))
    args = STEPS + ["train.activation_checkpointing=true", "train.mlp_tile=7", 'data.kind="text"',
                    f'data.path="{corpus}"']
    base = _losses(single.run("recipe_run", args + ["parallel.cp=1"], timeout=240))
    got = _losses(pools(2).run("recipe_run", args + ["parallel.cp=2"], timeout=240))
    for (l0, g0), (l1, g1) in zip(base, got):
        assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (base, got)


def test_memory_tools_leave_losses_unchanged(pools):
    """cp=2 (FSDP2 over gloo): tiled loss, tiled MLP, host-held and rebuilt layer inputs and cached
    attention outputs give the plain run's losses and gradient norms."""
    common = STEPS + ["parallel.cp=2", "train.activation_checkpointing=true"]
    plain = _losses(pools(2).run("recipe_run", common, timeout=240))
    tools = ["train.tiled_loss=40", "train.mlp_tile=16", "train.ckpt_gpu_budget_gib=0.000017", "train.ckpt_group=2",
             "train.ckpt_host_budget_gib=0.000014", "train.cache_attention=true"]  # 1 input: 11.7e-6 GiB
    res = pools(2).run("recipe_run", common + tools, timeout=240)
    got = _losses(res)
    plan = res[0][1]["metrics"][0]["checkpointing"]
    assert "0 on GPU, 1 on host, 1 rebuilt (group 2), attention outputs cached" in plan, plan
    for (l0, g0), (l1, g1) in zip(plain, got):
        assert abs(l0 - l1) <= 1e-5 * abs(l0) and abs(g0 - g1) <= 1e-4 * abs(g0), (plain, got)


def test_attention_length_of_packed_rows():
    """MFU's attention term uses sum(len^2) / sum(len) of the packed documents, not seq_len."""
    import torch

    assert finetune._attention_length(torch.tensor([[0, 1, 2, 3, 0, 1]])) == (16 + 4) / 6
    assert finetune._attention_length(torch.arange(8)[None]) == 8
    full, packed = (finetune._flops_per_token(finetune.build_model(finetune.load_config(None, []))[0].config, t)
                    for t in (256, 16))
    assert packed < full


def test_static_shapes_turn_cuda_graphs_on():
    """On GPUs the recipe captures the ring when every step has the same shapes (one passkey document
    a row: the rule holds for the stream itself), there is a ring, a rank's chunk is short and the
    [cp] table says nothing; the table's value wins; packed documents, long chunks, Ulysses alone and
    CPU runs stay eager."""
    from data import ByteTokenizer, PackedStream, passkey_document

    from ringfa4.options import RingOptions

    eager = RingOptions(metadata_check="new_shapes")  # the recipes' default besides graphs

    encode = ByteTokenizer(256).encode
    for seq_len in (64, 256, 1000):
        cfg = finetune.load_config(None, [f"train.seq_len={seq_len}", f"data.doc_tokens={seq_len}",
                                          "parallel.cp=2"])
        assert config.static_shapes(cfg) and config.graphs_by_default(cfg)
        stream = PackedStream(lambda i, n=seq_len: passkey_document(i, 0, n, encode), seq_len, 0, 1)
        for _ in range(5):
            assert stream.next_batch()["position_ids"][0].tolist() == list(range(seq_len))  # one document a row
        assert finetune.ring_options(cfg, cuda=True) == eager.replace(cuda_graphs=True)
        assert finetune.ring_options(cfg) == eager  # CPU: eager
    packed = finetune.load_config(None, ["train.seq_len=256", "data.doc_tokens=100", "parallel.cp=2"])
    assert not config.static_shapes(packed) and finetune.ring_options(packed, cuda=True) == eager
    told = finetune.load_config(None, ["train.seq_len=64", "data.doc_tokens=64", "parallel.cp=2",
                                       "cp.cuda_graphs=false"])
    assert finetune.ring_options(told, cuda=True) == eager
    n = 2 * config.GRAPHS_UP_TO
    for args in (["parallel.cp=2", f"train.seq_len={2 * n}"],  # 2 x GRAPHS_UP_TO tokens a rank
                  ["parallel.cp=1", "train.seq_len=64"], ["parallel.cp=2", "parallel.ulysses=2", "train.seq_len=64"]):
        cfg = finetune.load_config(None, args + [f"data.doc_tokens={n * 2}"])
        assert config.static_shapes(cfg) and finetune.ring_options(cfg, cuda=True) == eager, args
