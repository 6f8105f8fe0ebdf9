"""Rollout engines: the SGLang client, the local SGLang-compatible engine, and weight transport."""
