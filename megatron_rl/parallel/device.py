"""Where this rank's tensors, model and collective buffers live."""

from __future__ import annotations

import torch


def local_device() -> torch.device:
    """The current GPU when CUDA is present (NCCL needs its buffers there), else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
