"""``cp=None`` against upstream FA4's own entry point, host side only: ``ringfa4.attention(q, k, v,
cp=None, backend="fa4")`` and FA4's ``flash_attn_func`` on the CPU, both with FA4's kernel calls
stubbed to return at once, and the FA4 backend's CUDA-device check skipped (its dtype and head-dim
checks kept). FA4's path: its entry points ``interface._flash_attn_fwd`` / ``_flash_attn_bwd``
answer at once (fresh empty outputs and gradients, allocated as FA4 allocates them), so FA4's own
Python inside them (config, cache key, argument list: most of its host time on the device) is not
counted. ringfa4's path, as on sm90: the forward's and the backward's prepared launches
(``fp32_forward.prepare_plain``, ``plain_backward.prepare_backward``, their plans replayed:
signature, alignment, the outputs' and scratch's allocation and the launch calls) with the compiled
kernels no-ops. What is left is each
path's Python around the kernels: checks, the autograd op, the spec, our launch; the issue-23
target is that ``cp=None`` costs no more than FA4's own entry point, and this comparison leaves
FA4's inner Python out, so it is the harder one. The device's numbers (kernels real) are
``host_cost.py``'s ``cp=None`` and FA4 rows; this is the part of the gap that needs no GPU.

    python3 benchmarks/single_call_floor.py --out benchmarks/results/single_call_floor_cpu.json

Shapes: b = 1, ``--tokens`` (4096), h = kv = 32 (MHA: a GQA backward zero-fills two fp32
accumulators, on the device one asynchronous memset each, on the CPU milliseconds of real work that
would hide the Python), d = 128, bf16, causal. Per path and pass (fwd,
fwd+bwd): host us a call, the median over ``--rounds`` rounds of ``--reps`` calls each (the
minimum too), the two paths interleaved round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

import ringfa4

H, HK, D = 32, 32, 128


@contextlib.contextmanager
def stubbed_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """FA4's kernel entry points answer at once (the same for both paths), and the FA4 backend
    accepts CPU tensors; restored on exit. Yields the count of stubbed kernel calls
    (``{"fwd": n, "bwd": n}``)."""
    from flash_attn.cute import interface

    from ringfa4.kernels import get_backend
    from ringfa4.kernels.fa4 import backend as fb
    from ringfa4.kernels.fa4 import bwd_accum, fp32_forward, plain_backward
    from ringfa4.kernels.fa4.bwd_plan import sm90_plan

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    calls = {"fwd": 0, "bwd": 0}

    def fwd(*args, **kwargs):  # fresh outputs, as FA4's entry point allocates them
        calls["fwd"] += 1
        return torch.empty_like(out), torch.empty_like(lse), None, None, None

    def bwd(*args, **kwargs):  # fresh: autograd takes a gradient no one else holds without copying it
        calls["bwd"] += 1
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def check_inputs(q: torch.Tensor, spec) -> None:  # the backend's checks but the CUDA device
        d = q.shape[-1]
        if q.dtype not in fb._DTYPES or d % 8 != 0 or not 8 <= d <= 256:
            raise fb.Fa4Unsupported(f"not an fa4 call: {q.dtype}, head_dim {d}")

    def kernel(*args):  # the prepared forward's compiled kernel
        calls["fwd"] += 1

    def prepare_plain(q_, k_, v_, spec, arch=None):  # its checked path, the kernel compiled as a no-op
        plan = fp32_forward.ForwardPlan(fp32_forward.Compiled(None, None, kernel), (), False, ())
        return fp32_forward.Prepared((q_, k_, v_, torch.empty_like(out), torch.empty_like(lse)), plan, None, True)

    def backward_kernel(*args):  # the prepared backward's main kernel
        calls["bwd"] += 1

    def no_op(*args):  # its pre- and postprocess
        pass

    def prepare_backward(q_, k_, v_, out_, dout_, lse_, spec, arch=None):  # the kernels compiled as no-ops
        d = q_.shape[-1]
        kernels = plain_backward._Kernels(no_op, backward_kernel, no_op, no_op if q_.shape[2] > k_.shape[2] else None)
        tiles = sm90_plan(90, d, plain_backward._config(d, spec.causal, False))
        return plain_backward.Prepared(plain_backward.BackwardPlan(kernels, tiles, spec.scale(d), (), ()), None)

    saved = (interface._flash_attn_fwd, interface._flash_attn_bwd, fb._check_inputs, fp32_forward.prepare_plain,
             plain_backward.prepare_backward, bwd_accum._arch)
    interface._flash_attn_fwd, interface._flash_attn_bwd, fb._check_inputs = fwd, bwd, check_inputs
    fp32_forward.prepare_plain, plain_backward.prepare_backward = prepare_plain, prepare_backward
    bwd_accum._arch = lambda: 90
    try:
        yield calls
    finally:
        (interface._flash_attn_fwd, interface._flash_attn_bwd, fb._check_inputs, fp32_forward.prepare_plain,
         plain_backward.prepare_backward, bwd_accum._arch) = saved
        get_backend("fa4")._plans.clear()  # no stubbed plan outlives the stubs


def paths(q, k, v, dout) -> dict:
    """Per path, a call of ``backward`` (bool): the forward, and the backward when asked."""
    from flash_attn.cute import interface

    def upstream(backward: bool) -> None:
        o = interface.flash_attn_func(q, k, v, causal=True)
        o = o[0] if isinstance(o, tuple) else o
        if backward:
            o.backward(dout)
            q.grad = k.grad = v.grad = None  # no accumulation into .grad (a real add) between calls

    def ours(backward: bool) -> None:
        o = ringfa4.attention(q, k, v, causal=True, backend="fa4")
        if backward:
            o.backward(dout)
            q.grad = k.grad = v.grad = None

    return {"FA4 flash_attn_func": upstream, "ringfa4 cp=None": ours}


def rows(tokens: int = 4096, reps: int = 300, rounds: int = 7) -> list[dict]:
    """Host us a call per path and pass, both paths stubbed the same way (module docstring)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, tokens, n, D, generator=g).to(torch.bfloat16) for n in (H, HK, HK, H))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = []
    with stubbed_fa4(q, k, v):
        calls = paths(q, k, v, dout)
        for backward in (False, True):
            times: dict[str, list[float]] = {name: [] for name in calls}
            for fn in calls.values():
                for _ in range(20):
                    fn(backward)
            for _ in range(rounds):
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(backward)
                    times[name].append((time.perf_counter() - t0) / reps * 1e6)
            for name, ts in times.items():
                out.append({"path": name, "pass": "fwd+bwd" if backward else "fwd", "tokens": tokens,
                            "us": statistics.median(ts), "min_us": min(ts)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench_results/single_call_floor.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    got = rows(args.tokens, args.reps, args.rounds)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpus": os.cpu_count(), "heads": H, "kv_heads": HK, "head_dim": D, "rows": got}, f, indent=1)
    print(f"\nsingle call, kernels stubbed (CPU, {args.tokens} tokens, h={H}/{HK}, d={D}, bf16, causal)")
    print("| pass | FA4 flash_attn_func us, median (min) | ringfa4 cp=None us | cp=None - FA4 |\n|---|---|---|---|")
    for p in ("fwd", "fwd+bwd"):
        a, b = (next(r for r in got if r["pass"] == p and r["path"] == n) for n in ("FA4 flash_attn_func",
                                                                                  "ringfa4 cp=None"))
        print(f"| {p} | {a['us']:.1f} ({a['min_us']:.1f}) | {b['us']:.1f} ({b['min_us']:.1f}) | "
              f"{b['us'] - a['us']:+.1f} |")


if __name__ == "__main__":
    main()
