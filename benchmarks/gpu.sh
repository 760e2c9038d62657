#!/usr/bin/env bash
# The GPU runs a reviewer repeats, one stage a call (each fits a 10-minute device call unless noted):
#
#   bash benchmarks/gpu.sh STAGE [PART]
#
#   tests     the GPU test suite (pytest -m gpu; extra arguments go to pytest, e.g. a file to split it) (~10 min)
#   kernels   block kernels vs sdpa and FA4 direct (block_kernels.py), fused merges (merge.py), the ring's forward kernels
#             against FA4's per block shape (fa4_merge_epilogue.py) (~6 min)
#   ring      ring_sim: 64k, P = 8, causal, executor level, default rounds; ring_precision at P = 8 and 32 (~4 min)
#   packed    PART p8 (default): packed documents at P = 8 (varlen_sim.py: each rank alone, under load, balanced;
#             step 5 on and off; the exchange overlapped; the 64k pack's ranks profiled under load, each by kernel kind)
#             (~8 min: the H100 took 4 without the per-rank profiles); PART modes: P = 4, the ring / allgather
#             placements, Ulysses x ring (ulysses_sim.py), dense and the packed mixes (~9 min); PART tiles: what a
#             tile of FA4's varlen kernels costs besides its blocks (varlen_tile_cost.py: the tile cost
#             tile_schedule.py models) (~2 min)
#   host      host microseconds per rank-step, eager and CUDA graphs (host_cost.py): the default PART 4k a rank at
#             P = 4 and 8 with the baselines and a per-function profile, then what the taped calls launch by kind
#             (tape_entries.py) (~5 min: one H100, session 30); PART rows
#             TOKENS WORLDS: other sizes, e.g. `host rows 8192 4` (~3 min), `host rows 8192 8` (~4 min), `host rows
#             32768 4` / `32768 8` (each call alone: 32k rows ran past a shared call's limit); PART rest: the packed
#             mix and the real-rank rows, the real rank's per-call metadata check (check_cost.py, gloo), where a
#             ring step's time goes (ring_profile.py, 64k, P = 8, MHA) and whether hops hide behind the kernels
#             (hop_overlap.py) (~8 min); PART dkv: 4k tokens a rank at P = 4
#             and 8 with dkv_groups 2 and 1 (host time, launches, efficiency, of calls alone) (~3 min); PART real:
#             the real-rank rows with stub peers (rank 0 alone, a fake process group: no spawned ranks sharing the
#             GPU), 4k a rank at P = 4 and 8, loopback, stream-ordered and NCCL-to-self hops, eager and graphs, each row's
#             top functions by own time (compare with the default PART's simulated rows of the same machine), then
#             one hop's NCCL post, torch's batch_isend_irecv against the transport's own (nccl_post.py); PART qring:
#             the same rows for MHA (h = kv = 32), where the backward's q side travels (~2 min)
#   capacity  PART 2l (default): 512k and 1M tokens on a 2-layer Llama-3.1-8B shape, allocator trace, then the
#             peak-memory formula's refit (memory_formula.py) and the plot (~5 min); PART 32k: 32 layers, plain
#             transformers and ringfa4 in one call (~6 min); PART 256k: 32 layers at 256k (~6 min)
#   recipe    PART dry (default): hf_llama8b.py (ringfa4 vs sdpa on the Llama-3.1-8B shape) and the recipes'
#             dry runs; PART run: llama3_8b_1xh200.toml for 4 steps, one 32k document a step (~8 min)
#   nccl      (kind nvidia-h200-x2) the NCCL ring against the simulated one, its CUDA graphs and its launch tapes
#             (tapes_check: then set P2PTransport.TAPED_NCCL) against eager, weak
#             scaling against PyTorch's
#             context_parallel + cuDNN, and two packed mixes by ring hops / the all-gather mode's exchange in one
#             and two pipelined groups, torchrun on 2 GPUs; the real rank's host time over NCCL (host_cost.py
#             --hops nccl) (~8 min)
#
# Every stage writes JSON under ${OUT:-benchmarks/results}, named <benchmark>_${SUFFIX:-card}.json (card: h100,
# h200 or b200, the GPU that ran; the names
# kept in benchmarks/results). The library's defaults are RingOptions' (ringfa4/options.py); nothing here sets
# RINGFA4_*. To compare a variant, set the variable (the benchmarks read it through RingOptions.from_env()) and a
# VARIANT tag for the file names, e.g.
#   VARIANT=kv_ring RINGFA4_BWD_RING=kv bash benchmarks/gpu.sh ring
# Set-up on the device: pip install -e ".[gpu]" (or the wheels carried there); `python3` must import torch.
set -uo pipefail
out=${OUT:-benchmarks/results}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$card" in *H100*) card=h100 ;; *B200*) card=b200 ;; *) card=h200 ;; esac
sfx=${SUFFIX:-$card}  # the card that ran (h200 where none answers)
v=${VARIANT:+_$VARIANT}
mkdir -p "$out"

