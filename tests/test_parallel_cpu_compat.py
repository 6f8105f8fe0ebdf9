"""The CPU compatibility layer: every patched symbol still exists in the installed torch/megatron-core.

If this fails after an upgrade, a patch in megatron_rl/parallel/cpu_compat.py targets a symbol
that has moved or gone: re-verify that patch against the new source before anything else.
"""

from __future__ import annotations

import subprocess
import sys

import megatron.core
import pytest
import torch

from megatron_rl.parallel import cpu_compat


def test_every_patched_symbol_exists() -> None:
    missing = cpu_compat.missing_targets()
    assert not missing, f"patched symbols missing from megatron-core {megatron.core.__version__}: {missing}"


def test_patches_are_named_and_explained() -> None:
    names = [p.name for p in cpu_compat.PATCHES]
    assert len(set(names)) == len(names)
    expected = {"cuda_device", "cuda_misc", "cuda_stream", "cuda_rng", "device_mode", "te_gemm", "a2a_splits"}
    assert expected | {"uneven_coll"} <= set(names)
    for patch in cpu_compat.PATCHES:
        assert patch.targets and len(patch.reason) > 40, patch.name


def test_version_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron.core, "__version__", cpu_compat.VERIFIED_MEGATRON_CORE)
    assert cpu_compat.check_megatron_version()
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.warns(RuntimeWarning, match="megatron-core 0.99.0 is installed but .* verified on 0.16.1"):
        assert not cpu_compat.check_megatron_version()


def test_without_cuda_megatrons_fused_functions_are_eager_and_inductor_is_not_imported() -> None:
    """megatron_rl/eager_jit.py, in a fresh process: importing the package first makes Megatron's
    `jit_fuser` its own no-op before the router takes it, so no decoration imports Inductor."""
    code = (
        "import sys, megatron_rl, megatron.core.jit as jit, megatron.core.transformer.moe.router as router; "
        "print(router.jit_fuser is jit.noop_decorator, 'torch._inductor' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    eager = not torch.cuda.is_available()
    assert done.stdout.split() == [str(eager), str(not eager)], done.stdout
