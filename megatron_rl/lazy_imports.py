"""Optional packages that Megatron-Core imports with itself but never uses here: loaded on first use.

Megatron-Core 0.16.1 imports `wandb` when `megatron.core` is imported (its inference context, its dynamic
engine and its timers each `try: import wandb` for features this stack does not turn on). With the
`wandb` extra installed, that import cost every process that imports Megatron (each training rank, each
converter) about 0.5 s of CPU. `install()`, run by the package's `__init__.py` before Megatron is imported,
makes `import wandb` bind a stand-in module that holds the package's spec and loads the package at the
first attribute it is asked for, then answers for it: Megatron's three imports cost nothing, and the W&B
tracker's first `wandb.init` loads the whole package. (importlib's own `LazyLoader` does not do here: on
Python 3.11 a second `import wandb` reads the module's `__spec__` and so loads it.) A package that is not
installed stays an ImportError at its import, as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

LAZY_PACKAGES = frozenset({"wandb"})


class _Deferred(ModuleType):
    """The stand-in bound by `import NAME`: every attribute it lacks comes from the package, loaded once.
    (Before it is bound, the import system probes its dunder attributes: not a use.)"""

    _deferred_bound = False

    def __getattr__(self, attr: str) -> Any:
        if not self._deferred_bound:
            raise AttributeError(attr)
        return getattr(_load(self.__name__), attr)


class _DeferredLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _Deferred(spec.name)
        # `inspect.getmodule` reads `__file__` of every module in sys.modules (torch does so when it registers
        # a custom op, e.g. when TorchDynamo is imported): answered here, it is not a use
        module.__file__ = spec.origin
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing of the package runs at the import: `_load` runs it when it is used."""
        module._deferred_bound = True  # type: ignore[attr-defined]


class _LazyFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.loading: set[str] = set()

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in LAZY_PACKAGES or name in self.loading:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path, target)
        if real is None:
            return None  # not installed: the import fails as it would
        return importlib.machinery.ModuleSpec(name, _DeferredLoader(), origin=real.origin)


_FINDER = _LazyFinder()


def _load(name: str) -> ModuleType:
    """The package itself, imported now in place of its stand-in (which then forwards to it)."""
    current = sys.modules.get(name)
    if current is not None and not isinstance(current, _Deferred):
        return current
    sys.modules.pop(name, None)
    _FINDER.loading.add(name)
    try:
        return importlib.import_module(name)
    finally:
        _FINDER.loading.discard(name)


def install() -> None:
    """Hook the import of `LAZY_PACKAGES` (once; a package imported already stays as it is)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
