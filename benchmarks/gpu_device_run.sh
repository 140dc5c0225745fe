#!/usr/bin/env bash
# What a session runs on a lent GPU machine (the device tool), in two calls that fit its 15 minutes:
#   bash benchmarks/gpu_device_run.sh tests    # pytest -m gpu, then two workloads recorded
#   bash benchmarks/gpu_device_run.sh record   # the saturated bf16 run judged live, and three more
#   bash benchmarks/gpu_device_run.sh cost     # stepscope-exporter vs nvitop-exporter in two windows (no pushes, then
#                                              8 ranks pushing to ours), our CPU by part and by code (issue 20);
#                                              WINDOW=80 PROFILE=30 for a shorter run (default 120 s each and 60 s)
# The machine has torch, nvidia-ml-py, grpcio, pyyaml; h11, bcrypt, py-spy, nvitop and nvitop-exporter travel as
# wheels in .whl/ (`pip download --no-deps h11 bcrypt py-spy nvitop nvitop-exporter`) and
# Debian's prometheus binary xz-compressed in .devbin/ (both ignored by git, named in the call's carry).
# Results land in $OUT: the pytest log, nvidia-smi, and a recording (benchmarks/record_gpu_corpus.py).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1  # the tests' children
export PYTHONPATH="$PWD"
mkdir -p /tmp/bin && xz -dc .devbin/prometheus.xz > /tmp/bin/prometheus && chmod +x /tmp/bin/prometheus || exit 1
export PATH="/tmp/bin:$PATH"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
prefix=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]*' | tr 'H' 'h')
case "${1:-}" in
  tests)
    timeout 260 python3 -m pytest -m gpu -p no:cacheprovider -q --timeout 240 \
      tests/test_gpu_truth.py tests/test_hooks_gpu.py tests/test_profile_e2e.py tests/test_mfu_gpu.py tests/test_cuda_memory_gpu.py \
      2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
    python3 benchmarks/record_gpu_corpus.py --out "$OUT/rec1" --prefix "$prefix" --judge \
      input_copy_bound=60 cpu_preprocess=60 2>&1 | tail -20
    ;;
  record)
    python3 benchmarks/record_gpu_corpus.py --out "$OUT/rec2" --prefix "$prefix" --judge \
      mlp_bf16=120 conv_bf16=60 ddp_two_ranks=60 2>&1 | tail -20
    ;;
  cost)
    timeout 400 python3 benchmarks/bench_gpu.py --side-by-side --window "${WINDOW:-120}" \
      --profile-seconds "${PROFILE:-60}" 2>&1 | tail -80
    cp benchmarks/results/gpu-side-by-side.md "$OUT/"
    ;;
  *) echo "usage: $0 tests|record|cost" >&2; exit 2 ;;
esac
