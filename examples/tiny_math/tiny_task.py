"""The tiny_math task: `a+b*c=` / `b*c+a=` with a step-by-step response ending in an "Answer:" line.

Problems: a in 1..49, b and c in 2..9, in both orders: 6,272 prompts. A seeded shuffle holds out
500 of them (by prompt text, so the splits are disjoint). Rows use the DAPO-Math-17k format, but
the prompt is the bare problem in one user message (no DAPO instruction text: with a character
tokenizer it would be hundreds of tokens long):

    {"data_source": "tiny_math", "prompt": [{"role": "user", "content": "2+4*5="}], "ability": "MATH",
     "reward_model": {"ground_truth": "22", "style": "rule"}, "extra_info": {"index": "train-0", "split": "train"}}

The correct response multiplies first: "4*5=20\\n2+20=22\\nAnswer: 22". The SFT warm-start data mixes it
with a corrupted "addition first" procedure ((a+b)*c, always a wrong answer here since b, c >= 2):
"2+4=6\\n6*5=30\\nAnswer: 30". SFT rows are task rows plus a "response" key.

Usage: python examples/tiny_math/tiny_task.py --out DIR [--seed 0] [--heldout 500] [--sft-rows 128000]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

A_RANGE = range(1, 50)
BC_RANGE = range(2, 10)
DATA_SOURCE = "tiny_math"


class TaskProblem(Protocol):
    """What a task row needs of a problem (tiny_math's and tiny_tools' problems both have it)."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> int: ...


P = TypeVar("P", bound=TaskProblem)


@dataclass(frozen=True)
class Problem:
    """a + b*c, written as `a+b*c=` (form "sum_first") or `b*c+a=` (form "product_first")."""

    a: int
    b: int
    c: int
    form: Literal["sum_first", "product_first"]

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}*{self.c}=" if self.form == "sum_first" else f"{self.b}*{self.c}+{self.a}="

    @property
    def answer(self) -> int:
        return self.a + self.b * self.c

    def correct_response(self) -> str:
        """Multiplication first, then the addition, then the answer line."""
        p = self.b * self.c
        add = f"{self.a}+{p}" if self.form == "sum_first" else f"{p}+{self.a}"
        return f"{self.b}*{self.c}={p}\n{add}={self.answer}\nAnswer: {self.answer}"

    def corrupted_answer(self) -> int:
        """The "addition first" result: (a+b)*c for a+b*c, b*(c+a) for b*c+a."""
        return (self.a + self.b) * self.c if self.form == "sum_first" else self.b * (self.c + self.a)

    def corrupted_response(self) -> str:
        """Addition first (the wrong precedence), in the same three-line shape."""
        if self.form == "sum_first":
            s = self.a + self.b
            return f"{self.a}+{self.b}={s}\n{s}*{self.c}={self.corrupted_answer()}\nAnswer: {self.corrupted_answer()}"
        s = self.c + self.a
        return f"{self.c}+{self.a}={s}\n{self.b}*{s}={self.corrupted_answer()}\nAnswer: {self.corrupted_answer()}"


def all_problems() -> list[Problem]:
    """Every problem, in a fixed canonical order."""
    return [
        Problem(a, b, c, form)
        for form in ("sum_first", "product_first")
        for a in A_RANGE
        for b in BC_RANGE
        for c in BC_RANGE
    ]


def split_problems(seed: int = 0, num_heldout: int = 500) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): a seeded shuffle of all problems, the last `num_heldout` held out."""
    problems = all_problems()
    if not 0 < num_heldout < len(problems):
        raise ValueError(f"--heldout = {num_heldout} must be in 1..{len(problems) - 1}")
    random.Random(seed).shuffle(problems)
    return problems[:-num_heldout], problems[-num_heldout:]


def task_row(problem: TaskProblem, index: int, split: str, data_source: str = DATA_SOURCE) -> dict[str, Any]:
    """One row in the DAPO-Math-17k format."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(problem.answer), "style": "rule"},
        "extra_info": {"index": f"{split}-{index}", "split": split},
    }


