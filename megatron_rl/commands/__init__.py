"""Subcommands of `megatron-rl` that belong to no single package module."""
