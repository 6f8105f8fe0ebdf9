"""megatron-rl: RL post-training for Mixture-of-Experts language models."""

from megatron_rl import eager_jit, lazy_imports

__version__ = "0.1.0"

eager_jit.install()  # before any module of Megatron-Core is imported
lazy_imports.install()
