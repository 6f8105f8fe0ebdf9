"""Rewards: answer extraction, normalisation, the built-in rules, custom functions and failure counting."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.rewards import (
    RewardConfigError,
    RewardScorer,
    RewardStats,
    Verdict,
    boxed_rule,
    dapo_rule,
    extract_answer_line,
    extract_boxed,
    normalize_answer,
    parse_number,
    resolve_rule,
)
from megatron_rl.rewards.protocol import RewardItem, RuleOutput, encode_request


def test_answer_line_is_the_last_one_within_the_last_300_characters() -> None:
    assert extract_answer_line("Answer: 5\nmore thought\nAnswer: 7\n") == "7"
    assert extract_answer_line("the ANSWER :  -3  ") == "-3"
    # "Answer: 7" starts 305 characters from the end: outside the window.
    assert extract_answer_line("Answer: 7\n" + "." * 295) is None
    assert extract_answer_line("Answer: 7\n" + "." * 290) == "7"
    # An empty answer line does not borrow the next line.
    assert extract_answer_line("Answer:\n22") == ""
    assert extract_answer_line("no final line") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("22", "22"),
        ("22.0", "22"),
        ("+22", "22"),
        ("22.", "22"),
        (" 22 ", "22"),
        ("0022", "22"),
        ("-7", "-7"),
        ("- 7", "-7"),
        ("\u22127", "-7"),
        ("-0", "0"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("12,345.5", "24691/2"),
        ("1,2", "1,2"),
        ("1,23", "1,23"),
        ("0.5", "1/2"),
        (".5", "1/2"),
        ("2/4", "1/2"),
        ("\\frac{1}{2}", "1/2"),
        ("\\dfrac12", "1/2"),
        ("\\tfrac{2}{4}", "1/2"),
        ("-\\frac{3}{6}", "-1/2"),
        ("\\frac{-3}{6}", "-1/2"),
        ("$\\frac{1}{2}$", "1/2"),
        ("\\boxed{\\frac{1}{2}}", "1/2"),
        ("$\\boxed{22}$", "22"),
        ("3/0", "3/0"),
        ("x = 5", "5"),
        ("\\text{ 5 }", "5"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt{2}}{2}"),
        ("\\leftarrow", "\\leftarrow"),
        ("3\\,000", "3000"),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_parse_number_is_exact() -> None:
    assert parse_number("0.1") * 3 == parse_number("3/10")
    assert parse_number("abc") is None and parse_number("1/0") is None


@pytest.mark.parametrize(
    ("response", "answer", "correct"),
    [
        ("4*5=20\n2+20=22\nAnswer: 22", "22", True),
        ("Answer: 5\nwait, no.\nAnswer: 7", "7", True),
        ("Answer: 5\nwait, no.\nAnswer: 7", "5", False),
        ("Answer:   22   \n", "22", True),
        ("answer: -7", "-7", True),
        ("Answer: 7", "-7", False),
        ("Answer: 0.5", "\\frac{1}{2}", True),
        ("Answer: \\dfrac{1}{2}", "0.5", True),
        ("Answer: 0.33", "1/3", False),
        ("Answer: 1,000", "1000", True),
        ("Answer: $22$.", "22", True),
        ("Answer: \\boxed{22}", "22", True),
        ("Answer: 22.0", "22", True),
        ("Answer:\n22", "22", False),
        ("The result is 22.", "22", False),
    ],
)
def test_dapo_rule(response: str, answer: str, correct: bool) -> None:
    assert dapo_rule(response, answer).correct is correct


def test_boxed_extraction_takes_the_last_box_with_nested_braces() -> None:
    assert extract_boxed("first \\boxed{1}, then \\boxed{\\frac{1}{\\sqrt{2}}} done") == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\boxed{\\left\\{1, 2\\right\\}}") == "\\left\\{1, 2\\right\\}"
    assert extract_boxed("so \\boxed 5$ ok") == "5"
    assert extract_boxed("\\fbox{3}") == "3"
    assert extract_boxed("\\boxed{1} and \\boxed{2") is None  # the last box is unbalanced
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    ("response", "answer", "correct"),
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),
        ("\\boxed{3} is wrong; it is \\boxed{\\dfrac{3}{4}}", "0.75", True),
        ("\\boxed{3} is wrong; it is \\boxed{\\dfrac{3}{4}}", "3", False),
        ("\\boxed{\\left(1, 2\\right)}", "(1,2)", True),
        ("\\boxed{-\\frac{7}{2}}", "-3.5", True),
        ("\\boxed{1,000}", "1000", True),
        ("Answer: 22", "22", False),  # no box
    ],
)
def test_boxed_rule(response: str, answer: str, correct: bool) -> None:
    assert boxed_rule(response, answer).correct is correct


def test_scorer_rewards_and_stats() -> None:
    scorer = RewardScorer(RewardConfig(type="dapo", correct_reward=2.0, incorrect_reward=-0.5))
    result = scorer.score(["Answer: 22", "Answer: 21", "no answer", "Answer: 0.5"], ["22", "22", "22", "1/2"])
    assert result.rewards == [2.0, -0.5, -0.5, 2.0]
    assert result.correct == [True, False, False, True] and result.failed == [False] * 4
    assert result.extracted == ["22", "21", None, "0.5"]
    stats = result.stats
    assert (stats.count, stats.correct, stats.no_answer, stats.failed) == (4, 2, 1, 0)
    assert stats.metrics() == {
        "reward/mean": 0.75,
        "reward/accuracy": 0.5,
        "reward/no_answer_fraction": 0.25,
        "reward/failures": 0.0,
        "reward/timeouts": 0.0,
        "reward/count": 4.0,
    }
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        scorer.score(["a", "b"], ["1"])


CUSTOM_MODULE = """
import math

