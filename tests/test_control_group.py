"""The metadata checks' control group is gloo whatever the data group's backend (so a check's
all-gather and its ``.tolist()`` never wait for an NCCL group's GPU queue), one per rank set and
default process group; under torch's fake process group a fake one."""

from __future__ import annotations

import datetime
import gc
import weakref

import pytest

from ringfa4.parallel import groups


class _World:
    """A stand-in default process group (weakly referenced by the group caches)."""


@pytest.fixture
def made(monkeypatch):
    """``dist.new_group`` recorded (ranks, kwargs); the backend of a group named "fake..." is "fake"."""
    calls = []
    monkeypatch.setattr(groups.dist, "new_group", lambda ranks, **kw: calls.append((tuple(ranks), kw)) or object())
    monkeypatch.setattr(groups.dist, "get_backend", lambda g: "fake" if str(g).startswith("fake") else "nccl")
    monkeypatch.setattr(groups, "_CONTROL", weakref.WeakKeyDictionary())
    monkeypatch.setattr(groups, "_DATA", weakref.WeakKeyDictionary())
    return calls


def test_control_group_is_gloo_for_every_backend(made, monkeypatch):
    world = _World()
    monkeypatch.setattr(groups.dist.distributed_c10d, "_get_default_group", lambda: world)
    timeout = datetime.timedelta(seconds=7)
    a = groups._control_group("an nccl group", [0, 1], timeout)
    assert groups._control_group("an nccl group", [0, 1], timeout) is a  # one per rank set
    groups._control_group("another", [2, 3], timeout)
    assert [m[0] for m in made] == [(0, 1), (2, 3)]
    assert all(kw["backend"] == "gloo" and kw["use_local_synchronization"] and kw["timeout"] == timeout
               for _, kw in made)


def test_control_group_under_a_fake_process_group_is_fake(made, monkeypatch):
    """One process standing for every rank (torch's fake group: a gloo group would wait for peers
    that never come): the checks run on a fake group too."""
    world = _World()
    monkeypatch.setattr(groups.dist.distributed_c10d, "_get_default_group", lambda: world)
    groups._control_group("fake world", [0, 1, 2, 3], datetime.timedelta(seconds=7))
    assert [kw["backend"] for _, kw in made] == ["fake"]


def test_groups_go_with_their_default_group(made, monkeypatch):
    """A destroyed world's control and data groups are never handed to the next world, even where
    the new one's object reuses the old one's address."""
    world = [_World()]
    monkeypatch.setattr(groups.dist.distributed_c10d, "_get_default_group", lambda: world[0])
    timeout = datetime.timedelta(seconds=7)
    first = groups._control_group("an nccl group", [0, 1], timeout)
    assert groups._data_group("an nccl group", [0, 1], timeout) == [0, "an nccl group"]
    world[0] = _World()  # re-initialised: the old world object is gone
    gc.collect()
    assert len(groups._CONTROL) == 0 and len(groups._DATA) == 0  # dropped with their world
    assert groups._control_group("an nccl group", [0, 1], timeout) is not first
    assert len(made) == 2
