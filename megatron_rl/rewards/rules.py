"""The built-in verifiers: (response, reference answer) -> Verdict."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from megatron_rl.rewards.extract import extract_answer_line, extract_boxed
from megatron_rl.rewards.normalize import normalize_answer


@dataclass(frozen=True)
class Verdict:
    """Whether the response's final answer matches; `extracted` is that answer (None: none found)."""

    correct: bool
    extracted: str | None


def dapo_rule(response: str, answer: str) -> Verdict:
    """DAPO-Math: the last "Answer:" line within the last 300 characters, compared after normalisation."""
    extracted = extract_answer_line(response)
    if extracted is None:
        return Verdict(False, None)
    return Verdict(normalize_answer(extracted) == normalize_answer(answer), extracted)


def boxed_rule(response: str, answer: str) -> Verdict:
    """MATH-style: the last \\boxed{...} of the response, compared after normalisation."""
    extracted = extract_boxed(response)
    if extracted is None:
        return Verdict(False, None)
    return Verdict(normalize_answer(extracted) == normalize_answer(answer), extracted)


def math_verify_rule(response: str, answer: str) -> Verdict:
    """Hugging Face math-verify: symbolic equivalence of the response's final answer and the reference."""
    import math_verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout) or math_verify.parse(
        answer, parsing_timeout=timeout
    )
    target = math_verify.parse(response, parsing_timeout=timeout)
    if not target:
        return Verdict(False, None)
    extracted = str(target[-1])
    return Verdict(bool(gold) and math_verify.verify(gold, target, timeout_seconds=timeout), extracted)
