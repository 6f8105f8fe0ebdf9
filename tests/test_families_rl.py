"""The 2026 families in a real run: `megatron-rl train`, 2 steps on one rank (gpt-oss: two, EP 2) against the local
engine, for the tiny_math policy of each (examples/tiny_math/tiny_model.py). After step 1's update reaches the
engine (each family's own weight names: gpt-oss's stacked experts, MiniMax-M2's block_sparse_moe, Qwen3-Next's fused
and Qwen3.5's separate DeltaNet projections, the sparse-attention indexer), the engine's log-probs still equal the
trainer's recompute: logprob_gap/abs_mean <= 1e-5 at both steps. The three sync modes are spread over the families
(DeepSeek-V3 and GLM-4.5 on two ranks: tests/test_families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every test here launches a trainer and an engine

_SYNC = {
    "gpt_oss": ("rollout.weight_sync=distributed",),
    "deepseek_v32": ("rollout.weight_sync=tensor", "rollout.colocate=true"),
    "glm_moe_dsa": (),  # disk
    "minimax_m2": ("rollout.weight_sync=distributed",),
    "qwen3_next": ("rollout.weight_sync=tensor", "rollout.colocate=true"),
    "qwen3_5_moe": (),  # disk
}


@pytest.mark.parametrize("family", list(_SYNC))
def test_two_rl_steps_keep_the_engines_log_probs(tmp_path: Path, family: str) -> None:
    import mrl_runs

    work = mrl_runs.build_work(tmp_path / "work", family=family)
    overrides = ("eval.every=0", "checkpoint.every=0", *_SYNC[family])
    ranks = 2 if family == "gpt_oss" else 1  # EP 2: gpt-oss's stacked experts gathered from both EP ranks
    records = mrl_runs.train(work, tmp_path / "run", *overrides, ranks=ranks)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["logprob_gap/abs_mean"] <= 1e-5, (record["step"], record["logprob_gap/abs_mean"])
