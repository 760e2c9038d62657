"""The packed (varlen) FA4 kernels of ringfa4: the fp32-output forward (``fa4.varlen_fwd``) and the
backward added into fp32 accumulators (``fa4.varlen_bwd``). CPU (CI), no GPU:

* both compile for sm_90a under ``FakeTensorMode`` in a subprocess (this file run as a script;
  CuTe DSL reads ``CUTE_DSL_ARCH`` at import): the forward's PTX stores O as float32 pairs from
  registers (``st.global.v2.b32``, d / 4 a thread, no TMA store);
* packs of other lengths, document counts (1 to 300 documents) and one-token documents compile
  nothing new (``fa4.compile_count()`` stays put): nothing of a pack is in the compile keys;
* the gather from FA4's per-document padded accumulator layout to packed rows, on CPU tensors;
* the backend's refusals (CPU, fp32, deterministic) touch nothing.

The GPU checks against float64 are in ``test_fa4_varlen_gpu.py``.
"""

from __future__ import annotations

import json
import re
import sys
import time
import weakref
from pathlib import Path

import cute_compile
import pytest
import torch

from ringfa4.kernels import AttnSpec

# (name, head_dim, AttnSpec kwargs, (h, h_kv))
CASES = [
    ("d128_causal_gqa", 128, dict(causal=True), (8, 2)),
    ("d128_full_mha", 128, dict(), (4, 4)),
    ("d64_window_gqa", 64, dict(window=(96, 32)), (8, 2)),
    ("d128_softcap_causal", 128, dict(causal=True, softcap=30.0, softmax_scale=0.1), (4, 2)),
]
# other packs of the first case: lengths (len_q, len_k) per document, many documents, 1-token ones
PACKS = [
    ((1, 1),),
    ((3000, 2999), (1, 1), (17, 40)),
    tuple((1 + (7 * i) % 23, 1 + (5 * i) % 31) for i in range(300)),  # > 256 documents (FA4's hint limit)
    ((129, 129), (128, 1), (1, 128), (255, 513)),
]


