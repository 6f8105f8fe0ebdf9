"""A run's step metrics: the metrics.jsonl writer and reader (`records`) and its PNG curves (`plot`)."""

from megatron_rl.metrics.records import (
    METRICS_FILE,
    TIMING_PREFIXES,
    MetricsLogger,
    read_metrics,
    summarize_updates,
    truncate_metrics,
)

__all__ = ["METRICS_FILE", "TIMING_PREFIXES", "MetricsLogger", "read_metrics", "summarize_updates", "truncate_metrics"]
