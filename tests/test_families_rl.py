"""Two 2026 families in a real run: `megatron-rl train`, 2 steps on one rank against the local engine, for the
tiny_math policy of each (examples/tiny_math/tiny_model.py). After step 1's update reaches the engine under the
family's own weight names (MiniMax-M2's block_sparse_moe and expert bias, as tensors into a colocated engine;
Qwen3.5's separate DeltaNet projections, over a process group), the engine's log-probs still equal the trainer's
recompute: logprob_gap/abs_mean <= 1e-5 at both steps. (DeepSeek-V3 and GLM-4.5 on two ranks: tests/test_families.py;
the other 2026 families: their tiny_math runs, docs/training.md#model-families.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every test here launches a trainer and an engine

_SYNC = {
    "minimax_m2": ("rollout.weight_sync=tensor", "rollout.colocate=true"),
    "qwen3_5_moe": ("rollout.weight_sync=distributed",),
}


@pytest.mark.parametrize("family", list(_SYNC))
def test_two_rl_steps_keep_the_engines_log_probs(tmp_path: Path, family: str) -> None:
    import mrl_runs

    work = mrl_runs.build_work(tmp_path / "work", family=family)
    overrides = ("eval.every=0", "checkpoint.every=0", *_SYNC[family])
    records = mrl_runs.train(work, tmp_path / "run", *overrides, ranks=1)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["logprob_gap/abs_mean"] <= 1e-5, (record["step"], record["logprob_gap/abs_mean"])
