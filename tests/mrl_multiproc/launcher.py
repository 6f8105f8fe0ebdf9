"""Run many named multi-process scenarios in one launch of N processes (torchrun-style env; gloo on
CPUs, NCCL with one GPU per rank).

Usage from a pytest module (one launch per world size, the first time a test of that world size
runs; one pytest test per scenario):

    from mrl_multiproc.launcher import ScenarioLaunches, scenario_test

    WORLDS = {1: ["families_match_hf"], 2: ["logits_tp2_sp", "logits_ep2_alltoall"]}

    @pytest.fixture(scope="module")
    def launches() -> ScenarioLaunches:
        return ScenarioLaunches("model_scenarios", WORLDS)

    test_scenario = scenario_test(WORLDS)

A scenario is `module:function`, the module one of this package (tests/mrl_multiproc/); the function
takes a `ScenarioContext` and raises on failure. `params` (JSON values: folders, addresses the
pytest module set up) reach every rank as `ctx.params`. Every rank runs the scenarios in order,
in one process each (Megatron is imported once per process), with RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT set as torchrun sets them and OMP_NUM_THREADS=1. The process group is
started by the worker; scenarios start Megatron's parallel state themselves
(`megatron_rl.parallel.init_distributed`), and the worker tears it down after each one. The first failure on any rank ends the launch: that rank exits at once (so peers
blocked in a collective fail fast instead of hanging) and later scenarios are reported as not run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.cli import pace_garbage_collector
from megatron_rl.parallel.launch import free_port

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
PARAMS_FILE = "params.json"


@dataclass
class ScenarioContext:
    """What a scenario gets: its rank, the world size, a folder shared by all ranks, the launch's
    `params`, a per-process cache."""

    rank: int
    world_size: int
    shared_dir: Path
    params: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    name: str
    status: str  # "passed", "failed", "not run"
    detail: str = ""
    seconds: float = 0.0

    def check(self) -> None:
        """Raise AssertionError with the failing ranks' tracebacks unless the scenario passed."""
        if self.status != "passed":
            raise AssertionError(f"scenario {self.name} {self.status}:\n{self.detail}")


