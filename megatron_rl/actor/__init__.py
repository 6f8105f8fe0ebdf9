"""The Megatron actor: vocab-parallel log-probs and entropy, micro-batch packing."""

from megatron_rl.actor.logprobs import LogProbs, vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden
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

__all__ = [
    "LogProbs",
    "MicroBatch",
    "MicroBatchPlan",
    "agree_num_micro_batches",
    "balance_across_ranks",
    "pad_right",
    "plan_micro_batches",
    "plans_with_equal_count",
    "unpad",
    "vocab_parallel_logprobs",
    "vocab_parallel_logprobs_from_hidden",
]
