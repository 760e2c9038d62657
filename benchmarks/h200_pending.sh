#!/usr/bin/env bash
# The H200 runs of the open issues, in stages that each fit one device call (< 10 min).
# On the device, after `source .gpu/b/install.sh`:   bash benchmarks/h200_pending.sh STAGE
# Still owed (2026-12-01): nccl (no multi-GPU kind was lent), blackwell (no sm100 GPU). Every other stage has run (results in
# benchmarks/results, README); they stay as the way to re-run them.
#   kernels   GPU tests: FA4 backward into fp32 accumulators (RINGFA4_FP32_GRADS), the ring on it, the
#             CuTe combine, the fp32-output FA4 forward, offload, merge paths (~4 min)
#   ring      where a ring step's time goes; fp32 block gradients (and with slots): speed and precision
#   grads     fp32 block gradients with dK/dV in FA4's tile layout: GPU tests, speed (0 vs 1), profile, precision
#   merge     the ring forward merging inside FA4's epilogue (kernels/fa4_merge.py): GPU tests, speed 0 vs 1,
#             forward profile, precision (~5 min)
#   groups    the ring backward's dK/dV in two kv-head groups added in place (RINGFA4_DKV_GROUPS): GPU tests, hop
#             overlap, ring_sim at both levels (groups 2 vs 1), profile (~6 min)
#   overlap   poisoned / delayed hop tests; hop_overlap: do the loopback copies hide behind FA4's kernels? (~2 min)
#   planes    the merging epilogue keeps the running lse as (M, S) planes: GPU tests, precision, ring_sim, profile
#   plan      after the backward's per-generation plans (kernels/fa4_bwd_plan.py): its sm90 GPU tests (~5 min)
#   rest      the GPU tests that stage planes does not run, then ring_sim at the executor level (~8 min)
#   gaps      where the compute stream idles (waiting for hops or not), forward and forward+backward (~4 min)
#   engine    hops on the copy engines (RINGFA4_LOOPBACK_COPY): GPU tests, hop_overlap, ring_sim engine vs torch (~5 min)
#   nocopy    ring_sim executor level with hops that copy nothing once warm (attribution), then with copies (~2 min)
#   hoist     the merging epilogue's loads all issued first and prefetched into L2 at the tile's start, the first
#             block stored into an uninitialized accumulator: GPU tests, kernel costs per block shape (three
#             builds), ring_sim executor with and without copies
#   qring     the q ring backward (parallel/bwd_sides.py: q side and fp32 dq travel, K/V and dK/dV stay): ring GPU
#             tests, ring_sim fwd+bwd executor with RINGFA4_BWD_RING=kv vs auto (q for MHA), precision P = 8 / 32
#   sizes     what a hop costs the kernels at 1/4, 1/2, 1 and 2x its bytes (hop_overlap --sizes), then ring_sim at
#             the executor level with today's defaults, with and without copies (~5 min)
#   ringab    the two backward rings in one call: ring_sim fwd+bwd executor, hops that copy nothing and with copies
#   qprof     where the q ring's fwd+bwd time goes against the K/V ring's (ring_profile, MHA, 64k, P = 8)
#   close     today's defaults at the executor level (ring_sim fwd and fwd+bwd, hops that copy and hops that copy
#             nothing, one call), precision at P = 8 / 32 (~6 min)
#   persist   (a tried variant: first `git apply benchmarks/results/fa4_persistent_tried.patch`) the fp32 / merging
#             forwards of unmasked blocks as persistent kernels (RINGFA4_FA4_PERSISTENT=1): GPU tests, kernel costs
#             per block shape (persistent next to one CTA a tile), ring_sim executor (~7 min)
#   tma       (a tried variant: first `git apply benchmarks/results/fa4_fp32_tma_store_tried.patch`) the fp32-output
#             forward storing O through a float32 sO and TMA: GPU tests, kernel costs per block shape (TMA against
#             the register stores) (~5 min)
#   verify2   the fp32 / merging forward's and the ring's GPU tests alone (~4 min)
#   settle    ring_sim at the executor level with today's defaults, 15 rounds, hops that copy nothing and with copies
#   paired    the merging forward's cost per block shape with two ring steps in one call (8k x 8k, 4k x 16k) next
#             to today's shapes, then `close` (~8 min)
#   ncu       Nsight Compute of FA4's forward, our fp32-output one and the merging one at 8k x 4k: stall samples per
#             SASS line (benchmarks/ncu_merge_epilogue.sh, ~1 min)
#   async     (a tried variant: first `git apply benchmarks/results/fa4_merge_async16_tried.patch`) the merging
#             epilogue's accumulator tile copied into shared memory by cp.async in 16-byte chunks during the mainloop:
#             GPU tests, kernel costs per block shape (the patch's build; compare a run of fa4_merge_epilogue.py
#             without it), ncu (~6 min); then `close` for ring_sim with it
#   blackwell (owed: no Blackwell GPU lent) the sm100 paths that only compile so far: FA4's accumulating backward
#             (kernels/fa4_bwd_plan.py) and fp32-output forward, forced on: GPU tests, precision at P = 8 / 32
#   nccl      (kind nvidia-h200-x2; needs .gpu staged the same way) the NCCL ring against the simulated one,
#             deterministic and default backward, and weak scaling vs PyTorch CP + cuDNN (~4 min)
#   verify    the ring's fp32-gradient GPU tests alone (~2 min)
#   final     the rest of the GPU suite with today's defaults, precision at P = 8 / 32, ring_sim at both levels and
#             with hops that copy nothing (attribution) (~7 min)
#   wire      default settings (fp32 grads on) through the ring / packing GPU tests; dK/dV on a bf16 wire: speed, precision
#   capacity  512k and 1M tokens on a 2-layer Llama-3.1-8B shape with the allocator trace (~5 min)
#   fulldepth 32 layers at 256k with the default tools and the attention/MLP/loss shares (~6 min)
#   baseline  32 layers at 32k: plain transformers and ringfa4 (shares) in one call (~6 min)
#   recipe    llama3_8b_1xh200.toml, one 32k document a step, vs plain transformers (~8 min: 600 s call)
# JSON lands in ${OUT:-bench_results}.
set -uo pipefail
out=${OUT:-bench_results}
mkdir -p "$out"

