"""Pick the Ulysses and ring degrees (U, R), P = U x R, from the heads and the NVLink domain.

Cost model, per layer and rank, S tokens over P ranks, n = S/P local tokens, head dim d, b bytes
per element (bf16: 2), h q heads, h_kv' = h_kv x f K/V heads after GQA replication:

- block compute: ~4 S^2 h d / P FLOPs (halved when causal), the same for every (U, R);
- Ulysses all-to-all: each rank sends (U-1)/U of q, k, v and the output once each way:
  ~ 2 n d b (h + h_kv') (U-1)/U bytes forward; bandwidth-bound, *not* overlapped, and only cheap on
  NVLink (~450-900 GB/s/GPU) - across InfiniBand (~50 GB/s) it would dominate;
- ring: R-1 hops of the group's K/V: (R-1) x 2 (S/R) (h_kv'/U) d b bytes, overlapped with the
  block compute of each step, ~4 (S/R)^2 (h/U) d FLOPs: it hides while
  (S/R) x h / h_kv' x (link GB/s) >~ FLOP/s / 2, i.e. long per-group sequences.

So Ulysses is the better use of a fast domain for one long sequence (constant volume, no per-step
latency, one big kernel per rank instead of R blocks and R merges), and the ring the only scalable
choice across domains. The rule: U = the largest degree that divides the world size, the NVLink
domain size and the q head count (GQA K/V heads are replicated when h_kv has fewer heads than U
needs); R = P / U.

Packed documents (``packed=True``: the batches are packs of documents, ``cp.pack(cu_seqlens)``)
take the ring alone, U = 1: its balanced placement keeps short documents whole on one rank and moves
only the split documents' K/V, while Ulysses runs every rank's varlen calls over the whole pack with
h / U heads, which FA4's varlen kernels run slower per unit of work. Measured (one H100, P = 8,
h = 32 / kv 8, `benchmarks/ulysses_sim.py --packed`, all-to-alls not even charged): ring only
against U = 8, fwd+bwd, a 64k pack of 7 documents 0.821 / 0.724, 256k of 28 0.935 / 0.751, 128k of
55 short documents 0.815 / 0.472, a long tail at 256k 0.957 / 0.900; every hybrid U x R in between
was below the ring too. Larger P (across NVLink domains) is not measured.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from .ulysses import HeadSplit

__all__ = ["CPPlan", "detect_nvlink_domain", "plan_cp"]


@dataclass(frozen=True)
class CPPlan:
    """A (U, R) choice and why."""

    world_size: int
    ulysses: int
    ring: int
    num_heads: int
    num_kv_heads: int
    nvlink_domain_size: int
    domain_source: str
    layout: str = "zigzag"
    packed: bool = False

    def describe(self) -> str:
        split = HeadSplit(self.num_heads, self.num_kv_heads, self.ulysses)
        lines = [
            f"CP plan: P={self.world_size} = Ulysses {self.ulysses} x ring {self.ring} ({self.layout})",
            f"  NVLink domain: {self.nvlink_domain_size} GPUs (from {self.domain_source})",
            *(["  packed documents: the ring alone (its balanced placement keeps short documents whole; "
               "Ulysses' varlen calls of h / U heads run slower)"] if self.packed else []),
            f"  heads: {self.num_heads} q / {self.num_kv_heads} kv -> per rank {self.num_heads // self.ulysses} q / "
            f"{split.kv_heads_total // self.ulysses} kv"
            + (f" (K/V replicated x{split.kv_factor})" if split.kv_factor > 1 else ""),
            f"  Ulysses groups: ranks [g*{self.ulysses} .. g*{self.ulysses}+{self.ulysses - 1}] inside one domain; "
            f"ring across the {self.ring} groups" + (" (no ring)" if self.ring == 1 else ""),
            "  per layer and rank, n = S/P tokens, d, b bytes: a2a ~ 2 n d b (h + h_kv') (U-1)/U each way; "
            f"ring {self.ring - 1} overlapped hops of the group's K/V",
        ]
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan_cp(world_size: int, num_heads: int, num_kv_heads: int, nvlink_domain_size: int,
            domain_source: str = "argument", layout: str = "zigzag", packed: bool = False) -> CPPlan:
    """The (U, R) of the rule in the module docstring (pure; no devices); ``packed``: the batches
    are packed documents (then U = 1)."""
    for name, v in (("world_size", world_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("nvlink_domain_size", nvlink_domain_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide num_heads {num_heads}, got {num_kv_heads}")
    if not isinstance(packed, bool):
        raise ValueError(f"packed must be a bool, got {packed!r}")
    bound = 1 if packed else math.gcd(world_size, nvlink_domain_size)
    u = max(k for k in _divisors(bound) if num_heads % k == 0)
    return CPPlan(world_size, u, world_size // u, num_heads, num_kv_heads, nvlink_domain_size, domain_source, layout,
                  packed)


def _nvml_clique() -> tuple[str, int] | None:
    """(cluster uuid, clique id) of this process's GPU from NVML fabric info (GB200 NVL72), or None."""
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        import torch

        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        info = pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        if info.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED or not any(info.clusterUuid):
            return None
        return bytes(info.clusterUuid).hex(), int(info.cliqueId)
    except Exception:
        return None


def detect_nvlink_domain(override: int | None = None, group=None) -> tuple[int, str]:
    """NVLink domain size and where it came from: the argument (``RingOptions.nvlink_domain`` or
    ``ContextParallel.auto(nvlink_domain_size=)``), NVML's GPU fabric clique (ranks of ``group``
    sharing this rank's clique), ``LOCAL_WORLD_SIZE``, or 1."""
    if override is not None:
        return int(override), "argument"
    clique = _nvml_clique()
    if clique is not None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            import torch

            key = torch.tensor([int(clique[0][:15], 16), clique[1]], dtype=torch.int64)
            if dist.get_backend(group) == "nccl":
                key = key.cuda()
            every = torch.empty(dist.get_world_size(group) * 2, dtype=torch.int64, device=key.device)
            dist.all_gather_into_tensor(every, key, group=group)
            rows = every.view(-1, 2).tolist()
            return sum(r == key.tolist() for r in rows), "NVML fabric clique"
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    return 1, "default (no topology found)"


def _load_toml(path: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def main(argv: list[str] | None = None) -> None:
    """Dry run: ``python -m ringfa4.parallel.planner CONFIG.toml`` prints the plan of the config's
    ``[cp]`` (world_size, nvlink_domain_size, layout) and ``[model]`` (num_heads, num_kv_heads)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m ringfa4.parallel.planner CONFIG.toml")
    cfg = _load_toml(argv[0])
    cp, model = cfg["cp"], cfg["model"]
    plan = plan_cp(cp["world_size"], model["num_heads"], model["num_kv_heads"], cp["nvlink_domain_size"],
                   domain_source=f"{argv[0]} (fake topology)", layout=cp.get("layout", "zigzag"))
    print(plan.describe())


if __name__ == "__main__":
    main()
