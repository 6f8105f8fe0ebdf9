"""The CPU compatibility layer: every patched symbol still exists in the installed torch/megatron-core.

If this fails after an upgrade, a patch in megatron_rl/parallel/cpu_compat.py targets a symbol
that has moved or gone: re-verify that patch against the new source before anything else.
"""

from __future__ import annotations

import megatron.core
import pytest

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
