#!/usr/bin/env bash
# The GPU check (issue 32 item 6), for one machine with one CUDA GPU and torch, transformers, lightning and accelerate
# installed, reaching nothing. Prepare its inputs here first: `bash benchmarks/gpu_prepare.sh` (the wheels it installs
# are listed there), then run it there with .whl and .dk carried, e.g. the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".dk"], timeout_s=540)
# In <= 8 minutes: installs draftkit and the wheels into /tmp/site, runs the `gpu` tests (tests/gpu, tests/analysis),
# then benchmarks/gpu_check.py (attention on CUDA, 1-GPU DDP fits of the tiny recipe and of SmolLM2 for a fixed
# number of steps with tokens/s and peak memory, the same two fits with the target sharded by FSDP2 (trainer.strategy
# fsdp_target, one shard on one GPU; tiny's head compared with the DDP run's), evaluate on CUDA with greedy_equal)
# and prints one summary table.
# Outputs under $OUT (or ./gpu_check_out): pytest.log, gpu_check.log, gpu_check.json, evaluate_cuda.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DRAFTKIT_CACHE=/tmp/draftkit-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 3
export PYTHONPATH=/tmp/site
python3 -c "import torch, transformers, lightning, datasets, draftkit.callbacks; print('gpu_check:', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'datasets', datasets.__version__)" || exit 3
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/analysis/test_collect_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -15
timeout 330 python3 benchmarks/gpu_check.py --assets .dk --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log" | grep -v "^INFO\|Loading weights\|it/s\]" | tail -40
