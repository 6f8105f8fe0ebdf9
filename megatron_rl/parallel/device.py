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


def transformer_engine_version() -> str:
    """The installed Transformer Engine's version ("0" where it cannot be imported: no fusion needs it then)."""
    try:
        import transformer_engine
    except ImportError:
        return "0"
    return str(getattr(transformer_engine, "__version__", "0"))