merge_gpu_tests() {  # the fp32 / merging forward's and the ring's GPU tests, a summary line
  timeout 300 python3 -m pytest -m gpu -q tests/test_fa4_fp32.py tests/test_ring_gpu.py 2>&1 \
    | grep -E "passed|failed|^E " | head -20
}

ring_exec() {  # ring_sim at the executor level, 64k, P = 8, causal; $1: JSON tag, $2: hops, rest: its options
  local tag=$1 hops=$2
  shift 2
  python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor --hops "$hops" "$@" \
    --out "$out/ring_sim_64k_p8_${tag}_$hops.json" 2>&1 | grep "^| 64k"
}
case "${1:-}" in
  kernels)
    python3 -m pytest -m gpu -q tests/test_fa4_bwd_accum.py tests/test_ring_gpu.py tests/test_cute_combine.py \
      tests/test_fa4_fp32.py tests/test_offload.py tests/test_cute_merge.py tests/test_packing_gpu.py 2>&1 \
      | grep -E "passed|failed|^E " | head -40
    ;;
  ring)
    python3 benchmarks/ring_profile.py --seq 65536 --world 8 --out "$out/ring_profile_64k_p8.json" | tail -22
    for env in "RINGFA4_FP32_GRADS=0" "RINGFA4_FP32_GRADS=1" "RINGFA4_FP32_GRADS=1 RINGFA4_RING_SLOTS=8"; do
      tag=$(echo "$env" | tr ' =' '__')
      echo "== $env"
      env $env python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --out "$out/ring_sim_$tag.json" | tail -3
    done
    RINGFA4_FP32_GRADS=1 python3 benchmarks/ring_precision.py --worlds 8,32 \
      --out "$out/ring_precision_fp32_grads.json" | tail -5
    ;;
  grads)
    python3 -m pytest -m gpu -q tests/test_fa4_bwd_accum.py tests/test_ring_gpu.py 2>&1 | grep -E "passed|failed|^E " | head -30
    for g in 0 1; do
      echo "== RINGFA4_FP32_GRADS=$g"
      RINGFA4_FP32_GRADS=$g python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes \
        --out "$out/ring_sim_fp32_grads_$g.json" 2>&1 | grep "^| 64k"
    done
    RINGFA4_FP32_GRADS=1 python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
      --out "$out/ring_profile_64k_p8_mha_fp32_grads.json" 2>&1 | grep "^|" | head -24
    RINGFA4_FP32_GRADS=1 python3 benchmarks/ring_precision.py --worlds 8,32 \
      --out "$out/ring_precision_fp32_grads.json" 2>&1 | tail -4
    ;;
  merge)
    python3 -m pytest -m gpu -q tests/test_fa4_fp32.py tests/test_ring_gpu.py -k "merge or fp32_forward" 2>&1 \
      | grep -E "passed|failed|^E " | head -30
    for m in 0 1; do
      echo "== RINGFA4_EPILOGUE_MERGE=$m"
      RINGFA4_EPILOGUE_MERGE=$m python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes \
        --out "$out/ring_sim_64k_p8_epilogue_merge_$m.json" 2>&1 | grep "^| 64k"
    done
    RINGFA4_EPILOGUE_MERGE=1 python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
      --forward-only --out "$out/ring_profile_64k_p8_fwd_epilogue_merge.json" 2>&1 | grep "^|" | head -14
    RINGFA4_EPILOGUE_MERGE=1 python3 benchmarks/ring_precision.py --worlds 8,32 \
      --out "$out/ring_precision_epilogue_merge.json" 2>&1 | tail -4
    ;;
  groups)
    python3 -m pytest -m gpu -q tests/test_fa4_bwd_accum.py tests/test_ring_gpu.py tests/test_packing_gpu.py 2>&1 \
      | grep -E "passed|failed|^E " | head -30
    python3 benchmarks/hop_overlap.py --out "$out/hop_overlap.json" 2>&1 | grep "^|"
    for g in 2 1; do
      echo "== RINGFA4_DKV_GROUPS=$g"
      RINGFA4_DKV_GROUPS=$g python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes \
        --out "$out/ring_sim_64k_p8_dkv_groups_$g.json" 2>&1 | grep "^| 64k"
    done
    python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
      --out "$out/ring_profile_64k_p8_mha_dkv_groups_2.json" 2>&1 | grep -E "^\||^host" | head -24
    ;;
  overlap)
    python3 -m pytest -m gpu -q tests/test_ring_gpu.py -k "poison" 2>&1 | grep -E "passed|failed|^E " | head -20
    python3 benchmarks/hop_overlap.py --out "$out/hop_overlap.json" 2>&1 | grep "^|"
    ;;
  hoist)
    merge_gpu_tests
    python3 benchmarks/fa4_merge_epilogue.py --out "$out/fa4_merge_epilogue.json" 2>&1 | grep "^|"
    for hops in copy none; do ring_exec hoist $hops; done
    ;;
  qring)
    timeout 330 python3 -m pytest -m gpu -q tests/test_ring_gpu.py 2>&1 | grep -E "passed|failed|^E " | head -20
    for ring in kv auto; do
      echo "== RINGFA4_BWD_RING=$ring"
      RINGFA4_BWD_RING=$ring python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor \
        --passes fwd+bwd --out "$out/ring_sim_64k_p8_bwd_ring_$ring.json" 2>&1 | grep "^| 64k"
    done
    python3 benchmarks/ring_precision.py --worlds 8,32 --out "$out/ring_precision_q_ring.json" 2>&1 | tail -4
    ;;
  sizes)
    python3 benchmarks/hop_overlap.py --sizes 0.25,0.5,1,2 --out "$out/hop_overlap_sizes.json" 2>&1 | grep "^|"
    for hops in copy none; do ring_exec final $hops; done
    ;;
  persist)  # with fa4_persistent_tried.patch applied: unmasked blocks' forwards as persistent kernels
    merge_gpu_tests
    python3 benchmarks/fa4_merge_epilogue.py --out "$out/fa4_merge_epilogue_persistent.json" 2>&1 | grep "^|"
    for hops in none copy; do ring_exec persistent $hops; done
    ;;
  tma)  # with fa4_fp32_tma_store_tried.patch applied: O through a float32 sO and a TMA store
    merge_gpu_tests
    python3 benchmarks/fa4_merge_epilogue.py --out "$out/fa4_merge_epilogue_tma.json" 2>&1 | grep "^|"
    ;;
  verify2)  # after a refactor of the fp32 / merging forward's and the backward sink's arguments
    merge_gpu_tests
    ;;
  settle)  # today's defaults with three times the rounds, to narrow the medians against the 5% targets
    for hops in none copy; do ring_exec settle $hops --rounds 15; done
    ;;
  paired)  # what the merging forward costs per call when two ring steps share one call
    python3 benchmarks/fa4_merge_epilogue.py --shapes paired --out "$out/fa4_merge_epilogue_paired.json" 2>&1 | grep "^|"
    ;&
  close)
    for hops in none copy; do ring_exec close $hops; done
    python3 benchmarks/ring_precision.py --worlds 8,32 --out "$out/ring_precision_close.json" 2>&1 | tail -4
    ;;
  ncu)
    bash benchmarks/ncu_merge_epilogue.sh 2>&1 | tail -60
    ;;
  async)
    merge_gpu_tests
    python3 benchmarks/fa4_merge_epilogue.py --out "$out/fa4_merge_epilogue_async16.json" 2>&1 | grep "^|"
    bash benchmarks/ncu_merge_epilogue.sh 2>&1 | grep -E "Duration|section|after" | head
    ;;
  ringab)
    for hops in none copy; do
      for ring in kv q; do
        echo "== RINGFA4_BWD_RING=$ring hops=$hops"
        RINGFA4_BWD_RING=$ring python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor \
          --passes fwd+bwd --hops $hops --out "$out/ring_sim_64k_p8_bwd_ring_${ring}_$hops.json" 2>&1 | grep "^| 64k"
      done
    done
    ;;
  qprof)
    for ring in q kv; do
      RINGFA4_BWD_RING=$ring python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
        --out "$out/ring_profile_64k_p8_mha_bwd_ring_$ring.json" 2>&1 | grep -E "^\||compute stream|host" | head -16
    done
    ;;
  nocopy)
    python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor --hops none \
      --out "$out/ring_sim_64k_p8_no_copies.json" 2>&1 | grep "^| 64k"
    python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor \
      --out "$out/ring_sim_64k_p8_exec.json" 2>&1 | grep "^| 64k"
    ;;
  planes)
    timeout 330 python3 -m pytest -m gpu -q tests/test_fa4_fp32.py tests/test_ring_gpu.py tests/test_copy_engine.py 2>&1 \
      | grep -E "passed|failed|^E " | head -20
    python3 benchmarks/ring_precision.py --worlds 8,32 --out "$out/ring_precision_planes.json" 2>&1 | tail -4
    for lvl in api executor; do
      python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level $lvl \
        --out "$out/ring_sim_64k_p8_planes_$lvl.json" 2>&1 | grep "^| 64k"
    done
    python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
      --forward-only --out "$out/ring_profile_64k_p8_fwd_planes.json" 2>&1 | grep -E "^\||^host" | head -14
    ;;
  plan)
    timeout 400 python3 -m pytest -m gpu -q tests/test_fa4_bwd_accum.py tests/test_ring_gpu.py \
      -k "not epilogue and not hybrid and not poison" 2>&1 | grep -E "passed|failed|^E " | head -20
    ;;
  rest)
    timeout 420 python3 -m pytest -m gpu -q tests --ignore=tests/test_fa4_fp32.py --ignore=tests/test_ring_gpu.py \
      --ignore=tests/test_copy_engine.py 2>&1 | grep -E "passed|failed|^E " | head -20
    python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor \
      --out "$out/ring_sim_64k_p8_planes_executor_2.json" 2>&1 | grep "^| 64k"
    ;;
  gaps)
    for c in engine torch; do
      echo "== forward, RINGFA4_LOOPBACK_COPY=$c"
      RINGFA4_LOOPBACK_COPY=$c python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
        --forward-only --out "$out/ring_profile_64k_p8_fwd_gaps_$c.json" 2>&1 | grep -E "^\||^host|^compute" | head -9
    done
    echo "== forward+backward"
    python3 benchmarks/ring_profile.py --seq 65536 --world 8 --heads 32 --kv-heads 32 \
      --out "$out/ring_profile_64k_p8_gaps.json" 2>&1 | grep -E "^\||^host|^compute" | head -16
    ;;
  engine)
    python3 -m pytest -m gpu -q tests/test_ring_gpu.py tests/test_copy_engine.py -k "poison or engine" 2>&1 \
      | grep -E "passed|failed|^E " | head -20
    python3 benchmarks/hop_overlap.py --out "$out/hop_overlap_engine.json" 2>&1 | grep "^|"
    for c in engine torch; do
      for lvl in api executor; do
        echo "== RINGFA4_LOOPBACK_COPY=$c level $lvl"
        RINGFA4_LOOPBACK_COPY=$c python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level $lvl \
          --out "$out/ring_sim_64k_p8_copy_${c}_$lvl.json" 2>&1 | grep "^| 64k"
      done
    done
    ;;
  blackwell)
    RINGFA4_FP32_GRADS=1 RINGFA4_FP32_PARTIALS=1 python3 -m pytest -m gpu -q tests/test_fa4_bwd_accum.py \
      tests/test_fa4_fp32.py tests/test_ring_gpu.py 2>&1 | grep -E "passed|failed|^E " | head -30
    RINGFA4_FP32_GRADS=1 RINGFA4_FP32_PARTIALS=1 python3 benchmarks/ring_precision.py --worlds 8,32 \
      --out "$out/ring_precision_sm100.json" 2>&1 | tail -4
    ;;
  nccl)
    torchrun --standalone --nproc-per-node 2 benchmarks/ring_nccl.py --out "$out/ring_nccl.json" 2>&1 \
      | grep -E "^\{|^\||Error" | tail -12
    ;;
  verify)
    python3 -m pytest -m gpu -q tests/test_ring_gpu.py tests/test_fa4_bwd_accum.py -k "fp32_block_gradients or in_place" \
      2>&1 | grep -E "passed|failed|^E " | head -20
    ;;
  final)
    timeout 300 python3 -m pytest -m gpu -q tests/test_fa4_fp32.py tests/test_fa4_gpu.py tests/test_offload.py \
      tests/test_cute_merge.py tests/test_cute_combine.py tests/test_merge_triton.py tests/test_sdpa_gpu.py \
      "tests/test_ring_gpu.py::test_in_place_dkv_groups_under_poison_and_delay" 2>&1 \
      | grep -E "passed|failed|^E " | head -20
    python3 benchmarks/ring_precision.py --worlds 8,32 --out "$out/ring_precision.json" 2>&1 | tail -4
    python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --out "$out/ring_sim_64k_p8.json" 2>&1 | grep "^| 64k"
    python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --level executor --hops none \
      --out "$out/ring_sim_64k_p8_no_copies.json" 2>&1 | grep "^| 64k"
    ;;
  wire)
    python3 -m pytest -m gpu -q tests/test_ring_gpu.py tests/test_packing_gpu.py 2>&1 | grep -E "passed|failed|^E " | head -30
    RINGFA4_DKV_WIRE=input python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes \
      --out "$out/ring_sim_64k_p8_wire_bf16.json" 2>&1 | grep "^| 64k"
    RINGFA4_DKV_WIRE=input python3 benchmarks/ring_precision.py --worlds 8,32 \
      --out "$out/ring_precision_wire_bf16.json" 2>&1 | tail -4
    ;;
  capacity)
    python3 benchmarks/capacity.py --mode ringfa4 --layers 2 --seqs 524288,1048576 --gpu-budget-gib 8.5 \
      --host-budget-gib 9 --group 2 --no-warm --memory-trace --out "$out/capacity_2l_512k_1m.json" | tail -40
    ;;
  fulldepth)
    python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 262144 --gpu-budget-gib 48 \
      --host-budget-gib 90 --no-warm --shares --out "$out/capacity_32l_256k_lean.json" | tail -6
    ;;
  baseline)
    python3 benchmarks/capacity.py --mode plain --layers 32 --seqs 32768 --out "$out/capacity_plain_32k.json" | tail -3
    python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 32768 --gpu-budget-gib 48 --host-budget-gib 90 \
      --shares --out "$out/capacity_32l_32k_lean.json" | tail -3
    ;;
  recipe)
    torchrun --standalone --nproc-per-node 1 recipes/finetune.py recipes/configs/llama3_8b_1xh200.toml \
      --set train.steps=4 --set log.progress=false --metrics-out "$out/recipe_llama3_8b_32k_doc.json" 2>&1 \
      | grep -E "^step|OK|Error" | tail -6
    python3 benchmarks/capacity.py --mode plain --layers 32 --seqs 32768 --out "$out/capacity_plain_32k.json" | tail -3
    ;;
  *)
    echo "usage: bash benchmarks/h200_pending.sh STAGE (see the header)" >&2
    exit 2
    ;;
esac
