"""Backend selection: names, auto per device and dtype, and auto's fallback on refusals."""

import subprocess
import sys

import pytest
import torch
from helpers import random_qkv

from ringfa4.kernels import (
    AttnSpec,
    BackendUnsupported,
    BlockBackend,
    FallbackBackend,
    PlainBackend,
    get_backend,
    resolve,
)


def test_resolve_on_cpu_is_reference():
    assert resolve("auto", "cpu") == "reference"
    assert resolve("auto", "cpu", torch.bfloat16) == "reference"
    assert get_backend("auto", "cpu").name == "reference"
    assert resolve("sdpa", "cpu") == "sdpa"


def test_bad_names_and_options():
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve("flash2")
    with pytest.raises(ValueError, match="explicit backend name"):
        get_backend("auto", "cpu", compute_dtype=torch.float64)
    with pytest.raises(ValueError, match="compute_dtype"):
        get_backend("reference", compute_dtype=torch.float16)


class _Refuses(PlainBackend):
    name = "refuses"

    def forward(self, q, k, v, spec, out=None, lse=None):
        raise BackendUnsupported("not this one")

    def backward(self, *args):
        raise BackendUnsupported("not this one")


def test_fallback_uses_next_backend_on_refusal():
    ref = get_backend("reference")
    chain = FallbackBackend([_Refuses(), ref])
    q, k, v, do = random_qkv(1, 10, 10, 2, 2, 8)
    o, l = chain.forward(q, k, v, AttnSpec(causal=True))
    o2, l2 = ref.forward(q, k, v, AttnSpec(causal=True))
    assert torch.equal(o, o2) and torch.equal(l, l2)
    assert all(torch.equal(a, b) for a, b in zip(chain.backward(do, q, k, v, o, l, AttnSpec(causal=True)),
                                                  ref.backward(do, q, k, v, o, l, AttnSpec(causal=True))))


class _Merges(_Refuses):
    def __init__(self, result):
        self.result = result

    def forward_merge(self, q, k, v, spec, out_acc, planes):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_fallback_forward_merge_asks_the_first_backend_only():
    """``forward_merge`` of an auto chain: the first backend's answer; None when it has none or
    refuses (the caller then runs forward through the whole chain); never a later backend's."""
    ref = get_backend("reference")
    args = (None, None, None, AttnSpec(), None, None)
    assert FallbackBackend([_Merges("merged"), ref]).forward_merge(*args) == "merged"
    assert FallbackBackend([_Merges(BackendUnsupported("no")), ref]).forward_merge(*args) is None
    assert FallbackBackend([_Refuses(), _Merges("merged")]).forward_merge(*args) is None
    with pytest.raises(ValueError):
        FallbackBackend([_Merges(ValueError("bad input")), ref]).forward_merge(*args)


def test_a_backend_must_offer_every_method():
    """The protocol's methods are all required: a class with only forward / backward is not a
    BlockBackend (get_backend refuses it, naming its type); PlainBackend gives it the rest."""

    class _Bare:
        name = "bare"

        def forward(self, q, k, v, spec, out=None, lse=None): ...

        def backward(self, *args): ...

    assert not isinstance(_Bare(), BlockBackend) and isinstance(_Refuses(), BlockBackend)
    with pytest.raises(ValueError, match="backend must be a name or a BlockBackend, got _Bare"):
        get_backend(_Bare())
    for name in ("reference", "sdpa"):
        assert isinstance(get_backend(name), BlockBackend)
    assert _Refuses().begin_backward(None, None, None, None, AttnSpec()) is None
    assert not _Refuses().can_forward_merge(None, None) and _Refuses().fp32_block_outputs(torch.device("cpu"))


def test_sdpa_refusal_is_backend_unsupported_not_value_error():
    q, k, v, _ = random_qkv(1, 8, 8, 2, 2, 8)
    with pytest.raises(BackendUnsupported):
        get_backend("sdpa").forward(q, k, v, AttnSpec())


def test_import_ringfa4_imports_no_flash_attn_or_cutlass():
    code = ("import sys, ringfa4, ringfa4.parallel; ringfa4.get_backend('auto', 'cpu'); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'cutlass', 'quack')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
