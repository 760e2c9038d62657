"""A pool of spawned gloo ranks that run named jobs from tests/dist_jobs.py and dist_fault_jobs.py, reused
across cases.
Every wait has a timeout, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import os
import queue
import socket
import sys
import time

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, jobs, results, pg_timeout_s):
    sys.path.insert(0, HERE)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    import dist_fault_jobs
    import dist_jobs

    while True:
        job = jobs.get()
        if job is None:
            break
        name, args = job
        try:
            results.put((rank, "ok", getattr(dist_jobs if hasattr(dist_jobs, name) else dist_fault_jobs, name)(*args)))
        except BaseException as exc:  # report every failure to the parent
            results.put((rank, type(exc).__name__, str(exc)))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, pg_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.jobs[r], self.results, pg_timeout_s),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name: str, *args, timeout: float = 180.0) -> list[tuple[str, object]]:
        """Run ``dist_jobs.<name>(*args)`` (or ``dist_fault_jobs``'s) on every rank: ``[(status, value)]``
        in rank order, where status is "ok" or the exception's type name (value: its message)."""
        for q in self.jobs:
            q.put((name, args))
        out: dict[int, tuple[str, object]] = {}
        for _ in range(self.world):
            try:
                rank, status, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{name}: ranks {sorted(set(range(self.world)) - set(out))} did not answer "
                                   f"within {timeout}s (hang)") from None
            out[rank] = (status, value)
        return [out[r] for r in range(self.world)]

    def run_some(self, name: str, *args, timeout: float = 60.0) -> dict[int, tuple[str, object]]:
        """Like :meth:`run` for jobs where some ranks may die: ``{rank: (status, value)}`` of the
        ranks that answered within ``timeout`` seconds (a dead rank never does)."""
        for q in self.jobs:
            q.put((name, args))
        out: dict[int, tuple[str, object]] = {}
        end = time.monotonic() + timeout
        while len(out) < self.world and time.monotonic() < end:
            if all(r in out or not self.procs[r].is_alive() for r in range(self.world)):
                break  # every live rank answered
            try:
                rank, status, value = self.results.get(timeout=0.5)
            except queue.Empty:
                continue
            out[rank] = (status, value)
        return out

    def close(self, join_s: float = 10.0) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