def _compile_all(arch: str) -> list[dict]:
    """Subprocess side (env set): compile every case, then every pack of the first case, asserting."""
    from ringfa4.kernels.fa4 import compile_count, varlen_bwd, varlen_fwd

    results = []
    for name, d, kw, heads in CASES:
        t0 = time.perf_counter()
        entry = varlen_fwd.compile_only_varlen(arch, torch.bfloat16, d, kw.get("causal", False),
                                               window=kw.get("window", (None, None)), softcap=kw.get("softcap", 0.0),
                                               heads=heads)
        ptx = entry.fn.__ptx__
        assert f".target {arch}" in ptx and entry.fn.__cubin__, name
        assert entry.key.varlen and entry.kernel.use_tma_O is False, (name, entry.key)
        stores = re.findall(r"st\.global\.v\d\.b32|cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)
        assert stores == ["st.global.v2.b32"] * (d // 4), (name, stores)
        t1 = time.perf_counter()
        key = varlen_bwd.compile_only_varlen(torch.bfloat16, d, heads=heads, **kw)
        assert key is not None and key.varlen and key.qhead_per_kvhead == heads[0] // heads[1], (name, key)
        results.append(dict(name=name, fwd_s=round(t1 - t0, 2), bwd_s=round(time.perf_counter() - t1, 2)))
    name, d, kw, heads = CASES[0]
    before = compile_count()
    assert before >= 2 * len(CASES), before
    for lengths in PACKS:
        varlen_fwd.compile_only_varlen(arch, torch.bfloat16, d, True, heads=heads, lengths=lengths)
        varlen_bwd.compile_only_varlen(torch.bfloat16, d, heads=heads, lengths=lengths, **kw)
        assert compile_count() == before, (f"a pack of {len(lengths)} documents compiled "
                                           f"{compile_count() - before} new kernels")
    results.append(dict(name="packs", compiled=before))
    return results


@pytest.fixture(scope="module")
def compile_run(tmp_path_factory):
    from ringfa4.kernels.registry import fa4_installed

    if not fa4_installed():
        pytest.skip("needs flash-attn-4 and nvidia-cutlass-dsl (pip install 'ringfa4[gpu]')")
    tmp = tmp_path_factory.mktemp("fa4_varlen")
    result, log, dump = tmp / "result.json", tmp / "log.txt", tmp / "dump"
    dump.mkdir()
    env = dict(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
               FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(dump))
    proc = cute_compile.start(__file__, ["sm_90a", str(result)], env, log)
    yield proc, result, log
    cute_compile.stop([proc])


def test_varlen_kernels_compile_once_for_every_pack(compile_run):
    proc, result, log = compile_run
    cute_compile.wait_ok(proc, log, "sm_90a", timeout=400)
    results = json.loads(result.read_text())
    assert [r["name"] for r in results] == [c[0] for c in CASES] + ["packs"]
    print("\nsm_90a: " + ", ".join(f"{r['name']} {r.get('fwd_s')}+{r.get('bwd_s')}s" for r in results[:-1]))


@pytest.mark.parametrize("tile,lengths", [(64, [5, 0, 64, 1, 130, 0]), (128, [1]), (80, [300, 79, 81, 0, 2])])
def test_gather_index_reads_fa4_padded_rows(tile, lengths):
    """A padded accumulator whose entries encode (padded row, column) through a permuted in-tile
    order is read back at exactly each packed row's padded row: document i starting at
    ``(cu[i] + i * tile) // tile * tile``, FA4's interface layout."""
    from ringfa4.kernels.fa4.varlen_bwd import _add_rows_, padded_rows

    d, d_r, heads = 24, 32, 3
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total, pad = int(cu[-1]), padded_rows(int(cu[-1]), cu.numel(), tile)
    g = torch.Generator().manual_seed(tile)
    order = torch.randperm(tile * d_r, generator=g)[:tile * d]  # where (row, col < d) sits in a tile
    accum = torch.full((heads, pad * d_r), float("nan"))
    rows = torch.arange(pad).repeat_interleave(d)
    cols = torch.arange(d).repeat(pad)
    flat = (rows // tile) * tile * d_r + order[(rows % tile) * d + cols]
    for hh in range(heads):
        accum[hh, flat] = (rows * 1000 + cols + hh * 10**7).float()
    acc = torch.ones(total, heads, d)
    _add_rows_(acc, accum, cu, tile, order, d_r, 2.0)
    want_rows = []
    for i, n in enumerate(lengths):
        start = (int(cu[i]) + i * tile) // tile * tile
        want_rows += list(range(start, start + n))
    want = torch.tensor(want_rows, dtype=torch.float32).view(-1, 1, 1) * 1000 + torch.arange(d).view(1, 1, -1) \
        + torch.arange(heads).view(1, -1, 1) * 10**7
    assert torch.equal(acc, 1 + 2 * want)
    assert pad >= max(want_rows, default=0) + 1


def test_fa4_backward_accumulate_refuses_without_touching():
    from ringfa4.kernels.fa4.backend import Fa4Backend

    be = Fa4Backend()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    spec = AttnSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    q = torch.randn(8, 4, 16)
    lse = torch.zeros(4, 8)
    for x, s in ((q, spec), (q.bfloat16(), spec), (q.bfloat16(), spec.replace(deterministic=True))):
        grads = tuple(torch.zeros(8, 4, 16) for _ in range(3))
        assert be.backward_accumulate(x, x, x, x, x, lse, s, grads) is False
        assert all((g == 0).all() for g in grads)
    with pytest.raises(ValueError, match="dq_acc must be"):
        be.backward_accumulate(q, q, q, q, q, lse, spec, (torch.zeros(8, 4, 16).half(),) * 3)
    with pytest.raises(ValueError, match="lse must be"):
        be.backward_accumulate(q, q, q, q, q, lse.t(), spec, tuple(torch.zeros(8, 4, 16) for _ in range(3)))


def test_known_empty_segment_without_sync():
    from ringfa4.kernels.validate import known_empty_segment, mark_valid, validate_cu_seqlens

    a, b, c = (torch.tensor(x, dtype=torch.int32) for x in ([0, 3, 3, 5], [0, 3, 5], [0, 0, 4]))
    validate_cu_seqlens(a, "cu", 5)
    validate_cu_seqlens(b, "cu", 5)
    mark_valid(c, 4)  # trusted: never read, so not known to be empty
    assert known_empty_segment(a) and not known_empty_segment(b) and not known_empty_segment(c)


if __name__ == "__main__":  # subprocess entry: python test_fa4_varlen.py ARCH RESULT_JSON
    _arch, _result = sys.argv[1:3]
    _t0 = time.perf_counter()
    _res = _compile_all(_arch)
    Path(_result).write_text(json.dumps(_res))
    print(f"{_arch}: {len(_res)} cases in {time.perf_counter() - _t0:.1f}s")


def test_padded_rows_made_once_per_cu_seqlens_version():
    """The padded rows of a pack are computed once per cu_seqlens tensor and version: the same
    tensor gives the same result object, an in-place change (a new version) or another tensor
    with other values recomputes, and every result equals the layout's formula; a result lives
    as long as its cu_seqlens (however many are alive: a CUDA graph keeping its pack reads it)."""
    from ringfa4.kernels.fa4.varlen_bwd import _padded_rows_of

    def want(cu, tile):
        rows = []
        for i in range(cu.numel() - 1):
            start = (int(cu[i]) + i * tile) // tile * tile
            rows += list(range(start, start + int(cu[i + 1] - cu[i])))
        return torch.tensor(rows, dtype=torch.long)

    cu = torch.tensor([0, 5, 5, 70, 71], dtype=torch.int32)
    first = _padded_rows_of(cu, 71, 64)
    assert torch.equal(first, want(cu, 64)) and _padded_rows_of(cu, 71, 64) is first
    assert torch.equal(_padded_rows_of(cu, 71, 32), want(cu, 32))
    cu.copy_(torch.tensor([0, 8, 8, 60, 71]))  # in place: another pack in the same tensor, a new version
    again = _padded_rows_of(cu, 71, 64)
    assert again is not first and torch.equal(again, want(cu, 64))
    other = torch.tensor([0, 71], dtype=torch.int32)
    rows = _padded_rows_of(other, 71, 64)
    assert torch.equal(rows, torch.arange(71))
    gone = weakref.ref(rows)
    del other, rows  # a dead tensor's values leave with it
    assert gone() is None
    kept = [torch.tensor([0, n], dtype=torch.int32) for n in range(1, 1500)]  # many live ones: nothing
    firsts = [_padded_rows_of(c, int(c[1]), 64) for c in kept]  # is dropped (a graph may read them)
    assert all(_padded_rows_of(c, int(c[1]), 64) is f for c, f in zip(kept, firsts))
