#!/usr/bin/env bash
# The one-shot GPU check, v2: a probe of torch (versions, _grouped_mm, the varlen signature, SDPA backends), then
# the gpu-marked tests, CP2 vs CP1 (two GPUs), TE vs local specs, the 1B train step on the local specs' slow path vs
# the fast one (grouped experts, SDPA; same weights: loss/grad-norm difference, tokens/s, MFU, top-10 kernels),
# experts and attention micro-benchmarks, the log-prob path's memory at T = 32,768 and 65,536, the tensor-mode
# weight sync and, when present, the SGLang sync check, within one time budget (default 480 s); prints one JSON
# summary (docs/benchmarks.md). Each step is recorded as ok, failed or skipped with the reason; without CUDA every
# step is skipped, saying so.
# Steps and options: tools/gpu_check.py.   bash tools/gpu_check.sh [--budget-s 480] [--only a,b] [--dry-run]
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
