"""Policy losses of GRPO, DAPO, GSPO, GSPO-token and SAPO in one form (torch only).

`policy_loss` is the entry; `global_normalizer` builds the whole-batch constants that make
micro-batch losses add up exactly; `merge_metrics` / `metric_reduce_op` / `finalize_metrics`
reduce and read its metrics.
"""

from megatron_rl.losses.aggregation import Normalizer, global_normalizer
from megatron_rl.losses.metrics import finalize_metrics, merge_metrics, metric_reduce_op
from megatron_rl.losses.objective import policy_loss

__all__ = ["Normalizer", "finalize_metrics", "global_normalizer", "merge_metrics", "metric_reduce_op", "policy_loss"]