def run_scenarios(
    world_size: int,
    scenarios: Sequence[str],
    *,
    params: Mapping[str, Any] | None = None,
    timeout_s: float = 600.0,
    collective_timeout_s: float = 120.0,
) -> dict[str, ScenarioResult]:
    """Launch `world_size` worker processes that run `scenarios` in order, each rank given `params`;
    results by scenario name."""
    with tempfile.TemporaryDirectory(prefix="mrl-scenarios-") as tmp:
        out = Path(tmp)
        (out / PARAMS_FILE).write_text(json.dumps(dict(params or {})))
        env = dict(os.environ)
        env.update(
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")]),
        )
        procs = []
        for rank in range(world_size):
            env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            cmd = [
                sys.executable,
                "-m",
                __spec__.name,
                "--out",
                str(out),
                "--collective-timeout",
                str(collective_timeout_s),
                *scenarios,
            ]
            procs.append((subprocess.Popen(cmd, env=env_r, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for _, log in procs:
            log.close()
        return _collect(out, world_size, scenarios, timed_out, timeout_s)


def run_module_scenarios(
    module: str, world_size: int, names: Sequence[str], **kwargs: Any
) -> dict[str, ScenarioResult]:
    """`run_scenarios` of the functions `names` of scenario module `module`; results by function name."""
    results = run_scenarios(world_size, [f"{module}:{name}" for name in names], **kwargs)
    return {name.split(":", 1)[1]: result for name, result in results.items()}


class ScenarioLaunches:
    """The launches of one pytest module, or of several at once: `worlds` maps a world size to the
    scenarios that run in its launch, the functions of scenario module `module`, or, with `module`
    None, `module:function` names of several scenario modules (`view` gives each pytest module its
    part: one launch per world size for all of them, so that each world size starts its processes,
    imports Megatron and forms its process group once). A world size is launched when a result of it
    is first asked for, after the scenario `prerequisites[world_size]` (one of an earlier launch,
    e.g. the one that writes the references) has passed. `after_launch` runs after every launch
    (e.g. to check that a server the scenarios use is still alive); when it raises AssertionError,
    every scenario of that launch fails with its message."""

    def __init__(
        self,
        module: str | None,
        worlds: Mapping[int, Sequence[str]],
        *,
        params: Mapping[str, Any] | None = None,
        prerequisites: Mapping[int, tuple[int, str]] | None = None,
        after_launch: Callable[[], None] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.module = module
        self.worlds = worlds
        self.params = dict(params or {})
        self.prerequisites = dict(prerequisites or {})
        self.after_launch = after_launch
        self.timeout_s = timeout_s
        self._results: dict[int, dict[str, ScenarioResult]] = {}

    def result(self, world_size: int, name: str) -> ScenarioResult:
        if world_size not in self._results:
            if world_size in self.prerequisites:
                self.result(*self.prerequisites[world_size]).check()
            names = self.worlds[world_size]
            kwargs = {"params": self.params, "timeout_s": self.timeout_s}
            if self.module is None:
                results = run_scenarios(world_size, names, **kwargs)
            else:
                results = run_module_scenarios(self.module, world_size, names, **kwargs)
            if self.after_launch is not None:
                try:
                    self.after_launch()
                except AssertionError as err:
                    results = {n: ScenarioResult(n, "failed", f"after the launch: {err}") for n in names}
            self._results[world_size] = results
        return self._results[world_size][name]

    def view(self, module: str) -> ModuleLaunches:
        """What one pytest module asks of launches shared by several (`module` None): its scenario
        module's results by function name."""
        return ModuleLaunches(self, module)


@dataclass(frozen=True)
class ModuleLaunches:
    """The results of one scenario module's functions in `ScenarioLaunches` shared by several modules."""

    shared: ScenarioLaunches
    module: str

    def result(self, world_size: int, name: str) -> ScenarioResult:
        return self.shared.result(world_size, f"{self.module}:{name}")


def scenario_test(worlds: Mapping[int, Sequence[str]]) -> Callable[..., None]:
    """The test function of a pytest module: one test per scenario of `worlds` (id `world_size-name`),
    each checking its result from the module's `launches` fixture (a `ScenarioLaunches`)."""
    import pytest

    cases = [
        pytest.param(world_size, name, id=f"{world_size}-{name}")
        for world_size, names in worlds.items()
        for name in names
    ]

    @pytest.mark.parametrize(("world_size", "name"), cases)
    def test_scenario(launches: ScenarioLaunches | ModuleLaunches, world_size: int, name: str) -> None:
        launches.result(world_size, name).check()

    return test_scenario


def _collect(
    out: Path, world_size: int, scenarios: Sequence[str], timed_out: bool, timeout_s: float
) -> dict[str, ScenarioResult]:
    records: dict[str, dict[int, dict]] = {name: {} for name in scenarios}
    started: dict[int, str] = {}
    for rank in range(world_size):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            rec = json.loads(line)
            if rec["event"] == "start":
                started[rank] = rec["scenario"]
            else:
                records[rec["scenario"]][rank] = rec
    logs = {r: (out / f"rank{r}.log").read_text()[-4000:] for r in range(world_size)}
    results: dict[str, ScenarioResult] = {}
    for name in scenarios:
        per_rank = records[name]
        seconds = max((rec["seconds"] for rec in per_rank.values()), default=0.0)
        failed = {r: rec["error"] for r, rec in per_rank.items() if not rec["ok"]}
        if failed:
            detail = "\n".join(f"--- rank {r}:\n{err}" for r, err in sorted(failed.items()))
            results[name] = ScenarioResult(name, "failed", detail, seconds)
        elif len(per_rank) == world_size:
            results[name] = ScenarioResult(name, "passed", "", seconds)
        else:
            running = sorted(r for r, s in started.items() if s == name and r not in per_rank)
            if running:
                why = f"timed out after {timeout_s:.0f} s" if timed_out else "process died"
                detail = f"{why} on ranks {running}\n" + "\n".join(
                    f"--- rank {r} log tail:\n{logs[r]}" for r in running
                )
                results[name] = ScenarioResult(name, "failed", detail, seconds)
            else:
                results[name] = ScenarioResult(name, "not run", "an earlier scenario failed or a rank died", 0.0)
    return results


def _resolve(spec: str) -> Any:
    module_name, _, func_name = spec.partition(":")
    if not func_name:
        raise ValueError(f"scenario {spec!r}: expected module:function")
    return getattr(importlib.import_module(f"{__package__}.{module_name}"), func_name)


def _teardown() -> None:
    """Megatron's parallel state forgotten and every process group but the launch's own destroyed: a
    group lives (with its gloo threads) until destroyed, and a launch runs dozens of scenarios."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state as ps

        from megatron_rl.parallel import destroy_distributed

        if ps.model_parallel_is_initialized():
            destroy_distributed(process_group=False)
    world = distributed_c10d._get_default_group()
    for group in list(distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


def _worker(out: Path, scenarios: Sequence[str], collective_timeout_s: float) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout_s),
    )
    params = json.loads((out / PARAMS_FILE).read_text())
    ctx = ScenarioContext(rank=rank, world_size=world_size, shared_dir=out / "shared", params=params)
    ctx.shared_dir.mkdir(exist_ok=True)
    with open(out / f"rank{rank}.jsonl", "a") as log:

        def write(rec: dict) -> None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

        for name in scenarios:
            write({"event": "start", "scenario": name})
            start = time.perf_counter()
            try:
                _resolve(name)(ctx)
                _teardown()
                dist.barrier()
            except BaseException:  # noqa: BLE001 - every failure is reported, then the launch ends
                write(
                    {
                        "event": "end",
                        "scenario": name,
                        "ok": False,
                        "error": traceback.format_exc(),
                        "seconds": time.perf_counter() - start,
                    }
                )
                sys.stdout.flush()
                os._exit(1)
            write({"event": "end", "scenario": name, "ok": True, "error": "", "seconds": time.perf_counter() - start})
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="worker of tests/mrl_multiproc/launcher.py (one per rank)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--collective-timeout", type=float, default=120.0)
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args(argv)
    return _worker(args.out, args.scenarios, args.collective_timeout)


if __name__ == "__main__":
    pace_garbage_collector()  # as every process of a run
    sys.exit(main())
