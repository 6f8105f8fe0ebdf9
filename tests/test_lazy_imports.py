"""megatron_rl/lazy_imports.py: Megatron's `import wandb` binds a stand-in; the package runs at its first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_rl import lazy_imports

pytest.importorskip("wandb")

PROBE = """
import sys, megatron_rl, megatron.core, megatron.core.timers as timers
stand_in = timers.wandb
import inspect; inspect.getmodule(compile('', '/nowhere/mrl.py', 'exec'))  # reads every module's __file__, as torch's custom ops do
print(type(stand_in).__name__, 'wandb.sdk' in sys.modules, stand_in.__file__.endswith('wandb/__init__.py'))
settings = stand_in.Settings  # the first use
print(settings.__module__, type(sys.modules['wandb']).__name__, stand_in.init is sys.modules['wandb'].init)
import wandb.sdk.lib
print(type(sys.modules['wandb']).__name__)
"""


def test_megatrons_import_of_wandb_runs_nothing_until_an_attribute_is_used() -> None:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == [
        "_Deferred False True",  # imported by Megatron three times, nothing of it ran; its file known
        "wandb.sdk.wandb_settings module True",  # loaded at the first attribute; the stand-in answers for it
        "module",
    ]


def test_a_package_that_is_not_installed_still_fails_at_its_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lazy_imports, "LAZY_PACKAGES", frozenset({"no_such_package_mrl"}))
    assert lazy_imports._FINDER.find_spec("no_such_package_mrl", None) is None
    with pytest.raises(ModuleNotFoundError):
        __import__("no_such_package_mrl")