def reward(response, answer):
    if response == "boom":
        raise RuntimeError("verifier crashed")
    if response == "none":
        return None
    if response == "nan":
        return math.nan
    if response == "exact":
        return response.endswith(answer)
    return 0.25 if answer in response else -2.0

not_a_function = 3
"""


@pytest.fixture
def custom_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(CUSTOM_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    return path


@pytest.mark.parametrize("spec", ["my_rewards:reward", "FILE:reward"])
def test_custom_reward_and_counted_failures(spec: str, custom_module: Path) -> None:
    spec = spec.replace("FILE", str(custom_module))
    cfg = RewardConfig(
        type="custom", custom_function=spec, correct_reward=0.25, incorrect_reward=-1.0, failure_reward=-3.0
    )
    result = RewardScorer(cfg).score(
        ["x 22", "x", "boom", "none", "nan", "exact"], ["22", "22", "22", "1", "1", "exact"]
    )
    # numbers pass through; bool -> correct/incorrect reward; a raise or a non-number -> failure reward
    assert result.rewards == [0.25, -2.0, -3.0, -3.0, -3.0, 0.25]
    assert result.correct == [True, False, False, False, False, True]
    assert result.failed == [False, False, True, True, True, False]
    assert result.stats.failed == 3 and result.stats.correct == 2 and result.stats.no_answer == 0
    assert result.stats.errors[0] == "response 2: RuntimeError: verifier crashed"
    assert "returned None" in result.stats.errors[1] and "returned nan" in result.stats.errors[2]
    assert math.isclose(result.stats.metrics()["reward/mean"], (0.25 - 2 - 9 + 0.25) / 6)


def test_custom_reward_errors_name_the_setting(custom_module: Path) -> None:
    def error(spec: str | None) -> str:
        with pytest.raises(RewardConfigError) as err:
            resolve_rule(RewardConfig(type="custom", custom_function=spec))
        assert "reward.custom_function" in str(err.value)
        return str(err.value)

    assert "cannot import module 'no_such_module_xyz'" in error("no_such_module_xyz:f")
    assert "has no function 'missing'" in error("my_rewards:missing") and "'reward'" in error("my_rewards:missing")
    assert "not callable" in error("my_rewards:not_a_function")
    assert "expected 'module:function'" in error("my_rewards")
    assert "no such file" in error(str(custom_module.with_name("absent.py")) + ":reward")
    assert "module:function" in error(None)


def test_math_verify_rule_when_installed() -> None:
    pytest.importorskip("math_verify")
    scorer = RewardScorer(RewardConfig(type="math_verify"))
    result = scorer.score(
        ["so \\boxed{\\frac{\\sqrt{2}}{2}}", "Answer: 22", "\\boxed{3}", "nothing here"],
        ["\\frac{1}{\\sqrt{2}}", "22", "4", "4"],
    )
    assert result.correct == [True, True, False, False] and result.stats.no_answer == 1


def test_math_verify_missing_names_reward_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(RewardConfigError, match=r"reward.type = 'math_verify' needs the math-verify package"):
        RewardScorer(RewardConfig(type="math_verify"))


def test_stats_merge_over_rounds() -> None:
    a = RewardStats(count=2, correct=1, no_answer=0, failed=1, reward_sum=0.0, errors=["e1"])
    b = RewardStats(count=3, correct=3, no_answer=1, failed=0, reward_sum=3.0)
    merged = a.merge(b)
    assert (merged.count, merged.correct, merged.no_answer, merged.failed, merged.reward_sum) == (5, 4, 1, 1, 3.0)
    assert merged.errors == ["e1"] and merged.metrics()["reward/accuracy"] == 0.8


@pytest.mark.parametrize(
    "out",
    [Verdict(True, "22"), Verdict(False, "3"), Verdict(False, None), True, False, 0.25, -3, 7.0],
)
def test_rule_outputs_survive_the_wire(out: object) -> None:
    """What a function returns on the reward server is what the trainer interprets, for every kind."""
    local = RuleOutput.of(out)
    wire = json.loads(json.dumps({"results": [local.to_json()]}))
    assert RuleOutput.from_json(wire["results"][0], "result 0") == local
    scorer = RewardScorer(RewardConfig(correct_reward=2.0, incorrect_reward=-0.5), rule=lambda r, a: out)
    expected = {True: 2.0, False: -0.5}.get(out.correct if isinstance(out, Verdict) else out, out)
    assert scorer.score(["x"], ["y"]).rewards == [float(expected)]


def test_functions_that_name_prompt_or_row_get_them() -> None:
    seen: list[tuple] = []

    def with_prompt(response: str, answer: str, prompt: str | None) -> float:
        seen.append(("prompt", prompt))
        return 1.0

    def with_kwargs(response: str, answer: str, **extra: object) -> float:
        seen.append(("kwargs", extra))
        return 1.0

    def plain(response: str, answer: str) -> float:
        return 1.0

    @dataclass
    class P:
        text: str
        answer: str
        raw: dict

    prompts = [P("what is 1+1?", "2", {"id": 7})]
    for fn in (with_prompt, with_kwargs, plain):
        RewardScorer(RewardConfig(type="custom"), rule=fn).score_prompts(["2"], prompts)
    assert seen == [("prompt", "what is 1+1?"), ("kwargs", {"prompt": "what is 1+1?", "row": {"id": 7}})]
    with pytest.raises(ValueError, match="1 responses but 2 prompts"):
        RewardScorer(RewardConfig(type="custom"), rule=plain).score(["a"], ["1"], prompts=["p", "q"])


def test_rows_from_parquet_become_json() -> None:
    import datetime

    import numpy as np

    body = json.loads(
        encode_request(
            [RewardItem("r", "a", "p", {"ids": np.arange(3), "n": np.int64(4), "day": datetime.date(2026, 1, 2)})]
        )
    )
    assert body == {
        "items": [
            {"response": "r", "answer": "a", "prompt": "p", "row": {"ids": [0, 1, 2], "n": 4, "day": "2026-01-02"}}
        ]
    }
