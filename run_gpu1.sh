#!/bin/bash
# GPU call 1: kernels' GPU tests, profile and a quick benchmark of the new path, the old path (main) for comparison.
cd "$(dirname "$0")"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 80 python -m pytest -q -x tests/test_llada2_kernels_gpu.py -p no:cacheprovider > $OUT/tests_gpu.log 2>&1
timeout 60 python benchmarks/bench_llada2.py --profile 1,32 > $OUT/profile_new.log 2>&1
timeout 80 python benchmarks/bench_llada2.py --batch-sizes 1,32 --tokens-per-step 1 --repeats 1 > $OUT/bench_new.log 2>&1
cd ../..
timeout 70 python benchmarks/bench_llada2.py --batch-sizes 1,32 --tokens-per-step 1 --repeats 1 > $OUT/bench_old.log 2>&1
tail -3 $OUT/*.log
