"""Run many named multi-process scenarios in one launch of N processes (torchrun-style env; gloo on
CPUs, NCCL with one GPU per rank).

Usage from a pytest module (one launch per world size, one pytest test per scenario):

    from distributed.launcher import run_scenarios  # tests/ is on sys.path (pytest rootdir import)

    SCENARIOS = ["model_scenarios:logits_tp2_sp", "model_scenarios:logits_ep2_alltoall"]

    @pytest.fixture(scope="module")
    def results():
        return run_scenarios(2, SCENARIOS)

    @pytest.mark.parametrize("name", SCENARIOS)
    def test_scenario(results, name):
        results[name].check()

A scenario is `module:function`, the module importable from tests/distributed (or a dotted path
from the repository root); the function takes a `ScenarioContext` and raises on failure. Every
rank runs the scenarios in order, in one process each (Megatron is imported once per process),
with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set as torchrun sets them and
OMP_NUM_THREADS=1. The process group is started by the worker; scenarios start Megatron's
parallel state themselves (`megatron_rl.parallel.init_distributed`), and the worker tears it down
after each one. The first failure on any rank ends the launch: that rank exits at once (so peers
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.parallel.launch import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass
class ScenarioContext:
    """What a scenario gets: its rank, the world size, a folder shared by all ranks, a per-process cache."""

    rank: int
    world_size: int
    shared_dir: Path
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
    world_size: int, scenarios: Sequence[str], *, timeout_s: float = 600.0, collective_timeout_s: float = 120.0
) -> dict[str, ScenarioResult]:
    """Launch `world_size` worker processes that run `scenarios` in order; results by scenario name."""
    with tempfile.TemporaryDirectory(prefix="mrl-scenarios-") as tmp:
        out = Path(tmp)
        env = dict(os.environ)
        env.update(
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
        )
        procs = []
        for rank in range(world_size):
            env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            cmd = [
                sys.executable,
                str(Path(__file__)),
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
    module: str, world_size: int, names: Sequence[str], **kwargs: float
) -> dict[str, ScenarioResult]:
    """`run_scenarios` of the functions `names` of scenario module `module`; results by function name."""
    results = run_scenarios(world_size, [f"{module}:{name}" for name in names], **kwargs)
    return {name.split(":", 1)[1]: result for name, result in results.items()}


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
    return getattr(importlib.import_module(module_name), func_name)


def _teardown() -> None:
    if "megatron.core.parallel_state" not in sys.modules:  # the scenario never touched Megatron
        return
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import destroy_distributed

    if ps.model_parallel_is_initialized():
        destroy_distributed(process_group=False)


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
    ctx = ScenarioContext(rank=rank, world_size=world_size, shared_dir=out / "shared")
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
    parser = argparse.ArgumentParser(description="worker of tests/distributed/launcher.py (one per rank)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--collective-timeout", type=float, default=120.0)
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args(argv)
    return _worker(args.out, args.scenarios, args.collective_timeout)


if __name__ == "__main__":
    sys.exit(main())
