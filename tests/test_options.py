"""RingOptions: validation on construction, from_env parsing, the metadata encoding, the warning for
RINGFA4_* variables that no longer steer the library, and that a ContextParallel's options are the
ones its calls run with (the gloo cross-rank check: test_ring.py's bad-input cases)."""

from __future__ import annotations

import dataclasses
import datetime
import warnings

import pytest
import torch
from helpers import random_qkv

import ringfa4
from ringfa4 import RingOptions
from ringfa4 import options as options_module
from ringfa4.kernels import AttnSpec

BAD = [
    ({"fp32_partials": 1}, r"RingOptions.fp32_partials must be True or False, got 1"),
    ({"fp32_grads": "yes"}, r"RingOptions.fp32_grads must be True or False, got 'yes'"),
    ({"epilogue_merge": None}, r"RingOptions.epilogue_merge must be True or False"),
    ({"bwd_ring": "both"}, r"RingOptions.bwd_ring must be one of \('auto', 'kv', 'q'\), got 'both'"),
    ({"dkv_groups": 0}, r"RingOptions.dkv_groups must be an int >= 1, got 0"),
    ({"dkv_groups": True}, r"RingOptions.dkv_groups must be an int >= 1, got True"),
    ({"dkv_wire": "bf16"}, r"RingOptions.dkv_wire must be one of \('fp32', 'input'\), got 'bf16'"),
    ({"merge_kernel": "cuda"}, r"RingOptions.merge_kernel must be one of \('auto', 'cute', 'triton', 'torch'\)"),
    ({"metadata_check": "never"}, r"RingOptions.metadata_check must be one of \('every_call', 'new_shapes'\)"),
    ({"timeout_s": 0}, r"RingOptions.timeout_s must be a finite number of seconds > 0, got 0"),
    ({"timeout_s": float("inf")}, r"RingOptions.timeout_s must be a finite number"),
    ({"nvlink_domain": 0}, r"RingOptions.nvlink_domain must be None or an int >= 1, got 0"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_values_name_the_field_and_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RingOptions(**kwargs)
    with pytest.raises(ValueError, match=message):
        RingOptions().replace(**kwargs)


def test_defaults_frozen_and_hashable():
    o = RingOptions()
    assert (o.fp32_partials, o.fp32_grads, o.epilogue_merge, o.bwd_ring, o.dkv_groups, o.dkv_wire,
            o.merge_kernel, o.timeout_s, o.nvlink_domain, o.cuda_graphs) == (
        True, True, True, "auto", 2, "fp32", "auto", 300.0, None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.dkv_groups = 3
    assert hash(o) == hash(RingOptions()) and o != o.replace(dkv_groups=1)


def test_from_env_parses_every_variable():
    env = {"RINGFA4_FP32_PARTIALS": "0", "RINGFA4_FP32_GRADS": "auto", "RINGFA4_EPILOGUE_MERGE": "0",
           "RINGFA4_BWD_RING": "q", "RINGFA4_DKV_GROUPS": "4", "RINGFA4_DKV_WIRE": "input",
           "RINGFA4_MERGE": "triton", "RINGFA4_TIMEOUT_S": "12.5", "RINGFA4_NVLINK_DOMAIN": "72",
           "RINGFA4_CUDA_GRAPHS": "1", "RINGFA4_METADATA_CHECK": "new_shapes", "RINGFA4_LAUNCH_TAPES": "off",
           "RINGFA4_LAUNCH_TAPE_MIB": "64", "OTHER": "x"}
    assert RingOptions.from_env(env) == RingOptions(
        fp32_partials=False, fp32_grads=True, epilogue_merge=False, bwd_ring="q", dkv_groups=4, dkv_wire="input",
        merge_kernel="triton", timeout_s=12.5, nvlink_domain=72, cuda_graphs=True, metadata_check="new_shapes",
        launch_tapes="off", launch_tape_mib=64)
    assert set(options_module.ENV_FIELDS) == {v for v in env if v != "OTHER"}
    assert {f for f, _ in options_module.ENV_FIELDS.values()} == set(RingOptions.field_names())
    assert RingOptions.from_env({}) == RingOptions()
    assert RingOptions.from_env({"RINGFA4_DKV_GROUPS": ""}) == RingOptions()  # empty: unset
    base = RingOptions(bwd_ring="kv")
    assert RingOptions.from_env({"RINGFA4_DKV_GROUPS": "1"}, base) == base.replace(dkv_groups=1)


@pytest.mark.parametrize("var,raw,message", [
    ("RINGFA4_FP32_GRADS", "yes", r"RINGFA4_FP32_GRADS='yes': must be 0, 1 or auto"),
    ("RINGFA4_DKV_GROUPS", "zero", r"RINGFA4_DKV_GROUPS='zero': must be an int >= 1"),
    ("RINGFA4_DKV_GROUPS", "0", r"RINGFA4_DKV_GROUPS: RingOptions.dkv_groups must be an int >= 1, got 0"),
    ("RINGFA4_BWD_RING", "both", r"RINGFA4_BWD_RING: RingOptions.bwd_ring must be one of"),
    ("RINGFA4_TIMEOUT_S", "soon", r"RINGFA4_TIMEOUT_S='soon'"),
    ("RINGFA4_LAUNCH_TAPE_MIB", "-1", r"RINGFA4_LAUNCH_TAPE_MIB='-1': must be an int >= 0"),
])
def test_from_env_names_the_bad_variable(var, raw, message):
    with pytest.raises(ValueError, match=message):
        RingOptions.from_env({var: raw})


def test_from_mapping_rejects_unknown_keys():
    assert RingOptions.from_mapping({"bwd_ring": "q"}) == RingOptions(bwd_ring="q")
    with pytest.raises(ValueError, match=r"\[cp\]: unknown option\(s\) \['slots'\]; known: \["):
        RingOptions.from_mapping({"slots": 4}, where="[cp]")


def test_encode_round_trips_every_field():
    o = RingOptions(fp32_partials=False, bwd_ring="q", dkv_groups=3, dkv_wire="input", merge_kernel="torch",
                    timeout_s=12.25, nvlink_domain=8, cuda_graphs=True, metadata_check="new_shapes")
    codes = o.encode()
    assert len(codes) == len(RingOptions.field_names()) and all(isinstance(c, int) for c in codes)
    assert {n: RingOptions.decode_field(n, c) for n, c in zip(RingOptions.field_names(), codes)} == \
        dataclasses.asdict(o)
    names = RingOptions.field_names()
    assert RingOptions.decode_field("nvlink_domain", RingOptions().encode()[names.index("nvlink_domain")]) is None


def test_set_variables_warn_once_naming_the_field(monkeypatch):
    monkeypatch.setattr(options_module, "_warned", set())
    env = {"RINGFA4_BWD_RING": "q", "RINGFA4_RING_SLOTS": "4", "RINGFA4_SOMETHING": "1", "PATH": "/bin"}
    with pytest.warns(UserWarning) as caught:
        said = options_module.warn_ignored_env(env)
    assert said == ["RINGFA4_BWD_RING", "RINGFA4_RING_SLOTS", "RINGFA4_SOMETHING"]
    text = [str(w.message) for w in caught]
    assert "RINGFA4_BWD_RING is set but no longer steers ringfa4: pass RingOptions(bwd_ring=...)" in text[0]
    assert "RINGFA4_RING_SLOTS" in text[1] and "removed" in text[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options_module.warn_ignored_env(env) == []  # once per variable


def test_a_set_variable_changes_nothing_but_warns(monkeypatch):
    """The variables stop steering the library: RINGFA4_FP32_PARTIALS=0 leaves the default (fp32
    partials) in place, bit for bit, and says so once."""
    monkeypatch.setattr(options_module, "_warned", set())
    q, k, v, _ = random_qkv(1, 64, 64, 4, 2, 16, dtype=torch.bfloat16, seed=2)
    want = ringfa4.attention(q, k, v, cp=ringfa4.ContextParallel.simulated(4, backend="reference"), causal=True)
    monkeypatch.setenv("RINGFA4_FP32_PARTIALS", "0")
    with pytest.warns(UserWarning, match="RINGFA4_FP32_PARTIALS is set but no longer steers ringfa4"):
        cp = ringfa4.ContextParallel.simulated(4, backend="reference")
    assert cp.options == RingOptions()
    assert torch.equal(ringfa4.attention(q, k, v, cp=cp, causal=True), want)
    off = ringfa4.ContextParallel.simulated(4, backend="reference", options=RingOptions(fp32_partials=False))
    assert not torch.equal(ringfa4.attention(q, k, v, cp=off, causal=True), want)  # the option does steer


def test_context_parallel_takes_and_runs_with_its_options():
    opts = RingOptions(bwd_ring="kv", dkv_groups=1, timeout_s=42.0)
    cp = ringfa4.ContextParallel.simulated(4, backend="reference", options=opts, ulysses=2)
    assert cp.options is opts and cp._ring.options is opts
    assert cp.timeout == datetime.timedelta(seconds=42)
    q = torch.zeros(1, 16, 2, 8)
    assert cp._ring.run(q, AttnSpec(causal=True)).options is opts
    one = ringfa4.ContextParallel(options=opts, timeout=datetime.timedelta(seconds=7))
    assert one.options == opts.replace(timeout_s=7.0) and one.timeout.total_seconds() == 7.0
    with pytest.raises(ValueError, match="options must be a RingOptions, got dict"):
        ringfa4.ContextParallel(options={"bwd_ring": "q"})
    auto = ringfa4.ContextParallel.auto(num_heads=8, num_kv_heads=2, options=RingOptions(nvlink_domain=4))
    assert auto.options.nvlink_domain == 4 and auto.plan.ulysses == 1  # one process: world 1
    assert (auto.plan.nvlink_domain_size, auto.plan.domain_source) == (4, "argument")
    given = ringfa4.ContextParallel.auto(num_heads=8, num_kv_heads=2, nvlink_domain_size=2,
                                         options=RingOptions(nvlink_domain=4))
    assert given.plan.nvlink_domain_size == 2  # the argument wins over the option


def test_hf_auto_cp_passes_options():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    import ringfa4.hf as rhf

    cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    cp = rhf.auto_cp(cfg, backend="reference", options=RingOptions(merge_kernel="torch"))
    assert cp.options.merge_kernel == "torch"


def test_merge_takes_the_kernel_choice():
    acc, lse = torch.zeros(1, 4, 2, 8), torch.full((1, 2, 4), float("-inf"))
    o, l = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    ringfa4.merge_lse_(acc, lse, o, l, impl="torch")
    assert torch.equal(acc, o) and torch.equal(lse, l)
    with pytest.raises(ValueError, match=r"merge impl must be one of \('auto', 'cute', 'triton', 'torch'\)"):
        ringfa4.merge_lse_(acc, lse, o, l, impl="fast")
