"""The remote-reward protocol: what a reward function's output is, and how it travels over HTTP.

`POST /score` (header `Authorization: Bearer KEY`) with

    {"items": [{"response": str, "answer": str, "prompt": str | null, "row": object | null}, ...]}

answers HTTP 200 with one result per item, in order:

    {"results": [{"score": number, "correct": bool, "extracted": str | null} | {"error": str, "timeout": bool}, ...]}

`score` is required and finite (a bool or a `Verdict` gives 1 or 0); `correct` is present when the
function gave a verdict (bool or `Verdict`), and the trainer then uses reward.correct_reward /
reward.incorrect_reward as for a local rule; `extracted` (only from a `Verdict`) is the final answer
the rule found, null when it found none. `{"error": ...}` reports that the function raised on that item;
`"timeout": true` beside it (optional, absent = false) that it ran past the server's `--item-timeout-s`
(the trainer counts those in `reward/timeouts` too).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from megatron_rl.rewards.rules import Verdict

API_KEY_ENV = "MEGATRON_RL_REWARD_API_KEY"
SCORE_PATH = "/score"


class MalformedReplyError(ValueError):
    """A reward server's reply that does not follow the protocol; the message names what is wrong."""


class ItemError(RuntimeError):
    """A reward function's failure on one item, as its message (the function's own exception may not
    pickle or travel); `timeout`: it ran past its time limit."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:  # from a worker process: both fields, whatever the subclass
        return (type(self), (str(self), self.timeout))

    def to_json(self) -> dict[str, Any]:
        """The item's result in a /score reply: {"error": message}, with "timeout": true when it timed out."""
        return {"error": str(self), "timeout": True} if self.timeout else {"error": str(self)}


class RemoteItemError(ItemError):
    """The reward server reported that its function failed on one item."""


@dataclass(frozen=True)
class RewardItem:
    """One response to score: the response text, the reference answer, the prompt the model saw and
    the data row it came from (every field of the row as read from the file)."""

    response: str
    answer: str
    prompt: str | None = None
    row: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"response": self.response, "answer": self.answer, "prompt": self.prompt, "row": self.row}


@dataclass(frozen=True)
class RuleOutput:
    """A reward function's output, checked: `score` (a verdict gives 1.0 or 0.0), `correct` (None
    for a plain number), `extracted` and `found` (False when a `Verdict` found no final answer)."""

    score: float
    correct: bool | None = None
    extracted: str | None = None
    found: bool = True
    verdict: bool = False  # the output was a Verdict (it reports `extracted`)

    @classmethod
    def of(cls, out: Any) -> RuleOutput:
        """The output of a rule: a Verdict, a bool or a finite number (anything else raises TypeError)."""
        if isinstance(out, Verdict):
            return cls(float(out.correct), out.correct, out.extracted, out.extracted is not None, verdict=True)
        if isinstance(out, bool):
            return cls(float(out), out)
        if isinstance(out, Real) and math.isfinite(float(out)):
            return cls(float(out))
        raise TypeError(f"the reward function returned {out!r}; expected a bool or a finite number")

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = {"score": self.score}
        if self.correct is not None:
            result["correct"] = self.correct
        if self.verdict:
            result["extracted"] = self.extracted
        return result

    @classmethod
    def from_json(cls, result: Any, where: str) -> RuleOutput:
        """The output a reply's result stands for; MalformedReplyError (prefixed by `where`) when it
        breaks the protocol, RemoteItemError when it reports the function's failure."""
        if not isinstance(result, dict):
            raise MalformedReplyError(f"{where} is {type(result).__name__} {_short(result)}, not an object")
        if "error" in result:
            timeout = result.get("timeout") is True  # optional: servers that do not send it report no timeouts
            raise RemoteItemError(f"{where}: the server's reward function failed: {result['error']}", timeout)
        if "score" not in result:
            raise MalformedReplyError(f"{where} has no 'score' (keys: {sorted(result)})")
        score = result["score"]
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise MalformedReplyError(f"{where}: 'score' is {_short(score)}, not a number")
        if not math.isfinite(score):
            raise MalformedReplyError(f"{where}: 'score' is {score}, not a finite number")
        correct = result.get("correct")
        if correct is not None and not isinstance(correct, bool):
            raise MalformedReplyError(f"{where}: 'correct' is {_short(correct)}, not true or false")
        verdict = "extracted" in result
        extracted = result.get("extracted")
        if extracted is not None and not isinstance(extracted, str):
            raise MalformedReplyError(f"{where}: 'extracted' is {_short(extracted)}, not a string or null")
        return cls(float(score), correct, extracted, not verdict or extracted is not None, verdict)


def encode_request(items: Sequence[RewardItem]) -> bytes:
    """The /score body; row values JSON cannot hold (arrays, dates, bytes from parquet) are converted."""
    return json.dumps({"items": [item.to_json() for item in items]}, default=_json_default).encode()


def decode_request(body: Any) -> list[RewardItem]:
    """The items of a /score body; ValueError naming the item and field that break the protocol."""
    if not isinstance(body, dict) or not isinstance(body.get("items"), list):
        raise ValueError('the body must be a JSON object {"items": [...]}')
    items = []
    for i, item in enumerate(body["items"]):
        if not isinstance(item, dict):
            raise ValueError(f"items[{i}] is {type(item).__name__}, not an object")
        for key in ("response", "answer"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"items[{i}].{key} must be a string (got {_short(item.get(key))})")
        prompt, row = item.get("prompt"), item.get("row")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"items[{i}].prompt must be a string or null (got {_short(prompt)})")
        if row is not None and not isinstance(row, dict):
            raise ValueError(f"items[{i}].row must be an object or null (got {_short(row)})")
        items.append(RewardItem(item["response"], item["answer"], prompt, row))
    return items


def decode_reply(text: str, expected: int, where: str) -> list[RuleOutput | Exception]:
    """The outputs of a /score reply for `expected` items: per item, its output or the error that
    stands in for it; a reply that is not a list of `expected` results raises MalformedReplyError."""
    try:
        body = json.loads(text)
    except ValueError:
        raise MalformedReplyError(f"{where}: the reply is not JSON: {text[:200]!r}") from None
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise MalformedReplyError(f'{where}: the reply is not {{"results": [...]}}: {text[:200]!r}')
    if len(results) != expected:
        raise MalformedReplyError(f"{where}: the reply holds {len(results)} results for {expected} items")
    outputs: list[RuleOutput | Exception] = []
    for j, result in enumerate(results):
        try:
            outputs.append(RuleOutput.from_json(result, f"{where}: result {j}"))
        except (MalformedReplyError, RemoteItemError) as err:
            outputs.append(err)
    return outputs


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if hasattr(value, "isoformat"):  # dates and times
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
