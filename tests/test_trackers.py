"""Experiment trackers with the real packages: W&B offline writes every step's metrics and the run's config into
its run file, MLflow's client reads them back (the config as parameters) from a local store, and a resumed run
appends to the same runs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_rl.config import LoggingConfig, load_config, to_dict
from megatron_rl.config.loading import REDACTED
from megatron_rl.metrics.trackers import IDS_FILE, flat_params, missing_tracker_packages, open_trackers

STEPS = {1: {"reward/mean": 0.25, "actor/pg_loss": -0.5}, 2: {"reward/mean": 0.5, "actor/pg_loss": -0.25}}


def wandb_records(run_file: Path) -> list:
    """The records of an offline W&B run file: a 7-byte header, then LevelDB log blocks of 32 KiB whose
    records (7-byte header: crc, length, type full/first/middle/last) are wandb_internal Record messages."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending, records = run_file.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    rows = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows[int(row["_step"])] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def wandb_config(run_file: Path) -> dict[str, object]:
    """The run config an offline W&B run file records (its updates in order)."""
    config = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return config


def test_wandb_offline_and_mlflow_get_every_step_and_a_resume_appends(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store for the test; users name a server
    settings = LoggingConfig(
        backends=["wandb", "mlflow"],
        wandb_offline=True,
        mlflow_tracking_uri=(tmp_path / "mlruns").as_uri(),
        mlflow_experiment="tests",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(overrides=["train.lr=3e-4", "rollout.api_key=sk-secret", "data.train_path=[a.jsonl,b.jsonl]"])
    params = flat_params(OmegaConf.to_container(OmegaConf.structured(cfg)))
    for step in STEPS:  # step 1, then a resumed launch logs step 2
        trackers = open_trackers(
            settings, run_dir, resume=step > 1, tensorboard_purge_step=None, run_config=to_dict(cfg)
        )
        for tracker in trackers:
            tracker.log(step, STEPS[step])
        for tracker in trackers:
            tracker.close()
    ids = json.loads((run_dir / IDS_FILE).read_text())
    run_files = sorted(run_dir.glob(f"wandb/offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    assert len(run_files) == 2  # one file per launch, of the same run id: `wandb sync` joins them
    assert {**wandb_history(run_files[0]), **wandb_history(run_files[1])} == STEPS
    config = wandb_config(run_files[0])
    assert len(params) > 100 and set(config) == set(params), sorted(set(config) ^ set(params))[:5]
    assert (config["train.lr"], config["data.train_path"], config["rollout.api_key"]) == (
        3e-4,
        ["a.jsonl", "b.jsonl"],
        REDACTED,
    )

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
    assert client.get_run(ids["mlflow"]).info.run_name == "run"
    for key in ("reward/mean", "actor/pg_loss"):
        history = client.get_metric_history(ids["mlflow"], key)
        assert [(m.step, m.value) for m in history] == [(s, STEPS[s][key]) for s in STEPS]
    assert len(client.search_runs([client.get_experiment_by_name("tests").experiment_id])) == 1
    logged = client.get_run(ids["mlflow"]).data.params  # over 100: several log_batch calls
    assert logged == {k: str(v) for k, v in params.items() if k != "rollout.api_key"} | {"rollout.api_key": REDACTED}


def test_a_chosen_tracker_without_its_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert missing_tracker_packages(["tensorboard", "wandb", "mlflow"]) == ["mlflow"]


@pytest.mark.parametrize(
    ("backends", "error"),
    [
        (
            "[tensorboard,neptune]",
            r"logging\.backends: unknown \['neptune'\]; allowed: any of \['tensorboard', 'wandb', 'mlflow'\]",
        ),
        ("[wandb,wandb]", r"logging\.backends = \['wandb', 'wandb'\] names a backend twice"),
    ],
)
def test_a_backend_unknown_or_named_twice_is_refused(backends: str, error: str) -> None:
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=error):
        load_config(overrides=[f"logging.backends={backends}"])


def test_an_mlflow_store_that_cannot_be_opened_is_one_config_error(tmp_path: Path, monkeypatch) -> None:
    """MLflow 3's default store (sqlite:///mlflow.db) without the full `mlflow` package, or a file: store without
    MLFLOW_ALLOW_FILE_STORE, raises from MlflowClient: one config error naming the key, not MLflow's traceback."""
    import mlflow.tracking

    from megatron_rl.config import ConfigError

    class Refusing:
        def __init__(self, tracking_uri: str | None = None) -> None:
            raise RuntimeError(
                f"Model registry functionality is unavailable; got unsupported URI {tracking_uri!r}\n..."
            )

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Refusing)
    settings = LoggingConfig(backends=["mlflow"], mlflow_tracking_uri="sqlite:///x.db")
    with pytest.raises(
        ConfigError,
        match=r"^logging.backends has mlflow, but its tracking store \(sqlite:///x.db\) cannot"
        r" be opened: RuntimeError: Model registry .* 'sqlite:///x.db'; set logging.mlflow_tracking_uri"
        r" .* pip install mlflow \(its local sqlite store needs the full package, not mlflow-skinny\)$",
    ):
        open_trackers(settings, tmp_path, resume=False, tensorboard_purge_step=None)
