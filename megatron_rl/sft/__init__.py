"""Supervised fine-tuning (cross-entropy on response tokens) on the Megatron actor: the cold/warm start."""

from megatron_rl.sft.data import SFTExample, load_sft_examples, sft_batch
from megatron_rl.sft.loss import cross_entropy_loss

__all__ = ["SFTExample", "cross_entropy_loss", "load_sft_examples", "sft_batch"]
