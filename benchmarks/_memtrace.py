"""What is alive on the GPU at the peak of a step: replay of torch's CUDA allocator trace.

    start()                      # torch.cuda.memory._record_memory_history before the step
    ... the step ...
    rows = at_peak(snapshot())   # [(bytes, where), ...] of the allocations alive at the peak

``where`` is the innermost stack frame in our code or transformers (else the innermost frame), so
the table says which line made each tensor that the peak holds.
"""

from __future__ import annotations

import torch

KEEP = ("ringfa4/", "transformers/", "peft/", "flash_attn/")


def start(max_entries: int = 500_000) -> None:
    # Stacks of allocations only: gathering a Python stack at a free that happens while an exception
    # unwinds (checkpoint's early stop raises one in a pack hook) lost that exception on torch 2.11
    # ("apply returned NULL without setting an exception").
    torch.cuda.memory._record_memory_history(context="alloc", max_entries=max_entries)


def snapshot() -> dict:
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


def _where(frames) -> str:
    for f in frames or ():
        name = f.get("filename", "")
        if any(k in name for k in KEEP):
            return f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    f = (frames or [{}])[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '')}"


def at_peak(snap: dict, device: int = 0, top: int = 15) -> dict:
    """Replay the trace: the peak of live allocated bytes during the trace, and the live
    allocations at that moment grouped by where they were made (largest first)."""
    live: dict[int, tuple[int, str]] = {}
    traces = snap.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    cur = peak = 0
    at = {}
    for e in events:
        action, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
        if action == "alloc":
            live[addr] = (size, _where(e.get("frames")))
            cur += size
            if cur > peak:
                peak, at = cur, dict(live)
        elif action == "free_completed" and addr in live:  # (a block freed while a side stream still
            # uses it stays allocated until then: record_stream, e.g. the offload copies)
            cur -= live.pop(addr)[0]
    groups: dict[str, int] = {}
    for size, where in at.values():
        groups[where] = groups.get(where, 0) + size
    rows = sorted(((b, w) for w, b in groups.items()), reverse=True)[:top]
    return {"peak_in_trace_gib": peak / 2**30, "live_at_peak": [{"gib": b / 2**30, "where": w} for b, w in rows]}
