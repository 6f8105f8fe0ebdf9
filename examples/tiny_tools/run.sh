#!/usr/bin/env bash
# The tiny_tools example end to end, from the repository root of a set-up checkout:
#   1. prepare.py: task data (train / held-out / SFT traces) and the randomly initialised tiny Qwen3-MoE
#   2. megatron-rl sft (sft.yaml): the warm start on tool-use traces -> runs/tiny_tools/sft/hf
#   3. megatron-rl train (rl.yaml): RL with GSPO-token, per-turn credit -> runs/tiny_tools/rl
# Both training stages run on 2 ranks (EP=2) with gloo; RL uses the local rollout engine, and every
# rollout is a multi-turn episode of examples/tiny_tools/tools_env.py (the calculator tool).
#   bash examples/tiny_tools/run.sh [key=value ...]     # RL overrides, e.g. train.steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
launch=(python -m megatron_rl.torchrun --standalone --nproc-per-node 2 -m megatron_rl.cli)

python examples/tiny_tools/prepare.py --out runs/tiny_tools/assets
"${launch[@]}" sft examples/tiny_tools/sft.yaml
"${launch[@]}" train examples/tiny_tools/rl.yaml "$@"
megatron-rl plot runs/tiny_tools/rl > /dev/null   # curves: runs/tiny_tools/rl/plots/
