#!/usr/bin/env bash
# Nsight Compute of the ring's forward kernels (benchmarks/ncu_merge_epilogue.py); report and summary in ${OUT:-bench_results}.
set -uo pipefail
out=${OUT:-bench_results}
mkdir -p "$out"
ncu --profile-from-start off --target-processes all -f -o "$out/merge_epilogue" \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SourceCounters --section MemoryWorkloadAnalysis --section SchedulerStats \
  python3 benchmarks/ncu_merge_epilogue.py "$@" 2>&1 | grep -v "^==PROF==" | tail -5
python3 benchmarks/ncu_merge_epilogue.py --summary "$out/merge_epilogue.ncu-rep" 2>&1 | tee "$out/merge_epilogue_summary.txt"
