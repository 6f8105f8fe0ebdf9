"""The console of a run: a progress bar on a terminal, a line per step in a redirected log."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.metrics.records import MetricsLogger

RL_RECORD = {
    "reward/mean": 0.5125,
    "reward/accuracy": 0.5,
    "actor/pg_loss": -0.012345,
    "actor/approx_kl_mean": 0.00041,
    "actor/clip_high_frac": 0.02,
    "actor/clip_low_frac": 0.011,
    "logprob_gap/abs_max": 2.1e-06,
    "throughput/train_tokens_per_s": 1914.32,
}


def test_a_redirected_log_gets_a_line_per_step_with_the_eta_of_the_mean_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = MetricsLogger(tmp_path, enabled=True, total_steps=40, terminal=False)
    log.log({"step": 1, **RL_RECORD, "time/step": 6.0})
    log.log({"step": 1, "eval/greedy_accuracy": 0.25}, advance=False)  # an evaluation record: no line of its own
    log.log({"step": 2, **RL_RECORD, "actor/kl_ref_mean": 0.0123, "time/step": 9.0})
    log.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "rl step 1/40 | reward 0.512 | acc 0.500 | pg_loss -0.01235 | kl 0.00041 | logprob_gap 2.1e-06 | clip 0.031 | "
        "1914 tok/s | 6.0 s/step | ETA 3m54s",  # 39 steps x 6 s
        "rl step 2/40 | reward 0.512 | acc 0.500 | pg_loss -0.01235 | kl 0.0123 | logprob_gap 2.1e-06 | clip 0.031 | "
        "1914 tok/s | 7.5 s/step | ETA 4m45s",  # the reference's KL when there is one; 38 steps x 7.5 s
    ]


def test_lines_every_n_steps_and_at_the_last_and_none_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = MetricsLogger(tmp_path, enabled=True, total_steps=5, terminal=False, line_every=2, desc="sft")
    for step in range(1, 6):
        log.log({"step": step, "sft/loss": 1.0 / step, "time/step": 2.0})
    log.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["sft step 2/5", "sft step 4/5", "sft step 5/5"]
    assert lines[-1] == "sft step 5/5 | loss 0.2000 | 2.0 s/step | ETA 0m00s"
    bar = MetricsLogger(tmp_path / "tty", enabled=True, total_steps=5, terminal=True)
    bar.log({"step": 1, "sft/loss": 1.0, "time/step": 2.0})
    bar.close()
    shown = capsys.readouterr().err
    assert "step 1/5" not in shown and "1/5 [" in shown  # the bar alone
