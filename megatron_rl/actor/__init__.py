"""The Megatron actor: vocab-parallel log-probs and entropy, micro-batch packing, the policy on Megatron-Core.

`MegatronActor` and `LogProbResult` are imported on first use (PEP 562): they need Megatron-Core,
whose import costs seconds, and users of the log-prob kernels or `ActorBatch` alone need only torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.logprobs import LogProbs, vocab_parallel_logprobs_from_hidden
from megatron_rl.actor.micro_batches import (
    MicroBatch,
    MicroBatchPlan,
    agree_num_micro_batches,
    balance_across_ranks,
    pad_right,
    plan_micro_batches,
    plans_with_equal_count,
    unpad,
)

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.forward import LogProbResult

_LAZY = {"MegatronActor": "megatron_rl.actor.actor", "LogProbResult": "megatron_rl.actor.forward"}

__all__ = [
    "ActorBatch",
    "LogProbResult",
    "LogProbs",
    "MegatronActor",
    "MicroBatch",
    "MicroBatchPlan",
    "agree_num_micro_batches",
    "balance_across_ranks",
    "pad_right",
    "plan_micro_batches",
    "plans_with_equal_count",
    "unpad",
    "vocab_parallel_logprobs_from_hidden",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
