#!/usr/bin/env bash
# The reduced-size example end to end, from the repository root of a set-up checkout:
#   1. prepare.py: task data (train / held-out / SFT mix) and the randomly initialised tiny Qwen3-MoE
#   2. megatron-rl sft (sft.yaml): the warm start -> runs/tiny_math/sft/hf
#   3. megatron-rl train (rl.yaml): RL with DAPO -> runs/tiny_math/rl (metrics.jsonl, plots/, hf/)
# Both training stages run on 2 ranks (EP=2) with gloo; RL uses the local rollout engine.
#   bash examples/tiny_math/run.sh [key=value ...]     # RL overrides, e.g. algorithm.name=gspo
# DISTILL=1: then 4. on-policy distillation (algorithm.name=opd) of the RL policy (the teacher, runs/tiny_math/rl/hf)
# into the warm start, with rl.yaml's other settings -> runs/tiny_math/opd. Measured (2026-12-06): 10.6% -> 93.8% in
# 40 steps (DAPO: 94.8%), +40 points at the first evaluation (step 5) as DAPO, 16 s against 18 s; evaluated every
# step, DAPO passes +40 at step 1 and OPD at step 2 (docs/benchmarks.md#on-policy-distillation)
# DISTILL=4to2: then 4. instead: a 2-layer student of the same tokenizer (tiny_model.py --layers 2), warm-started
# with sft.yaml on the same rows -> runs/tiny_math/sft_2layer, and on-policy distillation of the 4-layer RL policy
# into it -> runs/tiny_math/opd_2layer (docs/benchmarks.md#a-4-layer-teacher-and-a-2-layer-student)
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/tiny_math/cpu.env   # the same CPU kernels on every machine
launch=(python -m megatron_rl.torchrun --standalone --nproc-per-node 2 -m megatron_rl.cli)

# FAMILY=deepseek_v3, glm4_moe, gpt_oss, deepseek_v32, qwen3_next, glm_moe_dsa, qwen3_5_moe or minimax_m2: the same
# recipe on a DeepSeek-V3-, GLM-4.5-, gpt-oss-, DeepSeek-V3.2-, Qwen3-Next-, GLM-5-, Qwen3.5- or MiniMax-M2-shaped
# policy, in runs/tiny_math_$FAMILY
root=runs/tiny_math${FAMILY:+_$FAMILY}
data=$root/assets/data

python examples/tiny_math/prepare.py --out $root/assets --sft-rows 76800 --sft-correct-fraction 0.4
"${launch[@]}" sft examples/tiny_math/sft.yaml model.hf_path=$root/assets/model logging.run_dir=$root/sft \
  data.train_path=$data/sft.jsonl data.eval_path=$data/heldout.jsonl
"${launch[@]}" train examples/tiny_math/rl.yaml model.hf_path=$root/sft/hf logging.run_dir=$root/rl \
  data.train_path=$data/train.jsonl data.eval_path=$data/heldout.jsonl "$@"
megatron-rl plot $root/rl > /dev/null   # curves: $root/rl/plots/
if [[ ${DISTILL:-} == 4to2 ]]; then
  python examples/tiny_math/tiny_model.py --out $root/assets/model_2layer --layers 2 --family ${FAMILY:-qwen3_moe}
  "${launch[@]}" sft examples/tiny_math/sft.yaml model.hf_path=$root/assets/model_2layer logging.run_dir=$root/sft_2layer \
    data.train_path=$data/sft.jsonl data.eval_path=$data/heldout.jsonl
  "${launch[@]}" train examples/tiny_math/rl.yaml algorithm.name=opd distill.teacher=$root/rl/hf \
    model.hf_path=$root/sft_2layer/hf logging.run_dir=$root/opd_2layer data.train_path=$data/train.jsonl \
    data.eval_path=$data/heldout.jsonl
  megatron-rl plot $root/opd_2layer > /dev/null
elif [[ -n ${DISTILL:-} ]]; then
  "${launch[@]}" train examples/tiny_math/rl.yaml algorithm.name=opd distill.teacher=$root/rl/hf \
    model.hf_path=$root/sft/hf logging.run_dir=$root/opd data.train_path=$data/train.jsonl data.eval_path=$data/heldout.jsonl
  megatron-rl plot $root/opd > /dev/null
fi
