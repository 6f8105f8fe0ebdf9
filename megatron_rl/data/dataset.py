"""A prompt dataset: rows read, checked, rendered and tokenized; bad rows skipped and counted."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from megatron_rl.data.fields import MISSING, get_field
from megatron_rl.data.prompts import PromptFormatError, PromptRenderer, uses_chat_template
from megatron_rl.data.readers import DataError, RowLocation, iter_rows

if TYPE_CHECKING:
    from megatron_rl.config import DataConfig

logger = logging.getLogger(__name__)

# Every reason a row can be skipped for, in report order.
SKIP_REASONS = (
    "invalid_json",  # the line is not valid JSON (or not UTF-8)
    "not_an_object",  # the JSON value is not an object
    "missing_key",  # no prompt or answer under the configured key (or null)
    "bad_type",  # the prompt is not text or chat messages; the answer is not text or a number
    "empty_prompt",  # the prompt has no text
    "empty_answer",  # the answer is an empty string
    "template_error",  # the chat template raised on this row's messages
    "too_long",  # more tokens than data.max_prompt_tokens
)
_TOKENIZE_BATCH = 512


@dataclass(frozen=True)
class Prompt:
    """One usable prompt: `index` is its position in the dataset, `input_ids` the tokenized `text`."""

    index: int
    input_ids: tuple[int, ...]
    text: str
    answer: str
    raw: dict[str, Any]
    location: RowLocation


@dataclass(frozen=True)
class SkippedRow:
    location: RowLocation
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.location}: skipped ({self.reason}): {self.detail}"


@dataclass
class LoadReport:
    """What loading a file did: rows read, rows kept and every skipped row with its reason."""

    path: str
    rows: int = 0
    kept: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)
    unk_tokens: int = 0  # tokens of kept rows that are the tokenizer's unknown token
    unk_rows: int = 0
    first_unk: RowLocation | None = None

    def count_unk(self, location: RowLocation, ids: Sequence[int], unk_id: int | None) -> None:
        """Count the `<unk>` tokens of one kept row (characters outside the tokenizer's vocabulary)."""
        n = sum(1 for i in ids if i == unk_id) if unk_id is not None else 0
        if n:
            self.unk_tokens += n
            self.unk_rows += 1
            self.first_unk = self.first_unk or location

    def warn_unk(self, what: str = "prompts") -> None:
        """A console warning when rows hold `<unk>` tokens (nothing otherwise)."""
        if self.unk_tokens:
            logger.warning(
                "%s: %d %s tokens in %d rows' %s (characters outside the tokenizer's vocabulary), first at %s",
                self.path,
                self.unk_tokens,
                "<unk>",
                self.unk_rows,
                what,
                self.first_unk,
            )

    @property
    def counts(self) -> dict[str, int]:
        """Skipped rows per reason (only reasons that occurred), in SKIP_REASONS order."""
        counter = Counter(s.reason for s in self.skipped)
        return {reason: counter[reason] for reason in SKIP_REASONS if counter[reason]}

    def summary(self) -> str:
        skipped = ", ".join(f"{reason}: {n}" for reason, n in self.counts.items()) or "none"
        unk = f"; <unk> tokens: {self.unk_tokens} in {self.unk_rows} rows" if self.unk_tokens else ""
        return f"{self.path}: kept {self.kept} of {self.rows} rows; skipped: {skipped}{unk}"


class PromptDataset(Sequence[Prompt]):
    """The usable prompts of one file, in file order, and the load report."""

    def __init__(self, prompts: list[Prompt], report: LoadReport) -> None:
        self.prompts = prompts
        self.report = report

    def __len__(self) -> int:
        return len(self.prompts)

    @overload
    def __getitem__(self, i: int) -> Prompt: ...
    @overload
    def __getitem__(self, i: slice) -> list[Prompt]: ...
    def __getitem__(self, i: int | slice) -> Prompt | list[Prompt]:
        return self.prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)


@dataclass(frozen=True)
class _Pending:
    location: RowLocation
    raw: dict[str, Any]
    text: str
    answer: str


