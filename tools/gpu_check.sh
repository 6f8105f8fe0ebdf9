#!/usr/bin/env bash
# The one-shot GPU check: the gpu-marked tests, CP2 vs CP1 (two GPUs), TE vs local specs, the 1B train step (tokens/s, MFU),
# the log-prob path's memory at T = 32,768, the tensor-mode weight sync and, when present, the SGLang
# sync check, within one time budget (default 450 s); prints one JSON summary. Each step is recorded
# as ok, failed or skipped with the reason; without CUDA every step is skipped, saying so.
# Steps and options: tools/gpu_check.py.   bash tools/gpu_check.sh [--budget-s 450] [--only a,b] [--dry-run]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
exec "$py" tools/gpu_check.py "$@"
