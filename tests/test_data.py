"""Prompt datasets: formats, keys, chat templates, bad rows with their line numbers, and the sampler."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import DataConfig
from megatron_rl.data import DataError, PromptSampler, get_field, load_prompt_dataset, load_tokenizer

import tiny_tokenizer

# Ids of the tiny_math character tokenizer: <|user|> = 4, <|assistant|> = 5, "0".."9" = 6..15,
# "+" = 16, "*" = 17, "=" = 18.
USER, ASSISTANT = 4, 5
IDS_2_PLUS_4_TIMES_5 = [8, 16, 10, 17, 11, 18]  # "2+4*5="
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step.\n\n{}\n\nRemember to put your answer on its own line."
)


def dapo_row(problem: str, answer: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": problem}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "0f1c"},
    }


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.build_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer):
    """The same tokenizer without a chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    return tok


def test_dapo_rows_load_as_they_are_with_the_chat_template(tmp_path: Path, tokenizer) -> None:
    rows = [dapo_row("2+4*5=", "22"), dapo_row("9*9+49=", "130")]
    path = write_lines(tmp_path / "dapo.jsonl", [json.dumps(r) for r in rows])
    ds = load_prompt_dataset(path, tokenizer, DataConfig())
    assert len(ds) == 2 and ds.report.kept == 2 and ds.report.rows == 2 and ds.report.counts == {}
    first = ds[0]
    assert first.index == 0 and first.answer == "22" and first.raw == rows[0]
    assert first.text == "<|user|>2+4*5=<|assistant|>"
    assert list(first.input_ids) == [USER, *IDS_2_PLUS_4_TIMES_5, ASSISTANT]
    assert str(first.location) == f"{path}:1"
    assert ds[1].index == 1 and ds[1].answer == "130" and ds[1].location.number == 2


def test_plain_keys_dotted_paths_and_numeric_answers(tmp_path: Path, tokenizer) -> None:
    path = write_lines(tmp_path / "plain.jsonl", [json.dumps({"question": "2+4*5=", "meta": {"answer": 22}})])
    cfg = DataConfig(prompt_key="question", answer_key="meta.answer")
    ds = load_prompt_dataset(path, tokenizer, cfg)
    # A string prompt becomes one user message for the template.
    assert ds[0].text == "<|user|>2+4*5=<|assistant|>" and ds[0].answer == "22"
    ds = load_prompt_dataset(
        path, tokenizer, DataConfig(prompt_key="question", answer_key="meta.answer", apply_chat_template=False)
    )
    assert ds[0].text == "2+4*5=" and list(ds[0].input_ids) == IDS_2_PLUS_4_TIMES_5


def test_without_a_template_messages_are_joined_as_plain_text(tmp_path: Path, plain_tokenizer) -> None:
    row = {"prompt": [{"role": "system", "content": "2+"}, {"role": "user", "content": "4*5="}], "answer": "22"}
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(row)])
    ds = load_prompt_dataset(path, plain_tokenizer, DataConfig(answer_key="answer"))  # apply_chat_template on
    assert ds[0].text == "2+\n4*5="
    assert list(ds[0].input_ids) == [8, 16, 21, 10, 17, 11, 18]  # "\n" = 21


def test_literal_dotted_key_wins_over_nesting() -> None:
    row = {"a.b": 1, "a": {"b": 2}, "c": {"d": None}}
    assert get_field(row, "a.b") == 1
    assert get_field({"a": {"b": 2}}, "a.b") == 2
    assert get_field(row, "c.d") is get_field(row, "c.x") is get_field(row, "zz")


