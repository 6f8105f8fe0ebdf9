"""Megatron-Core's fused functions run eagerly on a machine without CUDA.

Megatron decorates its fused functions with `megatron.core.jit.jit_fuser`, which is `torch.compile`.
The first decoration imports TorchDynamo and Inductor's compiler: measured, a training rank's start
(imports and the actor's build) takes 3.1 s of CPU instead of 4.3 s without them (torch's optimizer
imports TorchDynamo on its own, not the compiler). A call would compile C++ for the CPU.
The builders turn Megatron's fusion switches off (`models/builder.py`), but the router's expert-bias
update and the experts' activations call theirs unconditionally.

`install()` (run by `megatron_rl/__init__.py`, before anything of Megatron is imported) hooks the import
of `megatron.core.jit`. Once that module has run, and only when CUDA is absent, it calls Megatron's own
`disable_jit_fuser()`, so that every module that takes `jit_fuser` afterwards takes the no-op. With CUDA
nothing changes. This module imports nothing heavy: torch is imported by Megatron before the hook acts.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"


class _EagerWithoutCuda(importlib.abc.Loader):
    """The loader of `megatron.core.jit`, then `disable_jit_fuser()` when CUDA is absent."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        import torch

        if not torch.cuda.is_available():
            module.disable_jit_fuser()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... (tracebacks, inspect)
        return getattr(self._loader, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _EagerWithoutCuda(spec.loader)
        return spec


def install() -> None:
    """Hook the import of `megatron.core.jit` (once; a no-op when it is already imported)."""
    if JIT_MODULE not in sys.modules and not any(isinstance(f, _JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
