"""The per-call error channel of a distributed CP group (docs/design.md, "Errors and bad input").

Every collective entry of a CP group (a call's metadata check, ``unshard``, ``cp.pack``, the plan
check at construction) takes the group's next sequence number; all ranks count alike because they
make the same calls. The ring hops, the Ulysses all-to-all and the all-gather mode's K/V and dK/dV moves
of a call (its backward included) use its number. Store keys live under
``ringfa4/<ranks of the group>/<call>/``:

- ``error``: the root cause, ``{"rank", "message", "type"}``, set once with ``compare_set`` (the
  first error wins and is never overwritten). Only a rank that failed on its own posts it; a rank
  that waited on a peer raises :class:`PeerFailure` and posts nothing - except a rank that saw a
  peer *die*, which posts that death on the dead rank's behalf.
- ``timeout``: a waiting rank ran out of time (not a root cause): every rank still waiting posts
  ``reached/<rank>`` (the call number it reached) when it sees it, and after a short grace the
  waiting ranks name the ranks that never arrived. A late rank that sees it gives up at once.
- ``alive/<rank>``: after a connection closed, the live ranks say so; the others are dead.
- ``checking`` and ``checking/<rank>`` (``RingOptions(metadata_check="new_shapes")`` only): a rank
  whose call key is new announces its metadata check and waits until every rank has (so no rank
  is left in an all-gather the others skip); a rank that skipped the check and sees ``checking``
  from its wait posts the ValueError naming the announcing rank.

No store traffic on the success path (but a new call key's announcement under ``new_shapes``): the
store is read only while a wait has already taken longer than :data:`WATCH_AFTER_S`, then every
:data:`POLL_S` (so a posted error reaches every
waiting rank within about a second). Over gloo every wait is a collective's, polled in short
slices (a timed-out slice of a gloo *send/receive* closes the whole group, a collective's does
not). Over NCCL a wait is stream-ordered (:mod:`.watch`): the host never blocks on a transfer; a
watch thread reads the store for a wait in flight longer than :data:`WATCH_AFTER_S`, and at the
timeout names the missing ranks and aborts the NCCL communicators, so streams stuck on the
transfer are released; the channel's next wait or collective entry raises it. Destroy and
re-initialise the process group after an NCCL failure.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import torch.distributed as dist

from .watch import StreamWatch

__all__ = ["Channel", "PeerFailure", "is_peer_failure", "NCCL_ADVICE", "POLL_S", "WATCH_AFTER_S"]

WATCH_AFTER_S = 0.5
POLL_S = 0.25
GRACE_S = 2.0
NCCL_ADVICE = ("on NCCL the communicators of the waits in flight were aborted and posted sends/receives cannot be "
               "cancelled: destroy the process group and initialise it again before the next call")

_SEQ: dict[str, int] = {}  # per group name: sequence numbers handed out (the same on every rank)
_WANT: dict[str, int] = {}  # per group name: data-group epoch this process asks for (grows on a failed call)


def PeerFailure(message: str, rank: int | None = None) -> RuntimeError:  # noqa: N802 (reads as the error it makes)
    """A RuntimeError for a rank's call that failed because of another rank (a posted error, a
    death, a missing rank): ``rank`` names it (None: unknown). Never posted as a root cause."""
    exc = RuntimeError(message)
    exc.ringfa4_peer = rank if rank is not None else -1
    return exc


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from another rank (see :func:`PeerFailure`)."""
    return hasattr(exc, "ringfa4_peer")


def _abort_nccl(groups: list) -> None:
    """After a stream-ordered wait failed: abort the NCCL process groups of the waits in flight."""
    for group in {id(g): g for g in groups}.values():
        if dist.get_backend(group) == "nccl":
            dist.distributed_c10d._abort_process_group(group)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group / no store
        return None


def _is_slice_timeout(exc: BaseException) -> bool:
    return "Operation timed out" in str(exc)


