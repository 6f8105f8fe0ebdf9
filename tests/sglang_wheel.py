"""SGLang 0.5.23's own code for the tests, without its dependencies (nothing of SGLang's is committed).

The wheel is installed with `uv pip install --no-deps sglang==0.5.23` (the README's test command does);
without it, the wheel is downloaded once into ~/.cache/megatron-rl. Importing `sglang` runs its
heavy `__init__`, so files are read by path: whole modules that need only torch
(`srt/weight_sync/tensor_bucket.py`) are loaded under their real names, and single definitions of
modules that need more (`SafeUnpickler` in `srt/utils/common.py`) are executed on their own.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import pickle
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

VERSION = "0.5.23"
_CACHE = Path(os.path.expanduser("~")) / ".cache" / "megatron-rl" / f"sglang-{VERSION}"


def source(relpath: str) -> Path:
    """The file `sglang/<relpath>` of SGLang 0.5.23 (installed, or from the cached wheel); skips the
    test when neither is available."""
    installed = _installed_version()
    if installed is not None:
        if installed != VERSION:
            pytest.skip(f"sglang {installed} is installed; these checks read {VERSION}")
        from importlib.metadata import distribution

        path = Path(distribution("sglang").locate_file(f"sglang/{relpath}"))  # finds the file, imports nothing
        if path.is_file():
            return path
    target = _CACHE / relpath
    if not target.is_file():
        wheel = _download_wheel()
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf:
            target.write_bytes(zf.read(f"sglang/{relpath}"))
    return target


def _installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _download_wheel() -> Path:
    wheels = _CACHE / "wheel"
    found = sorted(wheels.glob(f"sglang-{VERSION}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps", "-d", str(wheels), "-q"]
    try:
        subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"sglang {VERSION} is neither installed nor downloadable here ({type(err).__name__})")
    return sorted(wheels.glob(f"sglang-{VERSION}-*.whl"))[0]


def load_module(relpath: str, name: str | None = None) -> types.ModuleType:
    """`sglang/<relpath>` executed as a module of its own (`name`, default a private one)."""
    spec = importlib.util.spec_from_file_location(name or f"sglang_{Path(relpath).stem}", source(relpath))
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(spec.name)
    sys.modules[spec.name] = module  # while it runs: dataclasses resolve their string annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del sys.modules[spec.name]
        else:
            sys.modules[spec.name] = previous
    return module


def tensor_bucket(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """SGLang's `sglang.srt.weight_sync.tensor_bucket`, registered under its real name (with empty
    parent packages, for the test's duration) so that SGLang's unpickler resolves the class in it."""
    name = "sglang.srt.weight_sync.tensor_bucket"
    if name in sys.modules:
        return sys.modules[name]
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = []
            monkeypatch.setitem(sys.modules, parent, package)
    module = load_module("srt/weight_sync/tensor_bucket.py", name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def safe_unpickler() -> type[pickle.Unpickler]:
    """SGLang's `SafeUnpickler` class (and the helper it calls), executed from `srt/utils/common.py`."""
    tree = ast.parse(source("srt/utils/common.py").read_text(encoding="utf-8"))
    wanted = {"SafeUnpickler", "_safe_load_torch_storage"}
    nodes = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        raise AssertionError(f"sglang {VERSION}'s common.py no longer defines {sorted(wanted)}")
    namespace: dict[str, Any] = {"pickle": pickle, "io": io, "torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "sglang/srt/utils/common.py", "exec"), namespace)
    return namespace["SafeUnpickler"]


def constant(relpath: str, name: str) -> Any:
    """The literal value of the module-level assignment `name = ...` in `sglang/<relpath>`."""
    tree = ast.parse(source(relpath).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"sglang {VERSION}'s {relpath} no longer assigns {name}")


def _definition(relpath: str, name: str, owner: str | None) -> ast.FunctionDef | ast.AsyncFunctionDef:
    body = ast.parse(source(relpath).read_text(encoding="utf-8")).body
    if owner is not None:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == owner), [])
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise AssertionError(f"sglang {VERSION}'s {relpath} no longer defines {owner + '.' if owner else ''}{name}")


def function_source(relpath: str, name: str, owner: str | None = None) -> str:
    """The source of function `name` of `sglang/<relpath>` (a method of class `owner`)."""
    return ast.unparse(_definition(relpath, name, owner))


def function(relpath: str, name: str, owner: str | None = None, namespace: dict[str, Any] | None = None) -> Any:
    """The function `name` of `sglang/<relpath>` (a method of class `owner`, taken as a plain function),
    executed on its own in `namespace` (with typing's names and torch)."""
    import typing

    scope = {**{n: getattr(typing, n) for n in typing.__all__}, "torch": torch, **(namespace or {})}
    node = _definition(relpath, name, owner)
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"sglang/{relpath}", "exec"), scope)
    return scope[name]


def io_struct_classes(*names: str) -> dict[str, type]:
    """Request classes of SGLang's `srt/managers/io_struct.py` (msgspec Structs on `BaseReq`), executed
    on their own: their fields and annotations as the wheel has them, their methods unused."""
    import typing

    import msgspec

    tree = ast.parse(source("srt/managers/io_struct.py").read_text(encoding="utf-8"))
    wanted = {"BaseReq", *names}
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        raise AssertionError(
            f"sglang {VERSION}'s io_struct.py no longer defines {sorted(wanted - {n.name for n in nodes})}"
        )
    msgspec_utils = load_module("srt/utils/msgspec_utils.py") if _has("srt/utils/msgspec_utils.py") else None
    module = types.ModuleType("sglang_io_struct_lora")  # the classes' module: msgspec resolves annotations there
    sys.modules[module.__name__] = module
    namespace: dict[str, Any] = module.__dict__
    namespace.update({name: getattr(typing, name) for name in typing.__all__})
    namespace.update(msgspec=msgspec, Base64Bytes=getattr(msgspec_utils, "Base64Bytes", object))
    namespace["msgspec_struct_pydantic_core_schema"] = getattr(
        msgspec_utils, "msgspec_struct_pydantic_core_schema", None
    )
    namespace["LoRARef"] = object
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "sglang/srt/managers/io_struct.py", "exec"), namespace)
    return {name: namespace[name] for name in names}


def as_request(cls: type, body: dict, extra: frozenset[str] = frozenset()) -> object:
    """`body` read as SGLang's request struct `cls`: every key a field (but `extra`), every required
    field there, every value of the field's type (a msgspec round trip type-checks)."""
    import base64

    import msgspec

    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    assert set(body) - extra <= set(fields), sorted(set(body) - set(fields))
    required = {n for n, f in fields.items() if f.required}
    assert required <= set(body), sorted(required - set(body))
    values = {k: v for k, v in body.items() if k not in extra}
    if "serialized_named_tensors" in values:  # Base64Bytes: the server decodes the strings to bytes
        values["serialized_named_tensors"] = [
            base64.b64decode(p, validate=True) for p in values["serialized_named_tensors"]
        ]
    return msgspec.json.decode(msgspec.json.encode(cls(**values)), type=cls)


def _has(relpath: str) -> bool:
    try:
        source(relpath)
    except Exception:  # noqa: BLE001 - a file this version does not ship
        return False
    return True
