"""The (U, R) planner on described topologies, topology detection, and the GB200 config dry run."""

import subprocess
import sys

import pytest

from ringfa4.parallel import detect_nvlink_domain, plan_cp


@pytest.mark.parametrize("world,heads,kv,domain,want", [
    (8, 32, 8, 8, (8, 1)),      # one 8-GPU node: Ulysses over the node
    (32, 32, 8, 8, (8, 4)),     # 4 nodes x 8: Ulysses in the node, ring across nodes
    (72, 64, 8, 72, (8, 9)),    # one NVL72 domain, 64 heads: U must divide 64 and 72
    (72, 72, 8, 72, (72, 1)),   # heads that split 72 ways: all Ulysses (K/V replicated)
    (8, 28, 4, 8, (4, 2)),      # 28 heads on 8 GPUs: U=4 x ring 2
    (16, 32, 2, 8, (8, 2)),     # h_kv < U: K/V replicated, U still 8
    (8, 32, 8, 1, (1, 8)),      # no NVLink domain: pure ring
    (144, 64, 8, 72, (8, 18)),  # two NVL72 racks
    (6, 32, 8, 8, (2, 3)),      # world 6 on an 8-GPU node: gcd 2
])
def test_plan_on_described_topologies(world, heads, kv, domain, want):
    plan = plan_cp(world, heads, kv, domain)
    assert (plan.ulysses, plan.ring) == want
    assert heads % plan.ulysses == 0 and world % plan.ulysses == 0 and domain % plan.ulysses == 0
    text = plan.describe()
    assert f"Ulysses {want[0]} x ring {want[1]}" in text


@pytest.mark.parametrize("world,heads,kv,domain", [(8, 32, 8, 8), (32, 32, 8, 8), (72, 72, 8, 72), (8, 9, 3, 8)])
def test_packed_documents_take_the_ring_alone(world, heads, kv, domain):
    """Batches of packed documents: U = 1 whatever the heads and the domain allow (the balanced
    ring beat every U x R on the measured packs), and the plan says why."""
    dense, packed = plan_cp(world, heads, kv, domain), plan_cp(world, heads, kv, domain, packed=True)
    assert (packed.ulysses, packed.ring) == (1, world) and packed.packed and not dense.packed
    assert "packed documents: the ring alone" in packed.describe()
    assert "packed documents" not in dense.describe()
    with pytest.raises(ValueError, match="packed must be a bool"):
        plan_cp(world, heads, kv, domain, packed=1)


def test_plan_rejects_bad_topologies():
    with pytest.raises(ValueError, match="num_kv_heads must divide"):
        plan_cp(8, 32, 5, 8)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_cp(0, 32, 8, 8)


def test_detect_nvlink_domain_sources(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert detect_nvlink_domain(12) == (12, "argument")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert detect_nvlink_domain() == (4, "LOCAL_WORLD_SIZE")
    assert detect_nvlink_domain(72) == (72, "argument")


def test_gb200_config_dry_run_prints_the_plan():
    r = subprocess.run([sys.executable, "-m", "ringfa4.parallel.planner", "recipes/configs/gb200_nvl72.toml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "P=144 = Ulysses 8 x ring 18" in r.stdout and "NVLink domain: 72 GPUs" in r.stdout