class Channel:
    """The error channel of one CP group (``group``: a ProcessGroup, ``rank`` / ``world``: this
    rank's place in it, ``timeout_s``: how long a wait may take). Sub-groups of a hybrid share
    their parent's channel, so every message names ranks of the whole CP group."""

    def __init__(self, group, rank: int, world: int, timeout_s: float) -> None:
        self.group, self.rank, self.world, self.timeout_s = group, rank, world, timeout_s
        ranks = [dist.get_global_rank(group, i) for i in range(world)] if group is not None else [0]
        self.global_ranks = ranks
        self.name = "ringfa4/" + ".".join(map(str, ranks))
        self.gloo = group is not None and dist.get_backend(group) == "gloo"
        self.call = _SEQ.get(self.name, 0)
        self.retired: list[Any] = []  # works of failed calls, kept alive (gloo may still write into them)
        self.announced: int | None = None  # the call whose metadata check this rank announced (new_shapes)
        self.streams = StreamWatch(self, timeout_s, _abort_nccl, POLL_S, WATCH_AFTER_S)

    @property
    def want_epoch(self) -> int:
        """Grows when this rank leaves a call by an error: the data groups are renewed at the next
        check (process-wide per rank set: a failed call's leftovers live on the group, not on one
        ContextParallel)."""
        return _WANT.get(self.name, 0)

    @want_epoch.setter
    def want_epoch(self, value: int) -> None:
        _WANT[self.name] = value

    # -- sequence numbers --------------------------------------------------------------------
    def next_call(self) -> int:
        """The next sequence number (every rank takes the same one for the same entry). Raises
        first what the stream watch found since the last entry (an earlier call's NCCL failure)."""
        self.streams.raise_failure()
        self.call = _SEQ[self.name] = _SEQ.get(self.name, 0) + 1
        return self.call

    def resync(self, call: int) -> None:
        """After a rank skipped a call: continue from the largest number any rank reached."""
        self.call = _SEQ[self.name] = max(_SEQ.get(self.name, 0), call)

    def _key(self, call: int, what: str) -> str:
        return f"{self.name}/{call}/{what}"

    # -- posting -----------------------------------------------------------------------------
    def post(self, call: int, message: str, kind: str = "RuntimeError", rank: int | None = None) -> None:
        """Post the root cause of ``call`` (first post wins); ``rank``: whose failure (default this
        rank's). Best effort: never masks the error being raised."""
        store = _store()
        if store is None:
            return
        value = json.dumps({"rank": self.rank if rank is None else rank, "message": message, "type": kind})
        try:
            store.compare_set(self._key(call, "error"), "", value)
        except Exception:
            pass

    def posted(self, call: int) -> dict | None:
        """The root cause posted for ``call``, or None (also when the store is gone)."""
        store = _store()
        try:
            if store is not None and store.check([self._key(call, "error")]):
                return json.loads(store.get(self._key(call, "error")).decode())
        except Exception:
            return None
        return None

    def announce_check(self, call: int) -> None:
        """``RingOptions(metadata_check="new_shapes")``: this rank runs ``call``'s metadata check
        because its call key is new. Where the others repeat the agreed key they skip the check
        and wait in the call's data instead (:meth:`mismatch` there posts the ValueError that names
        this rank within about a second), so the check's all-gather starts only once every rank
        said it checks too (``store.wait`` on their ``checking/<rank>`` keys, in slices, watching
        for a posted error): no rank is ever left in a collective the others never join. Store
        traffic on new keys only; nothing on the calls that skip."""
        self.announced = call
        store = _store()
        if store is None:
            return
        try:
            store.compare_set(self._key(call, "checking"), "", str(self.rank))
            store.set(self._key(call, f"checking/{self.rank}"), "1")
        except Exception:
            return  # no store: the all-gather's own wait names what went wrong
        keys = [self._key(call, f"checking/{r}") for r in range(self.world)]
        start = time.monotonic()
        deadline, step = start + self.timeout_s, 0.002
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=step))
                return
            except Exception:
                pass
            step = min(step * 2, POLL_S)
            found = self.posted(call)
            if found is not None:
                raise self.peer_error(call, "the metadata check", found)
            if time.monotonic() >= deadline:
                raise self._timed_out(call, "the metadata check", None)

    def mismatch(self, call: int) -> Exception | None:
        """Polled while a wait of ``call`` has taken long: where another rank announced ``call``'s
        metadata check and this one did not (it repeated the agreed key: its data already moves),
        post and return the ValueError that names that rank; else None."""
        if self.announced == call or not self._has(call, "checking"):
            return None
        try:
            who = int(_store().get(self._key(call, "checking")).decode())
        except Exception:
            return None
        self.post(call, f"rank {who}: call {call}'s metadata (shapes, dtype, device, spec, layout, pack or options) "
                        "differ from the last call the ranks agreed on, which other ranks repeated; with "
                        "RingOptions(metadata_check='new_shapes') every rank must change them in the same call",
                  "ValueError", rank=who)
        found = self.posted(call)
        return self.peer_error(call, "the call", found) if found is not None else None

    def _mark(self, call: int, what: str, value: str = "1") -> bool:
        store = _store()
        try:
            store.set(self._key(call, what), value)
            return True
        except Exception:
            return False

    def _has(self, call: int, what: str) -> bool:
        store = _store()
        try:
            return bool(store.check([self._key(call, what)]))
        except Exception:
            return False

    def peer_error(self, call: int, what: str, found: dict) -> Exception:
        """The error a waiting rank raises for a posted root cause: a ValueError stays one (bad
        input on one rank reaches all as the same ValueError), anything else a :func:`PeerFailure`."""
        msg = found["message"]
        prefix = f"rank {found['rank']}: "
        if found.get("type") == "ValueError":
            return ValueError(msg if msg.startswith(prefix) else prefix + msg)
        return PeerFailure(f"rank {self.rank}: {what} of call {call} failed because rank {found['rank']} failed "
                           f"first ({msg if msg.startswith(prefix) else prefix + msg})", found["rank"])

    # -- waiting -----------------------------------------------------------------------------
    def wait(self, work, call: int, what: str, peers: list[int] | None = None, gloo: bool | None = None,
             group=None) -> None:
        """Wait for ``work`` (of ``call``; ``peers``: the ranks it depends on, CP-group ranks, None:
        all): return when it completed, raise the posted root cause within about a second of its
        posting, name a dead peer, or at the timeout name the ranks that never arrived. ``gloo``:
        whether ``work`` is a gloo collective, waited in slices while the store is watched
        (default: whether the group's data is; the metadata checks' control group always is).
        Otherwise (NCCL) the wait is stream-ordered and watched by :attr:`streams` (``group``: the
        process group the work runs on, aborted at a failure); its failure is raised by a later
        wait or entry."""
        if not (self.gloo if gloo is None else gloo):
            self.streams.add(work, call, what, peers, group)
            return
        start = time.monotonic()
        deadline, step, next_poll = start + self.timeout_s, 0.002, start + WATCH_AFTER_S
        while True:
            now = time.monotonic()
            try:
                work.wait(datetime.timedelta(seconds=max(min(step, deadline - now), 0.001)))
                return
            except Exception as exc:
                if not _is_slice_timeout(exc):
                    self.retired.append(work)
                    raise self._broken(call, what, peers, exc) from exc
            step = min(step * 2, POLL_S)
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + POLL_S
                found = self.posted(call)
                if found is not None:
                    self.retired.append(work)
                    raise self.peer_error(call, what, found)
                odd = self.mismatch(call)
                if odd is not None:
                    self.retired.append(work)
                    raise odd
                self.watch_dead(call)
                if self._has(call, "timeout"):
                    self._mark(call, f"reached/{self.rank}", str(call))
                    if now - start > GRACE_S + POLL_S and self._has(call, "gaveup"):
                        self.retired.append(work)
                        raise PeerFailure(f"rank {self.rank}: {what} of call {call}: other ranks gave up on this "
                                          f"call at their timeout ({self.timeout_s:g} s); this rank came too late")
            if now >= deadline:
                self.retired.append(work)
                raise self._timed_out(call, what, peers)

    def verdict(self, call: int, what: str, peers: list[int] | None, overdue: bool) -> BaseException | None:
        """The stream watch's question (:class:`.watch.Judge`) about a wait in flight: a root cause
        posted for ``call``, else at ``overdue`` the ranks that never arrived (with the NCCL advice),
        else None; meanwhile say this rank is alive and what it reached."""
        found = self.posted(call)
        if found is not None and found["rank"] != self.rank:
            return self.peer_error(call, what, found)
        odd = self.mismatch(call)
        if odd is not None:
            return odd
        self.watch_dead(call)
        if self._has(call, "timeout"):
            self._mark(call, f"reached/{self.rank}", str(call))
        if not overdue:
            return None
        exc = self._timed_out(call, what, peers)
        if is_peer_failure(exc):
            return PeerFailure(f"{exc}; {NCCL_ADVICE}", exc.ringfa4_peer if exc.ringfa4_peer >= 0 else None)
        return exc

    def _timed_out(self, call: int, what: str, peers: list[int] | None) -> PeerFailure:
        """At the timeout: post ``timeout`` and what we reached, wait a grace, name who is missing."""
        if not (self._mark(call, "timeout") and self._mark(call, f"reached/{self.rank}", str(call))):
            return PeerFailure(f"rank {self.rank}: {what} of call {call} timed out after {self.timeout_s:g} s and "
                               f"the rendezvous store is unreachable: rank 0 (the store's host) is gone")
        time.sleep(GRACE_S)
        found = self.posted(call)
        if found is not None:
            return self.peer_error(call, what, found)
        missing = [r for r in range(self.world) if r != self.rank and not self._has(call, f"reached/{r}")]
        self._mark(call, "gaveup")
        if missing:
            return PeerFailure(f"rank {self.rank}: {what} of call {call} timed out after {self.timeout_s:g} s: "
                               f"rank(s) {', '.join(map(str, missing))} never arrived (not waiting in this call)",
                               missing[0])
        who = "a peer" if not peers else "rank(s) " + ", ".join(map(str, peers))
        return PeerFailure(f"rank {self.rank}: {what} of call {call} timed out after {self.timeout_s:g} s waiting "
                           f"on {who}; every rank reached this call and none posted an error")

    def _broken(self, call: int, what: str, peers: list[int] | None, exc: BaseException) -> Exception:
        """A connection closed under us: find the dead rank(s) (the ranks that do not say they are
        alive within a grace), post the death as the root cause, raise it."""
        found = self.posted(call)
        if found is not None and found["rank"] != self.rank:
            return self.peer_error(call, what, found)
        if self._has(call, "gaveup"):  # the others' leftovers of this call timed out and closed the group
            return PeerFailure(f"rank {self.rank}: {what} of call {call}: other ranks gave up on this call at their "
                               f"timeout ({self.timeout_s:g} s); this rank came too late ({exc})")
        if not (self._mark(call, "dead") and self._mark(call, f"alive/{self.rank}")):
            return PeerFailure(f"rank {self.rank}: {what} of call {call} failed: rank 0 (the store's host) died; the "
                               f"rendezvous store is unreachable ({exc})", 0)
        time.sleep(GRACE_S)
        dead = [r for r in range(self.world) if r != self.rank and not self._has(call, f"alive/{r}")]
        if dead:
            msg = f"died: its connection closed during {what} of call {call} ({str(exc).splitlines()[0][:200]})"
            for r in dead:
                self.post(call, msg, "PeerFailure", rank=r)
        found = self.posted(call)
        if found is not None and found["rank"] != self.rank:
            return self.peer_error(call, what, found)
        return PeerFailure(f"rank {self.rank}: {what} of call {call} failed: {exc}")

    def watch_dead(self, call: int) -> None:
        """A waiting rank that sees ``dead`` says it is alive (called from :meth:`wait`'s poll)."""
        if self._has(call, "dead"):
            self._mark(call, f"alive/{self.rank}")
