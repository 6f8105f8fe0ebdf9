"""The MoE families in a real run: `megatron-rl train`, 2 steps against the local engine, for the tiny_math policy of
each (examples/tiny_math/tiny_model.py). After step 1's update reaches the engine under the family's own weight
names, the engine's log-probs still equal the trainer's recompute: logprob_gap/abs_mean <= 1e-5 at step 1 and after
that sync.
- DeepSeek-V3 and GLM-4.5 on 2 ranks (EP=2), synced over a process group (DeepSeek) or as tensors into a colocated
  engine (GLM; disk: examples/tiny_math), also when the expert bias moves with Megatron's update (GLM:
  freeze_expert_bias=false), which only holds if the engine routes with the trainer's new bias.
- MiniMax-M2 (block_sparse_moe and its expert bias, as tensors into a colocated engine) and Qwen3.5 (its separate
  DeltaNet projections, over a process group) on one rank. The other 2026 families: their tiny_math runs,
  docs/training.md#model-families.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e  # every test here launches a trainer and an engine

_TENSOR_COLOCATED = ("rollout.weight_sync=tensor", "rollout.colocate=true")
# family: (ranks, overrides, whether the expert bias is checked to stay frozen (True) or to move (False))
_RUNS: dict[str, tuple[int, tuple[str, ...], bool | None]] = {
    "deepseek_v3": (2, ("model.freeze_expert_bias=true", "rollout.weight_sync=distributed"), True),
    "glm4_moe": (2, ("model.freeze_expert_bias=false", *_TENSOR_COLOCATED), False),
    "minimax_m2": (1, ("checkpoint.every=0", *_TENSOR_COLOCATED), None),
    "qwen3_5_moe": (1, ("checkpoint.every=0", "rollout.weight_sync=distributed"), None),
}


@pytest.mark.parametrize("family", list(_RUNS))
def test_two_rl_steps_keep_the_engines_log_probs(tmp_path: Path, family: str) -> None:
    import mrl_runs

    ranks, overrides, bias_frozen = _RUNS[family]
    work = mrl_runs.build_work(tmp_path / "work", family=family)
    records = mrl_runs.train(work, tmp_path / "run", "eval.every=0", *overrides, ranks=ranks)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["logprob_gap/abs_mean"] <= 1e-5, (record["step"], record["logprob_gap/abs_mean"])
    if bias_frozen is not None:
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        start = load_file(work / "model" / "model.safetensors")[bias]
        final = load_file(next((tmp_path / "run" / "hf").glob("*.safetensors")))[bias]
        assert final.dtype == torch.float32
        assert torch.equal(final, start) == bias_frozen, (start, final)
