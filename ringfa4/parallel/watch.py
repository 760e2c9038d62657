"""Stream-ordered waits, their timeout watched off the host's path (issue 23).

An NCCL ``work.wait(timeout)`` blocks the CPU until the transfer is done, so a rank that waited on
every ring hop could not queue the next block's kernels while the hop was in flight. Here a wait
is ``work.wait()`` (no timeout: the current CUDA stream waits for the transfer, the host goes
on), and the work joins an in-flight list that one daemon thread per error channel polls every
``poll_s`` (the thread ends after a few idle polls and the next wait starts another):

- completed works leave the list (``work.is_completed()``, a CUDA event query; the oldest ones also
  at the next ``add``, so a work's tensors are not kept from the allocator for a whole poll);
- once the oldest has been in flight for ``watch_after_s``, the thread asks the channel's
  :class:`Judge` for a verdict: a root cause a peer posted for its call, a dead peer, or, past
  its deadline (``timeout_s`` after the wait was posted), the ranks that never arrived;
- a verdict is kept as :attr:`StreamWatch.failure`, written to stderr, and ``abort(groups)`` is
  called with the process groups of the works still in flight (for NCCL: abort the
  communicators, so GPU streams stuck on a transfer that will never come are released). The next
  wait or collective entry of the channel raises it on the host, once; so does a failing step of
  the call that was posting on the aborted communicator (the CP group raises the watch's verdict
  instead of the abort's own error, see ``DistributedGroup._guarded``).

No store traffic and no thread wake-ups beyond one poll per ``poll_s`` on the success path.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Judge", "StreamWatch"]


class Judge(Protocol):
    """What a stream watch asks its error channel about a wait in flight."""

    def verdict(self, call: int, what: str, peers: list[int] | None, overdue: bool) -> BaseException | None:
        """The error that ends ``call``'s wait on ``what`` (``peers``: the ranks it depends on) now,
        or None to keep waiting; ``overdue``: it is past its deadline (an error is due)."""
        ...


@dataclass
class _InFlight:
    work: Any
    call: int
    what: str
    peers: list[int] | None
    group: Any
    since: float
    deadline: float


class StreamWatch:
    """The in-flight stream-ordered waits of one error channel (see the module doc)."""

    def __init__(self, judge: Judge, timeout_s: float, abort: Callable[[list], None] | None = None,
                 poll_s: float = 0.25, watch_after_s: float = 0.5) -> None:
        self.judge, self.timeout_s, self.abort = judge, timeout_s, abort
        self.poll_s, self.watch_after_s = poll_s, watch_after_s
        self.failure: BaseException | None = None
        self._items: deque[_InFlight] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, work, call: int, what: str, peers: list[int] | None = None, group=None) -> None:
        """Order the current stream after ``work`` (``work.wait()``, no host block) and watch it.
        Raises the watch's failure first, if one is kept."""
        self.raise_failure()
        work.wait()
        now = time.monotonic()
        with self._wake:
            while self._items and self._items[0].work.is_completed():  # done ones go now, not a poll later:
                self._items.popleft()  # a work keeps its tensors (an NCCL work its outputs) from the allocator
            self._items.append(_InFlight(work, call, what, peers, group, now, now + self.timeout_s))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ringfa4-stream-watch", daemon=True)
                self._thread.start()
            elif len(self._items) == 1:
                self._wake.notify()

    def raise_failure(self) -> None:
        """Raise the failure the watch thread found (then forget it: it is raised once)."""
        exc = self.take_failure()
        if exc is not None:
            raise exc

    def take_failure(self) -> BaseException | None:
        """The failure the watch thread found, or None; forgotten once taken."""
        exc, self.failure = self.failure, None
        return exc

    def in_flight(self) -> int:
        """Waits not yet seen complete (the watch thread prunes them every ``poll_s``)."""
        with self._wake:
            return len(self._items)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._items:  # idle a few polls: the thread ends (the next add starts one)
                    if not self._wake.wait(timeout=4 * self.poll_s) and not self._items:
                        self._thread = None
                        return
            time.sleep(self.poll_s)
            with self._wake:
                live = [i for i in self._items if not i.work.is_completed()]
                self._items = deque(live)
                if not live:
                    continue
                oldest = live[0]
            now = time.monotonic()
            if now - oldest.since < self.watch_after_s:
                continue
            try:
                exc = self.judge.verdict(oldest.call, oldest.what, oldest.peers, now >= oldest.deadline)
            except Exception as err:  # the judge itself failed (the store went away): that is the failure
                exc = err
            if exc is None:
                continue
            with self._wake:
                groups = [i.group for i in self._items if i.group is not None]
                self._items.clear()
            self.failure = exc
            print(f"ringfa4: {exc}", file=sys.stderr, flush=True)
            if self.abort is not None:
                try:
                    self.abort(groups)
                except Exception as err:
                    print(f"ringfa4: aborting the process groups failed: {err}", file=sys.stderr, flush=True)