def sft_rows(
    train: list[Problem], num_rows: int, correct_fraction: float = 0.45, seed: int = 0
) -> list[dict[str, Any]]:
    """Warm-start rows: the train problems in seeded passes (each pass a fresh shuffle), each row's
    response correct with probability `correct_fraction`, else the addition-first procedure."""
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"--sft-correct-fraction = {correct_fraction} must be in [0, 1]")

    def respond(problem: Problem, draw: float) -> tuple[str, str]:
        if draw < correct_fraction:
            return problem.correct_response(), "correct"
        return problem.corrupted_response(), "addition_first"

    return mixed_sft_rows(train, num_rows, seed, respond)


def mixed_sft_rows(
    train: list[P],
    num_rows: int,
    seed: int,
    respond: Callable[[P, float], tuple[Any, str]],
    data_source: str = DATA_SOURCE,
) -> list[dict[str, Any]]:
    """SFT rows over `train` in seeded passes (each pass a fresh shuffle): the task row of each
    problem plus the "response" and the extra_info "procedure" that `respond(problem, draw)` returns
    for one uniform draw in [0, 1) of the same seeded generator."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    order: list[P] = []
    while len(rows) < num_rows:
        if not order:
            order = list(train)
            rng.shuffle(order)
        problem = order.pop()
        response, procedure = respond(problem, rng.random())
        row = task_row(problem, len(rows), "sft", data_source)
        row["response"] = response
        row["extra_info"]["procedure"] = procedure
        rows.append(row)
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> int:
    """Write rows one JSON object per line; returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")
            n += 1
    return n


def write_task(
    out: Path, seed: int = 0, num_heldout: int = 500, num_sft_rows: int = 128_000, correct_fraction: float = 0.45
) -> dict[str, Path]:
    """train.jsonl, heldout.jsonl and sft.jsonl under `out`; returns their paths."""
    train, heldout = split_problems(seed, num_heldout)
    return write_splits(out, train, heldout, lambda: sft_rows(train, num_sft_rows, correct_fraction, seed))


def write_splits(
    out: Path,
    train: Sequence[TaskProblem],
    heldout: Sequence[TaskProblem],
    sft: Callable[[], list[dict[str, Any]]],
    data_source: str = DATA_SOURCE,
) -> dict[str, Path]:
    """train.jsonl and heldout.jsonl (the problems' task rows), then sft.jsonl (the rows `sft()`
    makes) under `out`; returns their paths."""
    paths = {name: out / f"{name}.jsonl" for name in ("train", "heldout", "sft")}
    write_jsonl((task_row(p, i, "train", data_source) for i, p in enumerate(train)), paths["train"])
    write_jsonl((task_row(p, i, "heldout", data_source) for i, p in enumerate(heldout)), paths["heldout"])
    write_jsonl(sft(), paths["sft"])
    return paths


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="split and SFT-mix seed")
    parser.add_argument("--heldout", type=int, default=500, help="held-out problems")
    parser.add_argument("--sft-rows", type=int, default=128_000, help="SFT rows (1000 steps x batch 128 = one pass)")
    parser.add_argument("--sft-correct-fraction", type=float, default=0.45, help="share of correct SFT responses")


def write_from_args(args: argparse.Namespace, out: Path) -> dict[str, Path]:
    return write_task(out, args.seed, args.heldout, args.sft_rows, args.sft_correct_fraction)


def task_main(
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    write: Callable[[argparse.Namespace, Path], dict[str, Path]],
    argv: list[str] | None = None,
) -> int:
    """The command line of a task script (this one, tiny_tools'): --out and the task's arguments."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    add_arguments(parser)
    args = parser.parse_args(argv)
    for name, path in write(args, args.out).items():
        print(f"{name}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return task_main(__doc__, add_task_arguments, write_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
