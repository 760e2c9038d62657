source .gpu/b/install.sh
python3 -m pytest -m gpu -x -q tests/test_cute_merge.py tests/test_offload.py tests/test_merge_triton.py 2>&1 | grep -v -i warn | tail -25
python3 benchmarks/merge.py --out $OUT/merge_h200.json 2>&1 | tail -12
for m in cute triton; do RINGFA4_MERGE=$m python3 benchmarks/ring_sim.py --quick --worlds 8 --causal yes --out $OUT/ring_sim_64k_p8_$m.json 2>&1 | tail -6; done
