source .gpu/b/install.sh
python3 -m pytest -m gpu -x -q tests/test_offload.py 2>&1 | grep -E "passed|failed|^E " | head -8
python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 32768 --shares --gpu-budget-gib 48 --host-budget-gib 90 --out $OUT/cap_full_32k_v2.json 2>&1 | tail -2
python3 benchmarks/capacity.py --mode ringfa4 --layers 2 --seqs 524288,1048576 --no-warm --gpu-budget-gib 8.5 --host-budget-gib 9 --group 2 --out $OUT/cap_2l_512k_1m.json 2>&1 | tail -3
python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 262144 --no-warm --gpu-budget-gib 48 --host-budget-gib 90 --out $OUT/cap_full_256k.json 2>&1 | tail -2
python3 benchmarks/hf_llama8b.py --seq 32768 --sim 0 --reps 1 --floor --out $OUT/hf_llama8b_floor_h200.json 2>&1 | grep -v Warn | tail -6