def test_every_bad_row_is_skipped_counted_and_reported_with_its_line(tmp_path: Path, tokenizer, caplog) -> None:
    good = json.dumps(dapo_row("2+4*5=", "22"))
    no_answer = dapo_row("1+2*3=", "7")
    del no_answer["reward_model"]
    lines = [
        good,  # 1
        "{not json",  # 2 invalid_json
        "",  # 3 blank: ignored, not a row
        "[1, 2]",  # 4 not_an_object
        json.dumps(no_answer),  # 5 missing_key (answer)
        json.dumps({"reward_model": {"ground_truth": "1"}}),  # 6 missing_key (prompt)
        json.dumps(dapo_row("   ", "1")),  # 7 empty_prompt
        json.dumps({"prompt": [], "reward_model": {"ground_truth": "1"}}),  # 8 empty_prompt
        json.dumps({"prompt": 5, "reward_model": {"ground_truth": "1"}}),  # 9 bad_type
        json.dumps(dapo_row("1+2*3=4+5*6=7+8*9=", "1")),  # 10 too_long: 18 + 2 tokens > 12
        json.dumps(dapo_row("3+4*5=", "23")),  # 11
        json.dumps(dapo_row("1+1*1=", "")),  # 12 empty_answer
        json.dumps(dapo_row("1+1*1=", {"x": 1})),  # 13 bad_type (answer)
        json.dumps({"prompt": [{"content": "1+1"}], "reward_model": {"ground_truth": "2"}}),  # 14 bad_type (no role)
    ]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data"):
        ds = load_prompt_dataset(path, tokenizer, DataConfig(max_prompt_tokens=12), max_reported=3)
    assert [p.location.number for p in ds] == [1, 11] and [p.index for p in ds] == [0, 1]
    assert [(s.location.number, s.reason) for s in ds.report.skipped] == [
        (2, "invalid_json"),
        (4, "not_an_object"),
        (5, "missing_key"),
        (6, "missing_key"),
        (7, "empty_prompt"),
        (8, "empty_prompt"),
        (9, "bad_type"),
        (10, "too_long"),
        (12, "empty_answer"),
        (13, "bad_type"),
        (14, "bad_type"),
    ]
    assert ds.report.counts == {
        "invalid_json": 1,
        "not_an_object": 1,
        "missing_key": 2,
        "bad_type": 3,
        "empty_prompt": 2,
        "empty_answer": 1,
        "too_long": 1,
    }
    assert ds.report.rows == 13 and ds.report.kept == 2
    skipped = {s.location.number: s for s in ds.report.skipped}
    assert "reward_model.ground_truth" in skipped[5].detail and "data.answer_key" in skipped[5].detail
    assert "data.prompt_key" in skipped[6].detail
    assert skipped[10].detail == "20 tokens > data.max_prompt_tokens = 12"
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:3] == [str(skipped[2]), str(skipped[4]), str(skipped[5])]
    assert messages[0].startswith(f"{path}:2: skipped (invalid_json)")
    assert messages[3] == f"{path}: 8 more skipped rows not listed"


def test_a_failing_chat_template_skips_the_row(tmp_path: Path, tokenizer) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    rows = [
        dapo_row("1+2*3=", "7"),
        {"prompt": [{"role": "system", "content": "1"}], "reward_model": {"ground_truth": "1"}},
    ]
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    ds = load_prompt_dataset(path, tok, DataConfig())
    assert len(ds) == 1 and ds.report.skipped[0].reason == "template_error"
    assert "the first message must be the user" in ds.report.skipped[0].detail


def test_a_file_without_usable_rows_is_an_error_naming_it_and_the_counts(tmp_path: Path, tokenizer) -> None:
    path = write_lines(tmp_path / "none.jsonl", ["{oops", json.dumps({"prompt": "1+1=", "x": 1}), "{"])
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, tokenizer, DataConfig())
    message = str(err.value)
    assert str(path) in message and "kept 0 of 3 rows" in message
    assert "invalid_json: 2" in message and "missing_key: 1" in message and f"{path}:1" in message