def load_prompt_dataset(
    path: str | Path, tokenizer: Any, cfg: DataConfig, max_reported: int = 20, *, answer_messages: bool = False
) -> PromptDataset:
    """Prompts of a .jsonl/.parquet file, using cfg.prompt_key, answer_key, apply_chat_template and
    max_prompt_tokens. The first `max_reported` skipped rows are logged with their file and line
    (parquet: row index); a file without one usable row raises DataError with the counts.
    `answer_messages`: an answer may also be a list of chat messages (an SFT trace; `Prompt.answer`
    is then its JSON text and `Prompt.raw` holds the list)."""
    report = LoadReport(str(path))
    use_template = uses_chat_template(tokenizer, cfg.apply_chat_template)
    render = PromptRenderer(tokenizer, use_template)
    pending: list[_Pending] = []
    for raw_row in iter_rows(path):
        report.rows += 1
        try:
            text, answer = _check_row(raw_row.value, raw_row.error, render, cfg, answer_messages)
        except _Skip as skip:
            report.skipped.append(SkippedRow(raw_row.location, skip.reason, skip.detail))
            continue
        pending.append(_Pending(raw_row.location, raw_row.value, text, answer))
    # A template renders its own special tokens; plain text gets the tokenizer's usual ones (e.g. BOS).
    ids_of = _Tokenizer(tokenizer, add_special_tokens=not use_template)
    prompts: list[Prompt] = []
    for start in range(0, len(pending), _TOKENIZE_BATCH):
        chunk = pending[start : start + _TOKENIZE_BATCH]
        for item, ids in zip(chunk, ids_of([p.text for p in chunk]), strict=True):
            if len(ids) > cfg.max_prompt_tokens:
                detail = f"{len(ids)} tokens > data.max_prompt_tokens = {cfg.max_prompt_tokens}"
                report.skipped.append(SkippedRow(item.location, "too_long", detail))
                continue
            prompts.append(Prompt(len(prompts), ids, item.text, item.answer, item.raw, item.location))
            report.count_unk(item.location, ids, tokenizer.unk_token_id)
    report.kept = len(prompts)
    report.skipped.sort(key=lambda s: s.location.number)
    _log(report, max_reported)
    report.warn_unk()
    if not prompts:
        first = f"; first: {report.skipped[0]}" if report.skipped else ""
        raise DataError(f"data file {path}: no usable prompt rows ({report.summary()}){first}")
    return PromptDataset(prompts, report)


class _Skip(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _check_row(
    value: Any, error: str | None, render: PromptRenderer, cfg: DataConfig, answer_messages: bool = False
) -> tuple[str, str]:
    """(prompt text, answer) of a row; raises _Skip with the reason when the row is unusable."""
    if error is not None:
        raise _Skip("invalid_json", error)
    if not isinstance(value, dict):
        raise _Skip("not_an_object", f"the row is a JSON {type(value).__name__}, not an object")
    prompt = get_field(value, cfg.prompt_key)
    if prompt is MISSING:
        raise _Skip("missing_key", f"no prompt under {cfg.prompt_key!r} (data.prompt_key)")
    answer = get_field(value, cfg.answer_key)
    if answer is MISSING:
        raise _Skip("missing_key", f"no answer under {cfg.answer_key!r} (data.answer_key)")
    if answer_messages and isinstance(answer, list):
        answer = _messages_text(answer, cfg.answer_key)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise _Skip(
            "bad_type", f"the answer under {cfg.answer_key!r} is a {type(answer).__name__}, not text or a number"
        )
    answer = str(answer)
    if not answer.strip():
        raise _Skip("empty_answer", f"the answer under {cfg.answer_key!r} is empty")
    try:
        text = render(prompt)
    except PromptFormatError as err:
        raise _Skip(err.reason, f"{cfg.prompt_key!r}: {err}") from err
    return text, answer


def _messages_text(messages: list[Any], key: str) -> str:
    """The JSON text of a list of chat messages (each {"role": str, "content": str}); _Skip otherwise."""
    if not messages:
        raise _Skip("empty_answer", f"the messages under {key!r} are an empty list")
    for k, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise _Skip("bad_type", f'{key!r}[{k}] is not a message {{"role": str, "content": str}}: {message!r:.80}')
    if messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
        roles = [m["role"] for m in messages]
        raise _Skip(
            "bad_type", f"the messages under {key!r} must start and end with an assistant turn, got roles {roles}"
        )
    return json.dumps(messages, ensure_ascii=False)


class _Tokenizer:
    """Batched tokenization with a cache: datasets such as DAPO-Math-17k repeat each prompt many times."""

    def __init__(self, tokenizer: Any, add_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, texts: list[str]) -> list[tuple[int, ...]]:
        new = list(dict.fromkeys(t for t in texts if t not in self.cache))
        if new:
            encoded = self.tokenizer(new, add_special_tokens=self.add_special_tokens)["input_ids"]
            self.cache.update((text, tuple(ids)) for text, ids in zip(new, encoded, strict=True))
        return [self.cache[t] for t in texts]


def _log(report: LoadReport, max_reported: int) -> None:
    for skipped in report.skipped[:max_reported]:
        logger.warning("%s", skipped)
    if len(report.skipped) > max_reported:
        logger.warning("%s: %d more skipped rows not listed", report.path, len(report.skipped) - max_reported)
    logger.info("%s", report.summary())
