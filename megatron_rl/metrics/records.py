"""Step metrics: RUN_DIR/metrics.jsonl, the experiment trackers of `logging.backends` (`metrics.trackers`:
TensorBoard, W&B, MLflow), and the console: a progress bar on a terminal, else a line per step (`metrics.step_line`: a redirected log, Slurm's .out).

One JSON object per line: `{"step": k, "<section>/<name>": value, ...}`. Sections: `reward/`,
`response/`, `groups/`, `data/`, `actor/` (the update's loss metrics), `logprob_gap/`, `eval/`,
`weight_sync/`, `sft/` (the SFT stage's loss metrics), and the machine-dependent `time/` (seconds per stage) and `throughput/`
(tokens per second); `TIMING_PREFIXES` names the latter two (what a reproducibility check leaves out).
A step's record is written before that step's checkpoint is taken (so resuming from step k keeps
the records up to k); the checkpoint's seconds appear as `time/checkpoint` in the next record.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.config import LoggingConfig
from megatron_rl.losses import metric_reduce_op
from megatron_rl.metrics.step_line import step_line
from megatron_rl.metrics.trackers import Tracker, open_trackers

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TIMING_PREFIXES = ("time/", "throughput/")
_BAR_KEYS = {"reward/mean": "reward", "reward/accuracy": "acc", "eval/greedy_accuracy": "eval", "sft/loss": "loss"}


def summarize_updates(history: Sequence[dict[str, float]], prefix: str = "actor/") -> dict[str, float]:
    """One step's record of its optimizer updates: `_max` keys by max, `_min` by min, `lr` the last,
    the rest the mean over updates; `approx_kl_mean` (KL(old || new)) also of the first update alone,
    which sees the old policy itself (0 when old log-probs are recomputed exactly)."""
    if not history:
        raise ValueError("summarize_updates: no updates")
    out: dict[str, float] = {}
    for key in history[0]:
        values = [h[key] for h in history if key in h]
        op = metric_reduce_op(key)
        if op == "max":
            value = max(values)
        elif op == "min":
            value = min(values)
        elif key == "lr":
            value = values[-1]
        else:
            value = sum(values) / len(values)
        out[prefix + key] = float(value)
    if "approx_kl_mean" in history[0]:
        out[prefix + "approx_kl_mean_first_update"] = float(history[0]["approx_kl_mean"])
    out[prefix + "updates"] = float(len(history))
    return out


def _json_value(value: Any) -> Any:
    """Floats as JSON accepts them: NaN and infinities as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _parsed_lines(path: Path, warn: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """Each record line of `path` with its JSON object. A last line that does not parse (half-written
    by a crash or a full disk) is left out, with a warning when `warn`; a bad line before it is a
    ValueError naming the file and the line."""
    text = path.read_text(encoding="utf-8", errors="replace")  # a bad byte: a line that does not parse
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    parsed = []
    for i, (number, line) in enumerate(lines):
        try:
            parsed.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if i < len(lines) - 1:
                raise ValueError(f"{path}:{number}: not a JSON line: {err}") from None
            if not warn:
                continue
            logger.warning(
                "%s:%d: a torn last line (half-written record, %d bytes) is left out", path, number, len(line)
            )
    return parsed


def read_metrics(run_dir: str | Path, *, warn: bool = True) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, in file order (NaN/inf strings back as floats; a torn
    last line left out, with a warning when `warn`)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (is {run_dir} a run folder?)")
    return [
        {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}
        for _, record in _parsed_lines(path, warn)
    ]


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """Drop the records of steps after `last_step` (written before a run was killed) and a torn last
    line; returns how many lines were dropped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    total = sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())
    kept = [line for line, record in _parsed_lines(path) if record.get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return total - len(kept)


class MetricsLogger:
    """Writes step records on the logging rank (others get a disabled logger that does nothing)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tracking: LoggingConfig | None = None,
        run_config: dict[str, Any] | None = None,
        progress: bool = True,
        append: bool = False,
        desc: str = "rl",
        guard: Callable[[int], None] | None = None,
        line_every: int = 1,
        terminal: bool | None = None,
    ) -> None:
        """`guard(step)`: called on every rank before the record of `step` is written; it may raise to
        keep it from being written (the run folder's lock check, collective). `run_config`: the run's config the trackers
        get (`config.to_dict`). `tracking`: the trackers of its
        `backends` (None: none). `progress`: a bar when stderr is a terminal (`terminal`, None = ask it), else a line every `line_every` steps and at the last."""
        self.enabled = enabled
        self.guard = guard
        self.file = None
        self.trackers: list[Tracker] = []
        self.bar: Any = None
        self.lines = False
        self.line_every, self.total_steps, self.desc = max(1, line_every), total_steps, desc
        self.step_seconds: list[float] = []
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = (run_dir / METRICS_FILE).open("a" if append else "w", encoding="utf-8")
        if tracking is not None:
            self.trackers = open_trackers(
                tracking,
                run_dir,
                resume=append,
                tensorboard_purge_step=start_step + 1 if append else None,
                run_config=run_config,
            )
        self.lines = progress and not (sys.stderr.isatty() if terminal is None else terminal)
        if progress and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def log(self, record: dict[str, Any], *, advance: bool = True) -> None:
        """Append one record (it must hold "step"); `advance` moves the progress bar by one step."""
        step = int(record["step"])
        if self.guard is not None:
            self.guard(step)
        if not self.enabled:
            return
        assert self.file is not None
        self.file.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.trackers:
            scalars = {
                k: float(v)
                for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            for tracker in self.trackers:
                tracker.log(step, scalars)
        if self.bar is not None:
            shown = {name: f"{record[key]:.3f}" for key, name in _BAR_KEYS.items() if key in record}
            if shown:
                self.bar.set_postfix(shown, refresh=False)
            if advance:
                self.bar.update(1)
            else:
                self.bar.refresh()
        if self.lines and advance:
            self._step_line(record, step)

    def _step_line(self, record: dict[str, Any], step: int) -> None:
        if isinstance(record.get("time/step"), (int, float)):
            self.step_seconds.append(float(record["time/step"]))
        if step % self.line_every == 0 or step == self.total_steps:
            mean = sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else None
            print(step_line(record, self.total_steps, self.desc, mean), file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        """A console line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.file is not None:
            self.file.close()
            self.file = None
