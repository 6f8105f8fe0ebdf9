"""Megatron-Core model builders (and, per family, the HF <-> Megatron parameter mapping).

Import from the modules themselves (`megatron_rl.models.builder`, ...): this package re-exports
nothing, so that its Megatron-free modules (`hf_config`, `families`) load without Megatron, as the
configuration check (`megatron_rl.validation`) needs.
"""
