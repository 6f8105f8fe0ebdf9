"""algorithm.dynamic_sampling_filter: a user's function, from a file, decides which groups dynamic sampling keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mrl_engine import on_loop
from test_trainer_units import RIGHT, WRONG, collector, make_cfg, prompt

from megatron_rl.algorithms import GroupFilterError
from megatron_rl.config import ConfigError
from megatron_rl.validation import validate_run

FILTERS = """
import numpy as np
import torch

seen = []

def all_right(group):
    seen.append((group.prompt.index, list(group.scores)))
    return np.bool_(all(s > 0 for s in group.scores))  # a numpy bool is a bool

def nothing(group):
    return torch.tensor(False)  # so is a 0-dim torch bool

def broken(group):
    raise KeyError("label")

def counts(group):
    return sum(s > 0 for s in group.scores)
"""


@pytest.fixture
def filters(tmp_path: Path) -> Path:
    path = tmp_path / "my_filters.py"
    path.write_text(FILTERS)
    return path


def test_the_filter_keeps_what_it_returns_true_for_in_place_of_the_reward_spread(filters: Path) -> None:
    cfg = make_cfg(**{"algorithm.dynamic_sampling_filter": f"{filters}:all_right"})
    assert cfg.algorithm.dynamic_sampling  # implied by the filter
    # prompt 0 all wrong, 1 all right, 2 mixed, 3 all right: the reward spread would keep only prompt 2;
    # the filter keeps the all-right groups 1 and 3, over two rounds of two prompts
    script = {100: [WRONG], 101: [RIGHT], 102: [RIGHT, WRONG], 103: [RIGHT]}
    col, engine = collector(cfg, script, [prompt(i, "7") for i in range(6)])
    step_batch = on_loop(col.collect(step=1))
    m = step_batch.metrics
    assert (m["groups/rounds"], m["groups/groups_generated"], m["groups/groups_kept"]) == (2.0, 4.0, 2.0)
    assert (m["groups/informative"], m["groups/filtered"], m["groups/target_missed"]) == (2.0, 2.0, 0.0)
    assert len(engine.calls) == 2
    assert [t[0].item() for t in step_batch.batch.tokens] == [101] * 4 + [103] * 4
    seen = col.keep.__globals__["seen"]  # the filter got our Group: its prompt and its rule scores
    assert seen == [(0, [-1.0] * 4), (1, [1.0] * 4), (2, [1.0, -1.0, 1.0, -1.0]), (3, [1.0] * 4)]
    assert torch.stack(step_batch.batch.advantages).abs().max() == 0  # all-right groups: zero advantage


def test_a_filter_that_keeps_nothing_runs_out_of_rounds_as_dynamic_sampling_does(filters: Path) -> None:
    cfg = make_cfg(**{"algorithm.dynamic_sampling_filter": f"{filters}:nothing", "algorithm.max_gen_rounds": 3})
    col, engine = collector(cfg, {100 + i: [RIGHT, WRONG] for i in range(10)}, [prompt(i, "7") for i in range(10)])
    step_batch = on_loop(col.collect(step=1))
    assert step_batch.batch is None  # the step is skipped, as a short batch is
    m = step_batch.metrics
    assert (m["groups/rounds"], m["groups/groups_used"], m["groups/target_missed"]) == (3.0, 0.0, 1.0)
    assert (m["groups/groups_generated"], m["groups/informative"]) == (6.0, 0.0) and len(engine.calls) == 3


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("broken", r"raised on group 0 of the round: KeyError\('label'\)"),
        ("counts", r"returned int 0 for group 0 of the round: it must return True \(keep the group\) or False"),
    ],
)
def test_a_filter_that_raises_or_returns_no_bool_stops_with_one_line_naming_it(
    filters: Path, name: str, message: str
) -> None:
    spec = f"{filters}:{name}"
    col, _ = collector(make_cfg(**{"algorithm.dynamic_sampling_filter": spec}), {100: [WRONG]}, [prompt(0, "7")])
    with pytest.raises(GroupFilterError, match=message) as err:
        on_loop(col.collect(step=1))
    assert str(err.value).startswith(f"algorithm.dynamic_sampling_filter {spec!r} ")
    assert "\n" not in str(err.value)


def test_the_filter_is_loaded_before_the_start_and_needs_dynamic_sampling(filters: Path) -> None:
    with pytest.raises(ConfigError, match=r"algorithm.dynamic_sampling_filter = '.*absent.py:f': no such file"):
        validate_run(make_cfg(**{"algorithm.dynamic_sampling_filter": f"{filters.parent}/absent.py:f"}), "train")
    with pytest.raises(ConfigError, match=r"has no function 'nope'; it has \['all_right', 'broken', 'counts'"):
        validate_run(make_cfg(**{"algorithm.dynamic_sampling_filter": f"{filters}:nope"}), "train")
    with pytest.raises(ConfigError, match="read only with algorithm.dynamic_sampling = true"):
        make_cfg(**{"algorithm.dynamic_sampling_filter": f"{filters}:all_right", "algorithm.dynamic_sampling": False})
