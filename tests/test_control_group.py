"""The metadata checks' control group is gloo whatever the data group's backend (so a check's
all-gather and its ``.tolist()`` never wait for an NCCL group's GPU queue), one per rank set."""

from __future__ import annotations

import datetime

from ringfa4.parallel import groups


def test_control_group_is_gloo_for_every_backend(monkeypatch):
    made = []
    monkeypatch.setattr(groups.dist, "new_group", lambda ranks, **kw: made.append((tuple(ranks), kw)) or object())
    monkeypatch.setattr(groups.dist.distributed_c10d, "_get_default_group", lambda: "world")
    monkeypatch.setattr(groups, "_CONTROL", {})
    timeout = datetime.timedelta(seconds=7)
    a = groups._control_group("an nccl group", [0, 1], timeout)
    assert groups._control_group("an nccl group", [0, 1], timeout) is a  # one per rank set
    groups._control_group("another", [2, 3], timeout)
    assert [m[0] for m in made] == [(0, 1), (2, 3)]
    assert all(kw["backend"] == "gloo" and kw["use_local_synchronization"] and kw["timeout"] == timeout
               for _, kw in made)
