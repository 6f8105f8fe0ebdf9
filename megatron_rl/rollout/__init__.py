"""Rollout engines: the engine interface, the SGLang client, the local SGLang-compatible engine, and
the wire formats the engines and the trainer's weight sync share (`wire.py`, `types.py`)."""
