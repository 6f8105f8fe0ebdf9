"""The tiny_tools task: three-digit products `a*b=`, answered exactly only with the calculator tool.

Problems: a, b in 100..999, except the pairs whose product the head estimate below hits exactly
(such as 300*700 or 240*250). A seeded draw gives disjoint train and held-out sets (by prompt text). Rows use
the DAPO-Math-17k format with the bare problem as the user message, like tiny_math's:

    {"data_source": "tiny_tools", "prompt": [{"role": "user", "content": "123*456="}], "ability": "MATH",
     "reward_model": {"ground_truth": "56088", "style": "rule"}, "extra_info": {"index": "train-0", "split": "train"}}

A trace is the episode as chat messages after the prompt (assistant turns and the tool's answers):

    tool     <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>
             -> tool: 56088 -> "Answer: 56088"                                       (right)
    head     "Answer: 50000": the product of a and b rounded to hundreds, in the head     (wrong)
    ignored  the same tool call -> tool: 56088 -> "Answer: 50000": the result ignored,
             the head estimate answered                                              (wrong)

An `ignored` trace makes a well-formed call (the turn reward) and then fails: the case where
per-turn credit and outcome credit judge the call differently.

The tool messages are what the environment (tools_env.TinyToolsEnv) answers to the assistant turn
before them, so SFT trains on the observations RL will see. SFT rows are task rows plus
"response": the trace's messages (megatron-rl sft trains on the assistant turns only).

Usage: python examples/tiny_tools/tools_task.py --out DIR [--seed 0] [--train 5000] [--heldout 500]
       [--sft-rows 25600] [--sft-tool-fraction 0.3] [--sft-ignored-fraction 0.15]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: examples.tiny_tools.tools_env
sys.path.insert(0, str(HERE.parent / "tiny_math"))  # tiny_math's helpers

from examples.tiny_tools.tools_env import TinyToolsEnv  # noqa: E402
from examples.tiny_tools.tools_tokenizer import CALL_PREFIX, CALL_SUFFIX  # noqa: E402

import tiny_task  # noqa: E402
from tiny_task import mixed_sft_rows, task_main, write_splits  # noqa: E402
from tiny_task import write_jsonl as write_jsonl  # noqa: E402  (re-exported: tests write rows with it)

OPERAND_RANGE = range(100, 1000)
DATA_SOURCE = "tiny_tools"
PROCEDURES = ("tool", "head", "ignored")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}"

    @property
    def prompt(self) -> str:
        return f"{self.expression}="

    @property
    def answer(self) -> int:
        return self.a * self.b

    def head_answer(self) -> int:
        """The estimate "in the head": both factors rounded to hundreds (half up), multiplied."""
        return _hundreds(self.a) * _hundreds(self.b)

    def tool_call(self) -> str:
        return f"<tool_call>{CALL_PREFIX}{self.expression}{CALL_SUFFIX}</tool_call>"

    def assistant_turns(self, procedure: str) -> list[str]:
        """The model's turns of a trace of `procedure` (one of PROCEDURES)."""
        if procedure == "tool":
            return [self.tool_call(), f"Answer: {self.answer}"]
        if procedure == "head":
            return [f"Answer: {self.head_answer()}"]
        if procedure == "ignored":
            return [self.tool_call(), f"Answer: {self.head_answer()}"]
        raise ValueError(f"procedure {procedure!r}: allowed: {list(PROCEDURES)}")


def _hundreds(x: int) -> int:
    return (x + 50) // 100 * 100


def is_problem(a: int, b: int) -> bool:
    """Three-digit factors whose product the head estimate misses (e.g. not 240*250 = 200*300)."""
    return a in OPERAND_RANGE and b in OPERAND_RANGE and a * b != _hundreds(a) * _hundreds(b)


