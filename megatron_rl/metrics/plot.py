"""PNG curves of a run's metrics.jsonl: one file per panel and an overview with every panel."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl.metrics import read_metrics

# (file stem, y label, metric keys): a panel is drawn when at least one of its keys was logged.
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "reward", ("reward/mean", "reward/train_mean", "eval/reward_mean")),
    ("accuracy", "accuracy", ("reward/accuracy", "eval/greedy_accuracy", "eval/accuracy")),
    ("entropy", "entropy (nats / token)", ("actor/entropy_mean",)),
    ("clip_fraction", "share of tokens", ("actor/clip_low_frac", "actor/clip_high_frac", "actor/dual_clip_frac")),
    ("length", "response tokens", ("response/length_mean", "response/length_max")),
    ("kl", "per token", ("actor/approx_kl_mean", "logprob_gap/kl_k3", "logprob_gap/abs_mean")),
    ("groups", "groups", ("groups/groups_generated", "groups/informative", "groups/groups_used")),
    ("critic", "per token", ("critic/vf_loss", "critic/vf_explained_var", "critic/vf_clipfrac")),
    (
        "stage_times",
        "seconds",
        (
            "time/generate",
            "time/reward",
            "time/old_logprobs",
            "time/values",
            "time/critic_train",
            "time/train",
            "time/sync",
            "time/eval",
        ),
    ),
)


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the records that hold a finite value for it."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(float(record["step"]))
            values.append(float(value))
    return steps, values


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write `<panel>.png` for every panel with data and `overview.png` to `out_dir` (default RUN_DIR/plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    panels = []
    for stem, label, keys in PANELS:
        lines = [(key, *series(records, key)) for key in keys]
        lines = [line for line in lines if line[1]]
        if lines:
            panels.append((stem, label, lines))
    if not panels:
        raise ValueError(f"{run_dir}: metrics.jsonl holds none of the plotted metrics")

    def draw(ax: Any, stem: str, label: str, lines: list) -> None:
        for key, steps, values in lines:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_title(stem.replace("_", " "))
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    written = []
    for stem, label, lines in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, stem, label, lines)
        fig.tight_layout()
        written.append(out / f"{stem}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.5 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        draw(ax, *panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    written.append(out / "overview.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written
