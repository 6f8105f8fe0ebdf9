"""The one console line of a step where no progress bar can be drawn (a redirected log: Slurm's .out),
as verl's `step:N - key:val`: the step, what the run is learning and how fast it goes.

    rl step 12/40 | reward 0.512 | acc 0.500 | pg_loss -0.0123 | kl 0.00041 | logprob_gap 2.1e-06 | clip 0.031 |
    1914 tok/s | 7.4 s/step | ETA 3m27s

A value the record does not hold is left out (SFT has no reward; KL is the reference's when the run has one,
else the update's own KL(old || new)).
"""

from __future__ import annotations

from typing import Any

# (shown name, the record's keys in order of preference, format)
SHOWN: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("reward/mean",), ".3f"),
    ("acc", ("reward/accuracy",), ".3f"),
    ("eval", ("eval/greedy_accuracy",), ".3f"),
    ("loss", ("sft/loss",), ".4f"),
    ("pg_loss", ("actor/pg_loss",), ".4g"),
    ("vf_loss", ("critic/vf_loss",), ".4g"),
    ("kl", ("actor/kl_ref_mean", "actor/approx_kl_mean"), ".3g"),
    ("logprob_gap", ("logprob_gap/abs_max",), ".2g"),
)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def step_line(record: dict[str, Any], total_steps: int, desc: str, seconds_per_step: float | None) -> str:
    """The line of `record` (a step's metrics), `seconds_per_step` the mean of this launch's steps (None:
    no time known yet)."""
    step = int(record["step"])
    parts = [f"{desc} step {step}/{total_steps}"]
    for name, keys, spec in SHOWN:
        key = next((k for k in keys if k in record), None)
        if key is not None:
            parts.append(f"{name} {float(record[key]):{spec}}")
    if "actor/clip_high_frac" in record or "actor/clip_low_frac" in record:
        clipped = float(record.get("actor/clip_high_frac", 0.0)) + float(record.get("actor/clip_low_frac", 0.0))
        parts.append(f"clip {clipped:.3g}")
    if "throughput/train_tokens_per_s" in record:
        parts.append(f"{float(record['throughput/train_tokens_per_s']):.0f} tok/s")
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.1f} s/step")
        parts.append(f"ETA {_duration(seconds_per_step * max(total_steps - step, 0))}")
    return " | ".join(parts)