name() { echo "$out/$1${v}_$2.json"; }  # $1 benchmark, $2 device suffix

# A command whose output is text: run it, echo it, and record command, status, seconds and the last lines as JSON.
as_json() {
  local json=$1; shift
  local log start rc
  log=$(mktemp); start=$(date +%s)
  "$@" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
  python3 - "$json" "$rc" "$(( $(date +%s) - start ))" "$*" "$log" <<'PY'
import json, sys
path, rc, secs, cmd, log = sys.argv[1:]
tail = open(log, errors="replace").read().splitlines()[-40:]
json.dump(dict(command=cmd, rc=int(rc), seconds=int(secs), tail=tail), open(path, "w"), indent=1)
PY
  rm -f "$log"
  return "$rc"
}

stage_tests() {
  as_json "$(name gpu_tests "$sfx")" python3 -m pytest -m gpu -q "$@"
}

stage_kernels() {
  python3 benchmarks/block_kernels.py --out "$(name kernels "$sfx")"
  python3 benchmarks/merge.py --out "$(name merge "$sfx")"
  python3 benchmarks/fa4_merge_epilogue.py --out "$(name fa4_merge_epilogue "$sfx")" "$@"
}

stage_ring() {  # extra arguments go to ring_sim.py (e.g. --hops none: hops that copy nothing, attribution only)
  python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor \
    --out "$(name ring_sim "$sfx")" "$@"
  python3 benchmarks/ring_precision.py --worlds 8,32 --out "$(name ring_precision "$sfx")"
}

stage_packed() {
  case "${1:-p8}" in
    p8)  # the target (P = 8, balanced): every mix; step 5 on and off; the exchange overlapped; a profile under load
      python3 benchmarks/varlen_sim.py --worlds 8 --modes balanced --out "$(name varlen_sim "$sfx")"
      python3 benchmarks/varlen_sim.py --mixes uniform_64k,tail_256k --worlds 8 --modes balanced,unrefined \
        --out "$(name varlen_step5 "$sfx")"
      python3 benchmarks/varlen_sim.py --mixes uniform_64k,tail_256k --worlds 8 --modes balanced \
        --exchange overlapped --out "$(name varlen_overlapped "$sfx")"
      python3 benchmarks/varlen_sim.py --mixes uniform_64k,one_64k --worlds 8 --modes balanced --profile all \
        --out "$(name varlen_profile "$sfx")"
      ;;
    modes)  # P = 4, and the per-document placements (ring, allgather) beside the balanced one
      python3 benchmarks/varlen_sim.py --worlds 4 --modes balanced --out "$(name varlen_sim_p4 "$sfx")"
      python3 benchmarks/varlen_sim.py --mixes uniform_64k,short_128k --worlds 8 --modes ring,allgather \
        --out "$(name varlen_modes "$sfx")"
      python3 benchmarks/ulysses_sim.py --out "$(name ulysses_sim "$sfx")"
      python3 benchmarks/ulysses_sim.py --packed uniform_64k,uniform_256k,short_128k,tail_256k \
        --out "$(name ulysses_sim_packed "$sfx")"
      ;;
    tiles)  # the per-tile constant of FA4's varlen forward and backward (pieces deep in a document: many tiles)
      python3 benchmarks/varlen_tile_cost.py --out "$(name varlen_tile_cost "$sfx")"
      ;;
    *) echo "packed PART: p8 | modes | tiles" >&2; return 2 ;;
  esac
}

