"""The one-pass row sums (kernels/rows_sum_triton.py) that write the all-gather mode's travelling
dK/dV: equal to the sums written one span at a time in the listed order, in fp32 / fp64 sources and
fp32 / bf16 outputs, rows outside the list untouched, rows listed without contributors zero. The
Triton kernel on the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess since it
is read at import) and natively on the GPU; the torch fallback in process."""

import pytest
import torch
from helpers import run_triton_script

from ringfa4.kernels.rows_sum_triton import RowSums, sum_rows_

SPANS = [(0, 5, 10), (3, 4, 20), (9, 2, -1), (3, 2, 0), (12, 3, 30), (30, 4, 33), (31, 2, 5)]


def expected(out: torch.Tensor, src: torch.Tensor, spans) -> torch.Tensor:
    """The sums span by span (a listed row starts from zero), in ``src``'s dtype, then cast."""
    sums, want = {}, out.clone()
    for d, n, r in spans:
        for t in range(n):
            sums.setdefault(d + t, torch.zeros_like(src[0]))
            if r >= 0:
                sums[d + t] = sums[d + t] + src[r + t]
    for row, x in sums.items():
        want[row] = x.to(out.dtype)
    return want


def test_row_sums_csr_lists_each_row_once_in_span_order():
    s = RowSums.from_spans(SPANS)
    assert s.dst.tolist() == sorted(set(d + t for d, n, _ in SPANS for t in range(n)))
    assert s.idx[s.ptr[3]:s.ptr[4]].tolist() == [13, 20, 0]  # row 3: the spans in their listed order
    assert int(s.ptr[s.dst.tolist().index(9) + 1] - s.ptr[s.dst.tolist().index(9)]) == 0  # listed, nothing added
    assert RowSums.from_spans([]).dst.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_sums_torch_path(dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(40, 3, 8, generator=g, dtype=dtype)
    out = torch.full((36, 3, 8), 7.0, dtype=dtype)
    want = expected(out, src, SPANS)
    got = sum_rows_(out, src, RowSums.from_spans(SPANS))
    assert got is out and torch.equal(out[[7, 8, 11, 15, 20]], torch.full((5, 3, 8), 7.0, dtype=dtype))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)


SCRIPT = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_rows_sum_triton import SPANS, expected
from ringfa4.kernels.rows_sum_triton import RowSums, sum_rows_, sum_rows_triton_
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
# bf16: one rounding step at |x| < 8 (the fp32 sum in another order)
for src_dtype, out_dtype, tol in ((torch.float32, torch.float32, 1e-6), (torch.float32, torch.bfloat16, 0.04),
                                  (torch.float64, torch.float64, 1e-12)):
    for shape in ((3, 8), (5, 300)):  # one column block; several, the last one partial
        src = torch.randn(40, *shape, generator=g).to(src_dtype).to(dev)
        base = torch.full((37,) + shape, 7.0).to(out_dtype).to(dev)
        out = base[1:]  # rows offset: a view
        want = expected(out.cpu(), src.cpu(), SPANS)
        assert sum_rows_triton_(out, src, RowSums.from_spans(SPANS, dev))
        err = (out.cpu().double() - want.double()).abs().max()
        assert err <= tol, (src_dtype, out_dtype, shape, err)
        assert float(base[0, 0, 0]) == 7.0
    assert not sum_rows_triton_(out, src.half(), RowSums.from_spans(SPANS, dev))  # fp16 sources: declined
if dev == "cuda":  # the entry point takes the kernel there
    out = torch.zeros(36, 3, 8, device=dev)
    sum_rows_(out, torch.ones(40, 3, 8, device=dev), RowSums.from_spans(SPANS, dev))
    assert float(out[3, 0, 0]) == 3.0
print("ok")
"""


def test_row_sums_interpreted_on_cpu():
    pytest.importorskip("triton")
    r = run_triton_script(SCRIPT, interpret=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.gpu
def test_row_sums_on_gpu():
    r = run_triton_script(SCRIPT, interpret=False)
    assert r.returncode == 0, r.stdout + r.stderr
