"""Answer extraction, normalisation and verification; batched scoring from the `reward` config,
locally in worker processes (`workers.py`) or on a reward server (`remote.py`, `server.py`: imported
only when used, for aiohttp)."""

from megatron_rl.rewards.extract import DAPO_WINDOW_CHARS, extract_answer_line, extract_boxed, strip_boxed
from megatron_rl.rewards.normalize import normalize_answer, parse_number
from megatron_rl.rewards.protocol import RewardItem, RuleOutput
from megatron_rl.rewards.registry import (
    BUILTIN_RULES,
    RewardConfigError,
    RewardFn,
    load_custom_function,
    load_group_filter,
    load_reward_function,
    resolve_rule,
    rule_caller,
)
from megatron_rl.rewards.rules import Verdict, boxed_rule, dapo_rule, math_verify_rule
from megatron_rl.rewards.scorer import RewardFailureError, RewardResult, RewardScorer, RewardStats

__all__ = [
    "BUILTIN_RULES",
    "DAPO_WINDOW_CHARS",
    "RewardConfigError",
    "RewardFailureError",
    "RewardFn",
    "RewardItem",
    "RewardResult",
    "RewardScorer",
    "RewardStats",
    "RuleOutput",
    "Verdict",
    "boxed_rule",
    "dapo_rule",
    "extract_answer_line",
    "extract_boxed",
    "load_custom_function",
    "load_group_filter",
    "load_reward_function",
    "math_verify_rule",
    "normalize_answer",
    "parse_number",
    "resolve_rule",
    "rule_caller",
    "strip_boxed",
]
