#!/usr/bin/env bash
# A change against its parent commit on one GPU, interleaved in one device call (the "no change to
# results" check of a refactor). BASE is a tree of the parent (on the build machine:
#   git archive <parent> ringfa4 benchmarks tests recipes pyproject.toml | tar -x -C .base
# with benchmarks/results left out, then carried to the device with ".base").
#
#   bash benchmarks/compare_parent.sh BASE sim    ring_sim 64k, P = 8, causal, executor level, fwd and
#                                                 fwd+bwd, in the order parent, this, this, parent
#   bash benchmarks/compare_parent.sh BASE prec   ring_precision at P = 8 and 32: parent, this
#   bash benchmarks/compare_parent.sh BASE host   host_cost.py (this tree's script on each tree's library): 4k
#                                                 tokens a rank, P = ${WORLDS:-8}, eager, host time only; parent,
#                                                 this (HOST_ARGS: more flags, e.g. "--reps 16 --queued-ms 250";
#                                                 real-rank rows: "--real-rank --peers stub --hops nccl-self
#                                                 --no-simulated --metadata-check new_shapes")
#   bash benchmarks/compare_parent.sh BASE packed [MIXES]  varlen_sim.py (each tree's own script on its
#                                                 library): the balanced placement of MIXES (default
#                                                 uniform_64k,tail_256k) at P = 8 and 4; parent, this
#   bash benchmarks/compare_parent.sh BASE sim VAR=VALUE...   the parent's ring_sim with its RINGFA4_* variables
#
# JSON under ${OUT:-bench_results}: ring_sim_<tag>.json, ring_precision_<tag>.json. The FA4 wheels'
# site (benchmarks/gpu.sh's set-up, /tmp/ringfa4-site on the device) is on PYTHONPATH after the tree.
set -u
base=$(cd "$1" && pwd); what=$2; shift 2
out=${OUT:-bench_results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
site=${RINGFA4_SITE:-/tmp/ringfa4-site}
extra="$site:$site/nvidia_cutlass_dsl/dsl_packages"
root=$(cd "$(dirname "$0")/.." && pwd)
sim() {  # tag tree [VAR=VALUE...]
  local tag=$1 tree=$2; shift 2
  echo "== ring_sim $tag"
  (cd "$tree" && env PYTHONPATH="$tree:$extra" "$@" python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes \
     --level executor --out "$out/ring_sim_$tag.json" 2>&1 | grep "^|")
}
prec() {
  local tag=$1 tree=$2
  echo "== ring_precision $tag"
  (cd "$tree" && env PYTHONPATH="$tree:$extra" python3 benchmarks/ring_precision.py --worlds 8,32 \
     --out "$out/ring_precision_$tag.json" 2>&1 | grep "^|\|full-call")
}
host() {  # the parent's library under this tree's host_cost.py (its flags), so both rows measure alike
  local tag=$1 tree=$2
  echo "== host_cost $tag"
  # shellcheck disable=SC2086
  env PYTHONPATH="$tree:$extra" timeout 240 python3 "$root/benchmarks/host_cost.py" --tokens 4096 \
     --worlds "${WORLDS:-8}" --host-only --no-baselines ${HOST_ARGS:-} --out "$out/host_cost_$tag.json" 2>&1 \
     | grep "^| simulated\|^| real-rank"
}
packed() {  # each tree's own varlen_sim.py (its one-rank transport speaks that library's transport API)
  local tag=$1 tree=$2 mixes=$3
  echo "== varlen_sim $tag"
  local rep=100  # ms of do_bench a call (trees before the sustained batches), or batches a round (since)
  grep -q "batches a round" "$tree/benchmarks/varlen_sim.py" && rep=3
  env PYTHONPATH="$tree:$extra" timeout 280 python3 "$tree/benchmarks/varlen_sim.py" --mixes "$mixes" --worlds 8,4 \
     --modes balanced --rep "$rep" --out "$out/varlen_sim_$tag.json" 2>&1 | grep "^|"
}
case "$what" in
  sim) if [ $# -gt 0 ]; then sim "parent_$(echo "$*" | tr ' =' '__')" "$base" "$@"
       else sim parent1 "$base"; sim this1 "$root"; sim this2 "$root"; sim parent2 "$base"; fi ;;
  prec) prec parent "$base"; prec this "$root" ;;
  host) host parent "$base"; host this "$root" ;;
  packed) packed parent "$base" "${1:-uniform_64k,tail_256k}"; packed this "$root" "${1:-uniform_64k,tail_256k}" ;;
  *) echo "usage: $0 BASE sim|prec|host|packed [VAR=VALUE...]" >&2; exit 2 ;;
esac
