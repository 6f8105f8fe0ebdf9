"""Shared fixtures (built once per session) and the two tiers of the suite.

The `e2e` marker goes on every test that launches a training, SFT, engine, torchrun, multi-process
scenario or Slurm process; the fast tier is `pytest -m "not e2e"`. The marker is kept honest here: a
test without it that starts such a process (through `subprocess`, in the test or in a fixture it
sets up) fails, naming the command. The fast tier runs every unmarked test with nothing launched
beforehand, so any launch an unmarked test needs is seen there.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

from megatron_rl.cli import pace_garbage_collector

import mrl_runs
from mrl_multiproc.launcher import ScenarioLaunches

pace_garbage_collector()  # the test processes import torch, Megatron and transformers as a run's do

# What an unmarked test may not launch: a command naming one of these (argv items, or words of a
# shell string); for megatron_rl.cli, only the subcommands that start a training or an engine.
LAUNCHERS = {
    "torch.distributed.run",
    "torchrun",
    "mrl_ranks.py",
    "mrl_multiproc.launcher",
    "sbatch",
    "srun",
    "sglang_router",
}
CLI_LAUNCHES = {"train", "sft", "serve"}


def launch_in(args: object) -> str | None:
    """The launch `args` (Popen's first argument) starts, or None when it is not one of the e2e kind."""
    argv = args.split() if isinstance(args, str) else [str(a) for a in args]  # type: ignore[union-attr]
    words = [w for a in argv for w in a.split()]  # `bash -c "sbatch ..."` names its command in one item
    names = {Path(w).name for w in words}
    if names & LAUNCHERS or "slurm_cluster.sh" in names:
        return " ".join(argv)[:200]
    if "megatron_rl.cli" in words:  # its subcommand: the first word after it that is not an option
        subcommand = next((w for w in words[words.index("megatron_rl.cli") + 1 :] if not w.startswith("-")), None)
        if subcommand in CLI_LAUNCHES:
            return " ".join(argv)[:200]
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if "e2e" in item.keywords:
        return (yield)
    original = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        launched = launch_in(args)
        if launched is not None:
            pytest.fail(f"{item.nodeid} launches `{launched}` but is not marked e2e (@pytest.mark.e2e)")
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]
    try:
        return (yield)
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]


# The fast tier runs on two pytest-xdist workers (`-n 2 --dist loadgroup`, the README's test command),
# and so does the e2e tier (`-n 2 --dist loadgroup --no-loadscope-reorder`; the measurements:
# docs/architecture.md#tests-and-benchmarks). A module is one unit of work, so that its
# module-scoped fixtures are built once; modules that share a session-scoped launch are one unit. The units come from
# `WorkUnitScheduling`, not from xdist_group marks: pytest 9 keeps a node's id apart from the
# `_nodeid` that xdist 3.8 appends the group to, so marked groups are split over both workers. The e2e
# modules that take longest go first, so that two workers end together.
# In this order, their scenarios run in the launch of each world size.
_LAYOUT_TESTS = ("test_convert_distributed", "test_models_distributed", "test_actor_distributed")
SHARED_UNITS = {
    **dict.fromkeys(("test_trainer", "test_faults"), "resume_run"),  # straight_runs' RESUME_RUN
    **dict.fromkeys(("test_sft", "test_example_learns"), "warm_start"),  # the example's SFT warm start
    **dict.fromkeys(_LAYOUT_TESTS, "layout_launches"),  # one launch per world size for the three
}
LONGEST_FIRST = (
    "test_faults", "test_trainer", *_LAYOUT_TESTS, "test_example_learns", "test_sft", "test_slurm", "test_families_rl"
)  # fmt: skip


def work_unit(test_file: Path) -> str:
    """The unit of work of the tests in `test_file`: its module's name, or the unit of modules sharing a launch."""
    return SHARED_UNITS.get(test_file.stem, test_file.stem)


class WorkUnitScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with `work_unit` as the scope: every test of a unit goes to one worker."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(Path(nodeid.split("::", 1)[0]))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    """`--dist loadgroup` schedules by `work_unit`; the other modes are xdist's own."""
    return WorkUnitScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slurm" in item.keywords:  # every Slurm test submits jobs
            item.add_marker(pytest.mark.e2e)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the order within is kept


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone (the run folder's collectives), destroyed afterwards."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- the layout scenarios of three modules, one launch per world size ----

# pytest module -> its scenario module (tests/mrl_multiproc/); their selected scenarios share the launches
LAYOUT_MODULES = {
    "test_actor_distributed": "scenarios_actor",
    "test_convert_distributed": "scenarios_convert",
    "test_models_distributed": "model_scenarios",
}
# the actor's world-size-1 launch writes the references the others compare with; its w2_pp2 saves the
# checkpoint that w4_load_pp2_checkpoint loads
LAYOUT_PREREQUISITES = {2: (1, "scenarios_actor:w1_reference"), 4: (2, "scenarios_actor:w2_pp2")}


@pytest.fixture(scope="session")
def layout_launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScenarioLaunches:
    """The launches of the scenarios of LAYOUT_MODULES selected in this session, in the session's order: each
    world size's processes start, import Megatron and join their process group once for all three modules."""
    worlds: dict[int, list[str]] = {}
    for item in request.session.items:
        module = LAYOUT_MODULES.get(item.path.stem)
        callspec = getattr(item, "callspec", None)
        if module is not None and callspec is not None and "world_size" in callspec.params:
            worlds.setdefault(callspec.params["world_size"], []).append(f"{module}:{callspec.params['name']}")
    actor = LAYOUT_MODULES["test_actor_distributed"]
    prerequisites = {
        w: p for w, p in LAYOUT_PREREQUISITES.items() if any(s.startswith(f"{actor}:") for s in worlds.get(w, []))
    }
    for prior_world, scenario in prerequisites.values():
        if scenario not in worlds.setdefault(prior_world, []):
            worlds[prior_world].insert(0, scenario)
    return ScenarioLaunches(
        None,
        worlds,
        params={"ref_dir": str(tmp_path_factory.mktemp("actor_ref"))},
        prerequisites=prerequisites,
        timeout_s=1800.0,
    )


# ---- session-scoped assets ----


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny_math model, data, reward and rl.yaml of the end-to-end runs (tests/mrl_runs.py)."""
    return mrl_runs.build_work(tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="session")
def straight_runs(tmp_path_factory: pytest.TempPathFactory) -> mrl_runs.RunCache:
    """Uninterrupted runs of `work`, one launch per (overrides, ranks) in the session."""
    return mrl_runs.RunCache(tmp_path_factory.mktemp("straight_runs"))


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny_math task data (512 SFT rows) and model."""
    import prepare

    assets = tmp_path_factory.mktemp("sft") / "assets"
    assert prepare.main(["--out", str(assets), "--sft-rows", "512"]) == 0
    return assets


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> mrl_runs.WarmStart:
    """The example's SFT warm start, shortened (tests/mrl_runs.py `tiny_math_warm_start`)."""
    return mrl_runs.tiny_math_warm_start(tmp_path_factory.mktemp("tiny_math_warm_start"))


@pytest.fixture
def rank0_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch variables of a world of one (the runtime reads the data-parallel size from them)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
