source .gpu/b/install.sh
python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 262144 --no-warm --shares --gpu-budget-gib 48 --host-budget-gib 90 --out $OUT/cap_full_256k.json 2>&1 | tail -3
python3 benchmarks/capacity.py --mode ringfa4 --layers 2 --seqs 32768,65536,131072,262144,524288 --gpu-budget-gib 48 --host-budget-gib 90 --out $OUT/cap_2l.json 2>&1 | tail -8