def test_missing_and_unsupported_files(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_dataset(tmp_path / "absent.jsonl", tokenizer, DataConfig())
    csv = write_lines(tmp_path / "rows.csv", ["a,b"])
    with pytest.raises(DataError, match=r"unsupported format '\.csv'"):
        load_prompt_dataset(csv, tokenizer, DataConfig())
    with pytest.raises(DataError, match="data.tokenizer_path"):
        load_tokenizer(tmp_path / "no_tokenizer")


def test_parquet_dapo_rows_and_bad_rows_by_row_index(tmp_path: Path, tokenizer) -> None:
    rows = [
        dapo_row("2+4*5=", "22"),
        dapo_row("", "3"),  # empty_prompt
        {**dapo_row("1+1*1=", "2"), "reward_model": {"ground_truth": None, "style": "x"}},  # missing_key (null)
        dapo_row(DAPO_INSTRUCTION.format("3+4*5="), "23"),  # fits in 1024 tokens (letters map to <|unk|>)
    ]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_prompt_dataset(path, tokenizer, DataConfig())
    assert [(p.location.number, p.answer) for p in ds] == [(0, "22"), (3, "23")]
    assert ds[0].raw["prompt"] == rows[0]["prompt"]
    assert list(ds[0].input_ids) == [USER, *IDS_2_PLUS_4_TIMES_5, ASSISTANT]
    assert [(str(s.location), s.reason) for s in ds.report.skipped] == [
        (f"{path} (row 1)", "empty_prompt"),
        (f"{path} (row 2)", "missing_key"),
    ]
    assert len(ds[1].input_ids) == len(DAPO_INSTRUCTION.format("3+4*5=")) + 2


def test_sampler_epochs_are_seeded_permutations_and_cross_epoch_batches_continue() -> None:
    items = list(range(10))
    a, b = PromptSampler(items, seed=7), PromptSampler(items, seed=7)
    epochs = [a.next(10) for _ in range(3)]
    assert all(sorted(e) == items for e in epochs) and len({tuple(e) for e in epochs}) == 3
    assert b.next(4) + b.next(13) + b.next(13) == [x for e in epochs for x in e]  # 30 = 3 epochs exactly
    assert b.epoch == 2 and b.position == 10
    assert PromptSampler(items, seed=8).next(10) != epochs[0]
    plain = PromptSampler(items[:5], shuffle=False)
    assert plain.next(3) == [0, 1, 2] and plain.next(3) == [3, 4, 0] and (plain.epoch, plain.position) == (1, 1)


@pytest.mark.parametrize("consumed", [0, 3, 10, 17])
def test_sampler_resumes_exactly(consumed: int) -> None:
    items = [f"p{i}" for i in range(10)]
    run = PromptSampler(items, seed=3)
    run.next(consumed)
    state = json.loads(json.dumps(run.state_dict()))  # a checkpoint may store it as JSON
    resumed = PromptSampler(items, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next(4) for _ in range(6)] == [run.next(4) for _ in range(6)]


def test_the_steps_of_train_epochs_draw_fresh_seeded_epochs_and_resume_mid_epoch_exactly() -> None:
    """train.epochs = 3 over 10 prompts, 4 a step: ceil(30 / 4) = 8 steps. Every epoch draws each prompt once,
    each in its own order; the steps cross the epochs' ends (step 3 takes the last 2 of epoch 0 and the first 2
    of epoch 1) and the last step goes 2 prompts into a fourth epoch. A run resumed from the state saved after
    any step, mid-epoch or at an epoch's end, draws what the uninterrupted run draws."""
    from megatron_rl.config import epoch_steps

    items, per_step = [f"p{i}" for i in range(10)], 4
    steps = epoch_steps(3, len(items), per_step)
    run = PromptSampler(items, seed=11)
    drawn, states, progress = [], [], []
    for _ in range(steps):
        states.append(json.loads(json.dumps(run.state_dict())))  # a checkpoint before the step
        drawn.append(run.next(per_step))
        progress.append(run.epochs_drawn)
    flat = [p for step in drawn for p in step]
    epochs = [flat[k : k + 10] for k in range(0, 30, 10)]
    assert steps == 8 and len(flat) == 32 and all(sorted(e) == sorted(items) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # a fresh order every epoch
    assert all(e == [items[i] for i in np.random.default_rng([11, k]).permutation(10)] for k, e in enumerate(epochs))
    assert progress == [0.4, 0.8, 1.2, 1.6, 2.0, 2.4, 2.8, 3.2] and (run.epoch, run.position) == (3, 2)
    for step, state in enumerate(states):
        resumed = PromptSampler(items, seed=11)
        resumed.load_state_dict(state)
        assert [resumed.next(per_step) for _ in range(step, steps)] == drawn[step:], step


def test_sampler_refuses_a_state_from_other_data_or_seed() -> None:
    state = PromptSampler(list(range(10)), seed=3).state_dict()
    with pytest.raises(ValueError, match="data.seed is 4 but the checkpoint was saved with 3"):
        PromptSampler(list(range(10)), seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="number of usable prompts is 9"):
        PromptSampler(list(range(9)), seed=3).load_state_dict(state)
    sampler = PromptSampler.from_config(list(range(4)), DataConfig(shuffle=False, seed=1))
    assert sampler.next(5) == [0, 1, 2, 3, 0]


def test_several_train_files_pool_or_mix_by_weight_and_resume(tmp_path: Path, tokenizer) -> None:
    """Two files: pooled, every row once an epoch with its position in the pool; weighted 3:1, about 3/4 of
    the prompts from the first (4000 draws: 3 standard deviations are 0.021), each file's rows epoch by epoch;
    a restored state continues the same stream, and other weights are refused."""
    from megatron_rl.data import WeightedSampler, pooled

    files = []
    for name, rows in (("a", ["1+1=", "2+2=", "3+3="]), ("b", ["4*4=", "5*5="])):
        path = write_lines(tmp_path / f"{name}.jsonl", [json.dumps({"prompt": r, "answer": "0"}) for r in rows])
        files.append(load_prompt_dataset(path, tokenizer, DataConfig(answer_key="answer")))
    pool = pooled(files)
    assert [p.index for p in pool] == list(range(5)) and [p.text for p in pool[3:]] == [p.text for p in files[1]]
    assert sorted(p.index for p in PromptSampler(pool, seed=3).next(5)) == [0, 1, 2, 3, 4]

    mixed = WeightedSampler(files, [3.0, 1.0], shuffle=True, seed=3)
    drawn = [p.location.path for _ in range(500) for p in mixed.next(8)]
    share = sum(path.endswith("a.jsonl") for path in drawn) / len(drawn)
    assert abs(share - 0.75) < 0.021, share
    assert mixed.epochs_drawn == 4000 / 5  # data/epoch: the prompts drawn over the files' 5
    first_b = [p.text for p in WeightedSampler(files, [1.0, 1e-9], True, 3).next(3)]
    assert sorted(first_b) == sorted(p.text for p in files[0])  # a file's own epoch: each row once
    state = mixed.state_dict()
    expected = [p.text for p in mixed.next(16)]
    resumed = WeightedSampler(files, [3.0, 1.0], shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert [p.text for p in resumed.next(16)] == expected
    with pytest.raises(ValueError, match=r"weights are \[0.5, 0.5\] but the checkpoint was saved with \[0.75"):
        WeightedSampler(files, [1.0, 1.0], shuffle=True, seed=3).load_state_dict(state)


def test_lists_of_data_files_with_weights_and_names_are_checked_naming_the_key() -> None:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.config.data_files import eval_files, train_files

    cfg = load_config(None, ["data.train_path=[x/a.jsonl,y/b.parquet]", "data.train_weights=[2,1]"])
    assert [(f.path, f.weight) for f in train_files(cfg.data)] == [("x/a.jsonl", 2.0), ("y/b.parquet", 1.0)]
    cfg = load_config(None, ["data.eval_path=[x/aime.jsonl,y/math.jsonl]"])
    assert [f.name for f in eval_files(cfg.data)] == ["aime", "math"]
    assert [f.name for f in eval_files(load_config(None, ["data.eval_path=x/aime.jsonl"]).data)] == [""]
    for overrides, message in (
        (["data.train_path=a.jsonl", "data.train_weights=[1]"], r"data.train_weights has 1 weights for 1 file"),
        (["data.train_path=[a.jsonl,b.jsonl]", "data.train_weights=[1,0]"], r"train_weights\[1\] = 0 is not a"),
        (["data.train_path=[a.jsonl,'']"], r"data.train_path\[1\] = '' is not a file path"),
        (["data.eval_path=[x/a.jsonl,y/a.jsonl]"], r"names \['a', 'a'\] repeat"),
        (["data.eval_path=[a.jsonl,b.jsonl]", "data.eval_names=[a]"], r"data.eval_names has 1 names for 2 files"),
        (["data.eval_path=a.jsonl", "data.eval_names=[a]"], r"data.eval_names names the files of a list"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_the_rollout_data_of_lists_of_files(tmp_path: Path) -> None:
    """RolloutData.load: a weighted mixture of the train files, the eval prompts by file name, the data/
    counts summed over the files."""
    from megatron_rl.config import load_config
    from megatron_rl.data import WeightedSampler
    from megatron_rl.loop.runtime import RolloutData

    tiny_tokenizer.build_tokenizer(tmp_path / "tok")
    paths = [
        write_lines(tmp_path / f"{n}.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"})] * k)
        for n, k in (("a", 2), ("b", 3))
    ]
    cfg = load_config(
        None,
        [
            f"data.tokenizer_path={tmp_path / 'tok'}",
            f"data.train_path=[{paths[0]},{paths[1]}]",
            "data.train_weights=[1,1]",
            f"data.eval_path=[{paths[0]},{paths[1]}]",
            "data.eval_names=[small,big]",
            "data.answer_key=answer",
            "eval.max_prompts=2",
            "model.vocab_size=28",
        ],
    )
    data = RolloutData.load(cfg)
    try:
        assert isinstance(data.sampler, WeightedSampler) and len(data.sampler.samplers) == 2
        assert {name: len(ps) for name, ps in data.eval_prompts.items()} == {"small": 2, "big": 2}
        assert data.metrics["data/train_rows_kept"] == 5.0 and data.metrics["data/eval_rows_kept"] == 5.0
    finally:
        data.close()
