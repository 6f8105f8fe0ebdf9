"""Policy losses of GRPO, DAPO, GSPO, GSPO-token and SAPO in one form (torch only).

`LossSpec` (built once per run from the config's `algorithm` section) says what to compute;
`policy_loss` is the entry; `global_normalizer` builds the whole-batch constants that make
micro-batch losses add up exactly; `merge_metrics` / `metric_reduce_op` / `finalize_metrics`
reduce and read its metrics.

Only `losses.spec` is imported with the package: the rest needs torch and is imported on first
use (PEP 562), so `megatron_rl.config`, which reads the choice lists of `losses.spec`, stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_rl.losses.spec import LossSpec

if TYPE_CHECKING:
    from megatron_rl.losses.aggregation import Normalizer, global_normalizer
    from megatron_rl.losses.metrics import finalize_metrics, merge_metrics, metric_reduce_op
    from megatron_rl.losses.objective import policy_loss

_MODULE_OF = {
    "Normalizer": "aggregation",
    "global_normalizer": "aggregation",
    "finalize_metrics": "metrics",
    "merge_metrics": "metrics",
    "metric_reduce_op": "metrics",
    "policy_loss": "objective",
}

__all__ = [
    "LossSpec",
    "Normalizer",
    "finalize_metrics",
    "global_normalizer",
    "merge_metrics",
    "metric_reduce_op",
    "policy_loss",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
