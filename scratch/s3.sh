source .gpu/b/install.sh
python3 benchmarks/capacity.py --mode plain --layers 32 --seqs 32768 --out $OUT/cap_plain_32k.json 2>&1 | tail -3
python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 32768,65536,131072 --shares --gpu-budget-gib 48 --host-budget-gib 90 --out $OUT/cap_full_32k_128k.json 2>&1 | tail -5
python3 benchmarks/capacity.py --mode ringfa4 --layers 32 --seqs 131072 --no-warm --shares --cache-attention --gpu-budget-gib 48 --host-budget-gib 90 --out $OUT/cap_full_128k_cache.json 2>&1 | tail -3