stage_host() {
  if [ "${1:-}" = qring ]; then  # PART qring: MHA, whose backward runs the q ring (one buffer a hop after the first)
    python3 benchmarks/host_cost.py --tokens 4096 --worlds 4,8 --kv-heads 32 --no-baselines \
      --out "$(name host_cost_mha "$sfx")"
    return
  fi
  if [ "${1:-}" = dkv ]; then  # PART dkv: 4k a rank, one head group against two (launches a rank-step, and the
    # half-head blocks' wave quantization at short chunks: of calls alone at P = 4 is 0.936 with two), same call
    for g in 2 1; do
      RINGFA4_DKV_GROUPS=$g python3 benchmarks/host_cost.py --tokens 4096 --worlds 4,8 --no-baselines \
        --out "$out/host_cost_dkv${g}_$sfx.json"
    done
    return
  fi
  if [ "${1:-}" = real ]; then  # PART real: rank 0 of a real group alone on the GPU (stub peers, _real_rank.py)
    python3 benchmarks/host_cost.py --tokens 4096 --worlds 4,8 --real-rank --peers stub --no-simulated \
      --hops loopback,stream-ordered,nccl-self --metadata-check new_shapes,every_call --graphs --reps 16 --queued-ms 200 \
      --profile --out "$(name host_cost_real "$sfx")"
    python3 benchmarks/nccl_post.py --out "$(name nccl_post "$sfx")"  # a hop's NCCL post: torch's batch or ours
    return
  fi
  if [ "${1:-}" = rows ]; then  # PART rows TOKENS WORLDS: one size a call
    python3 benchmarks/host_cost.py --tokens "$2" --worlds "$3" --graphs --no-baselines \
      --out "$out/host_cost${v}_${2}_p${3}_$sfx.json"
    return
  fi
  if [ "${1:-}" != rest ]; then  # the default PART: 4k a rank, the baselines, the profile
    python3 benchmarks/host_cost.py --tokens 4096 --worlds 4,8 --graphs --profile --out "$(name host_cost "$sfx")"
    python3 benchmarks/tape_entries.py --worlds 4,8 --out "$(name tape_entries "$sfx")"
    return
  fi
  python3 benchmarks/host_cost.py --tokens 4096 --worlds 4,8 --packed --real-rank --no-dense --no-baselines \
    --out "$(name host_cost_rest "$sfx")"
  python3 benchmarks/check_cost.py --worlds 2,4,8 --out "$(name check_cost "$sfx")"
  python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
    --out "$(name ring_profile "$sfx")" "$@"
  python3 benchmarks/hop_overlap.py --out "$(name hop_overlap "$sfx")"
}

stage_capacity() {
  case "${1:-2l}" in
    2l)
      python3 benchmarks/capacity.py --mode ringfa4 --layers 2 --seqs 524288,1048576 --gpu-budget-gib 8.5 \
        --host-budget-gib 9 --group 2 --no-warm --memory-trace --out "$(name capacity_2l "$sfx")"
      python3 benchmarks/memory_formula.py benchmarks/results/capacity_h200.json "$(name capacity_2l "$sfx")" \
        --out "$(name memory_formula "$sfx")"
      python3 benchmarks/plot_capacity.py benchmarks/results/capacity_h200.json "$(name capacity_2l "$sfx")" \
        "$out/capacity${v}_$sfx.png" || echo "(plot skipped: matplotlib missing?)"
      ;;
    32k)
      python3 benchmarks/capacity.py --mode plain --layers 32 --seqs 32768 --out "$(name capacity_32k_plain "$sfx")"
      python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 32768 --gpu-budget-gib 48 \
        --host-budget-gib 90 --shares --out "$(name capacity_32k "$sfx")"
      ;;
    256k)
      python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 262144 --gpu-budget-gib 48 \
        --host-budget-gib 90 --no-warm --shares --out "$(name capacity_256k "$sfx")"
      ;;
    *) echo "capacity PART: 2l | 32k | 256k" >&2; return 2 ;;
  esac
}

stage_recipe() {
  case "${1:-dry}" in
    dry)
      python3 benchmarks/hf_llama8b.py --out "$(name hf_llama8b "$sfx")"
      for c in llama3_8b_1xh200 llama3_8b_1xh200_1m llama3_8b_8xh200_4m; do
        as_json "$(name "recipe_dry_$c" "$sfx")" python3 recipes/finetune.py "recipes/configs/$c.toml" --dry-run
      done
      ;;
    run)
      torchrun --standalone --nproc-per-node 1 recipes/finetune.py recipes/configs/llama3_8b_1xh200.toml \
        --set train.steps=4 --set log.progress=false --metrics-out "$out/recipe_llama3_8b${v}_1x$sfx.json"
      ;;
    *) echo "recipe PART: dry | run" >&2; return 2 ;;
  esac
}

stage_nccl() {  # NVLink multicast stays off (it can take a shared host's GPUs out of service)
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --standalone --nproc-per-node 2 benchmarks/ring_nccl.py --out "$(name ring_nccl "2x$sfx")" "$@"
  # the real rank's host time a rank-step over NCCL (stream-ordered hop waits), beside the stub rows
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    python3 benchmarks/host_cost.py --worlds 2 --tokens 4096,32768 --real-rank --no-simulated --no-baselines \
    --hops nccl,loopback --graphs --out "$(name host_cost_nccl "2x$sfx")"
}

stage=${1:-}
case "$stage" in
  tests|kernels|ring|packed|host|capacity|recipe|nccl) shift; "stage_$stage" "$@" ;;
  *) sed -n '2,/^# Set-up/p' "$0" >&2; exit 2 ;;
esac
