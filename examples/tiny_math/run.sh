#!/usr/bin/env bash
# The reduced-size example end to end, from the repository root of a set-up checkout:
#   1. prepare.py: task data (train / held-out / SFT mix) and the randomly initialised tiny Qwen3-MoE
#   2. megatron-rl sft (sft.yaml): the warm start -> runs/tiny_math/sft/hf
#   3. megatron-rl train (rl.yaml): RL with DAPO -> runs/tiny_math/rl (metrics.jsonl, plots/, hf/)
# Both training stages run on 2 ranks (EP=2) with gloo; RL uses the local rollout engine.
#   bash examples/tiny_math/run.sh [key=value ...]     # RL overrides, e.g. algorithm.name=gspo
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/tiny_math/cpu.env   # the same CPU kernels on every machine
launch=(python -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_rl.cli)

python examples/tiny_math/prepare.py --out runs/tiny_math/assets --sft-rows 76800 --sft-correct-fraction 0.4
"${launch[@]}" sft examples/tiny_math/sft.yaml
"${launch[@]}" train examples/tiny_math/rl.yaml "$@"
megatron-rl plot runs/tiny_math/rl > /dev/null   # curves: runs/tiny_math/rl/plots/
