"""Experiment trackers beside RUN_DIR/metrics.jsonl (`logging.backends`): TensorBoard, Weights & Biases and
MLflow, each an optional package, written on the logging rank with every step's numeric metrics.

- `tensorboard`: events in RUN_DIR/tensorboard; the default, so a missing package is one warning, not an error.
- `wandb`: `logging.wandb_project` (and `_entity`, `_offline`: files in RUN_DIR/wandb to `wandb sync` later).
- `mlflow`: `logging.mlflow_tracking_uri` (null: MLflow's own, $MLFLOW_TRACKING_URI), experiment
  `logging.mlflow_experiment`.
The run's configuration (secrets redacted, as RUN_DIR/config.yaml holds it) goes with it as dotted keys: W&B's run config,
MLflow's parameters (set when the MLflow run is created: MLflow refuses to change a parameter, so a resume keeps
the first launch's). The run's name is `logging.run_name` (null: the run folder's name). A resumed run appends to the same W&B and
MLflow runs: their ids are kept in RUN_DIR/trackers.json. A chosen wandb or mlflow whose package cannot be
imported is a config error before the start (`missing_tracker_packages`, run by `validation.validate_run`); an
MLflow tracking store that cannot be opened (MLflow 3's default sqlite store without the full package) is one
when the trackers open, on the logging rank.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from megatron_rl.config import ConfigError, LoggingConfig

logger = logging.getLogger(__name__)

IDS_FILE = "trackers.json"


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def missing_tracker_packages(backends: list[str]) -> list[str]:
    """The chosen backends, other than the default TensorBoard, whose package (of the backend's name) cannot be
    imported."""
    return [b for b in backends if b != "tensorboard" and importlib.util.find_spec(b) is None]


class _TensorBoard:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit of parameters in one log_batch
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest parameter value


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: leaf value} (lists are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class _Wandb:
    def __init__(
        self, settings: LoggingConfig, run_dir: Path, name: str, run_id: str | None, params: dict[str, Any]
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity,
            name=name,
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            mode="offline" if settings.wandb_offline else "online",
        )
        self.run.config.update(params, allow_val_change=True)  # a resume with other overrides records them
        self.run_id: str = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, settings: LoggingConfig, name: str, run_id: str | None, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        except Exception as err:  # the store of the URI: MLflow's own exception types, which vary by version
            raise _store_error(settings, err) from err
        if run_id is None:
            experiment = self.client.get_experiment_by_name(settings.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(settings.mlflow_experiment)
            )
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            entries = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in params.items()]
            for start in range(0, len(entries), MLFLOW_PARAMS_PER_CALL):
                self.client.log_batch(run_id, params=entries[start : start + MLFLOW_PARAMS_PER_CALL])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _store_error(settings: LoggingConfig, err: Exception) -> ConfigError:
    """One line for an MLflow tracking store that cannot be opened, naming what to set instead of MLflow's
    traceback. MLflow 3 without a URI uses sqlite:///mlflow.db, which needs the full `mlflow` package
    (SQLAlchemy), not `mlflow-skinny`, and refuses file: stores unless MLFLOW_ALLOW_FILE_STORE=true."""
    import mlflow

    uri = settings.mlflow_tracking_uri or f"MLflow's default, {mlflow.get_tracking_uri()}"
    reason = (str(err).strip().splitlines() or [""])[0][:300]
    return ConfigError(
        f"logging.backends has mlflow, but its tracking store ({uri}) cannot be opened: {type(err).__name__}: "
        f"{reason}; set logging.mlflow_tracking_uri to a tracking server (http://HOST:PORT) or $MLFLOW_TRACKING_URI, "
        "or pip install mlflow (its local sqlite store needs the full package, not mlflow-skinny)"
    )


def open_trackers(
    settings: LoggingConfig,
    run_dir: Path,
    *,
    resume: bool,
    tensorboard_purge_step: int | None,
    run_config: dict[str, Any] | None = None,
) -> list:
    """The trackers of `settings.backends` (validated: `config.rules`) for the run in `run_dir`; `resume`: append
    to the runs whose ids RUN_DIR/trackers.json holds; `run_config`: the run's config (`config.to_dict`), sent as
    dotted keys."""
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text(encoding="utf-8")) if resume and ids_path.is_file() else {}
    name = settings.run_name or run_dir.resolve().name
    params = flat_params(run_config or {})
    trackers: list[Tracker] = []
    for backend in settings.backends:
        if backend == "tensorboard":
            writer = _tensorboard_writer(run_dir / "tensorboard", tensorboard_purge_step)
            if writer is not None:
                trackers.append(_TensorBoard(writer))
            continue
        if backend == "wandb":
            tracker: _Wandb | _Mlflow = _Wandb(settings, run_dir, name, ids.get(backend), params)
        else:  # mlflow
            tracker = _Mlflow(settings, name, ids.get(backend), params)
        ids[backend] = tracker.run_id
        trackers.append(tracker)
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")
    return trackers


def _tensorboard_writer(folder: Path, purge_step: int | None) -> Any:
    """TensorBoard's SummaryWriter on `folder`, or None with one warning when the package cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        logger.warning(
            "logging.backends has tensorboard, but TensorBoard cannot be imported (%s): no TensorBoard events are "
            "written; pip install tensorboard, or leave it out of logging.backends",
            err,
        )
        return None
    return SummaryWriter(str(folder), purge_step=purge_step)
