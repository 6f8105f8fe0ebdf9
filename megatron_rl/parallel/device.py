"""Where this rank's tensors, model and collective buffers live."""

from __future__ import annotations

import importlib.util

import torch


def local_device() -> torch.device:
    """The current GPU when CUDA is present (NCCL needs its buffers there), else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def transformer_engine_available() -> bool:
    """Transformer Engine specs need both the package and a GPU."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