def split_problems(seed: int = 0, num_train: int = 5000, num_heldout: int = 500) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): `num_train + num_heldout` distinct problems in a seeded draw, the last held out."""
    if num_train < 1 or num_heldout < 1:
        raise ValueError(f"--train = {num_train} and --heldout = {num_heldout} must be >= 1")
    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < num_train + num_heldout:
        a, b = rng.choice(OPERAND_RANGE), rng.choice(OPERAND_RANGE)
        if is_problem(a, b) and (a, b) not in seen:
            seen.add((a, b))
            problems.append(Problem(a, b))
    return problems[:num_train], problems[num_train:]


def task_row(problem: Problem, index: int, split: str) -> dict[str, Any]:
    """One row in the DAPO-Math-17k format (tiny_math's, with this task's data source)."""
    return tiny_task.task_row(problem, index, split, DATA_SOURCE)


def trace(problem: Problem, procedure: str) -> list[dict[str, str]]:
    """The trace's messages after the prompt: each assistant turn, then what the environment answers
    to it (the turn text as the engine would decode it) while the episode goes on."""
    from megatron_rl.config import EnvConfig
    from megatron_rl.envs import Turn

    env = TinyToolsEnv(EnvConfig(type="examples.tiny_tools.tools_env:TinyToolsEnv", max_turns=3))
    messages: list[dict[str, str]] = []
    turns = problem.assistant_turns(procedure)
    for index, text in enumerate(turns):
        messages.append({"role": "assistant", "content": text})
        obs = env.step(Turn(index, text, (), "stop"))
        if obs.done != (index == len(turns) - 1):
            raise AssertionError(f"{procedure} trace of {problem.prompt}: turn {index} ends the episode {obs.done}")
        if not obs.done:
            messages.append({"role": obs.role, "content": obs.text or ""})
    return messages


def sft_rows(
    train: list[Problem], num_rows: int, tool_fraction: float, ignored_fraction: float, seed: int = 0
) -> list[dict[str, Any]]:
    """Warm-start rows over the train problems in seeded passes: each row's trace is `tool` with
    probability `tool_fraction`, `ignored` with `ignored_fraction`, else `head`."""
    if not (0.0 <= tool_fraction and 0.0 <= ignored_fraction and tool_fraction + ignored_fraction <= 1.0):
        raise ValueError(
            f"--sft-tool-fraction = {tool_fraction} and --sft-ignored-fraction = {ignored_fraction} "
            "must be >= 0 with a sum of at most 1"
        )
    traces: dict[tuple[Problem, str], list[dict[str, str]]] = {}

    def respond(problem: Problem, draw: float) -> tuple[list[dict[str, str]], str]:
        procedure = "tool" if draw < tool_fraction else "ignored" if draw < tool_fraction + ignored_fraction else "head"
        if (problem, procedure) not in traces:
            traces[(problem, procedure)] = trace(problem, procedure)
        return traces[(problem, procedure)], procedure

    return mixed_sft_rows(train, num_rows, seed, respond, DATA_SOURCE)


def write_task(
    out: Path,
    seed: int = 0,
    num_train: int = 5000,
    num_heldout: int = 500,
    num_sft_rows: int = 25_600,
    tool_fraction: float = 0.3,
    ignored_fraction: float = 0.15,
) -> dict[str, Path]:
    """train.jsonl, heldout.jsonl and sft.jsonl under `out`; returns their paths."""
    train, heldout = split_problems(seed, num_train, num_heldout)
    sft = lambda: sft_rows(train, num_sft_rows, tool_fraction, ignored_fraction, seed)  # noqa: E731
    return write_splits(out, train, heldout, sft, DATA_SOURCE)


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="split and SFT-mix seed")
    parser.add_argument("--train", type=int, default=5000, help="train problems")
    parser.add_argument("--heldout", type=int, default=500, help="held-out problems")
    parser.add_argument("--sft-rows", type=int, default=25_600, help="SFT rows (200 steps x batch 128)")
    parser.add_argument("--sft-tool-fraction", type=float, default=0.3, help="share of correct tool-call traces")
    parser.add_argument("--sft-ignored-fraction", type=float, default=0.15, help="share of tool-result-ignored traces")


def write_from_args(args: argparse.Namespace, out: Path) -> dict[str, Path]:
    return write_task(
        out,
        args.seed,
        args.train,
        args.heldout,
        args.sft_rows,
        args.sft_tool_fraction,
        args.sft_ignored_fraction,
    )


def main(argv: list[str] | None = None) -> int:
    return task_main(__doc__, add_task_arguments, write_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
