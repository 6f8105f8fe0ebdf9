"""Hugging Face model folders on disk: read safetensors tensor by tensor, write sharded safetensors.

`HFCheckpoint` knows every tensor's file, shape and dtype from the safetensors headers (nothing
else is read until asked) and reads one tensor at a time. `ShardedSafetensorsWriter` writes
tensors into files of at most `max_shard_bytes`; `finalize_hf_folder` names the files the way
`save_pretrained` does and writes `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_rl.models.fused_experts import STACKED_KINDS
from megatron_rl.models.hf_config import ConversionError
from megatron_rl.models.safetensors_io import MappedSafetensors, SafetensorsFormatError, read_header, write_safetensors

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Files next to config.json that a Hugging Face folder needs besides the weights (tokenizer, chat template).
ASSET_PATTERNS = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.*",
    "*.tiktoken",
)
INDEX_NAME = "model.safetensors.index.json"
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class HFCheckpoint:
    """The safetensors tensors of an HF model folder, by checkpoint name."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConversionError(f"{folder} is not a directory")
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{folder} holds no *.safetensors file")
        self._check_index(files)
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in files:
            try:
                entries, _ = read_header(file)
            except SafetensorsFormatError as err:
                raise ConversionError(str(err)) from None
            for name, entry in entries.items():
                if name in self.files:
                    raise ConversionError(f"tensor {name!r} is in both {self.files[name].name} and {file.name}")
                self.files[name] = file
                self.shapes[name] = tuple(entry["shape"])
                self.dtypes[name] = entry["dtype"]
        self._maps: dict[Path, MappedSafetensors] = {}
        self._derived: dict[str, tuple[str, int, slice]] = {}
        self._fused_files: dict[str, Path] = {}

    def split_fused_experts(self, family: str) -> None:
        """Present transformers 5's fused experts (`...mlp.experts.gate_up_proj` [E, 2I, H], gate rows
        first, and `...mlp.experts.down_proj` [E, H, I]) under the per-expert checkpoint names
        (`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) that the mappings read; for a
        `family` whose checkpoints stack the experts in their own layout (`fused_experts`: gpt-oss), each
        expert's slice as `...mlp.experts.{e}.{kind}`."""
        stacked = STACKED_KINDS.get(family)
        if stacked is not None:
            self._split_stacked(stacked)
            return
        for name in [n for n in self.shapes if n.endswith(_FUSED)]:
            prefix, kind = name.rsplit(".", 1)
            shape = self.shapes.pop(name)
            file, dtype = self.files.pop(name), self.dtypes.pop(name)
            self._fused_files[name] = file
            if len(shape) != 3:
                raise ConversionError(f"{self.folder}: fused expert tensor {name!r} has shape {list(shape)}, not 3-D")
            rows = shape[1] // 2
            parts = (
                {"gate_proj": slice(0, rows), "up_proj": slice(rows, 2 * rows)}
                if kind == "gate_up_proj"
                else {"down_proj": slice(0, shape[1])}
            )
            for expert in range(shape[0]):
                for part, rows_of in parts.items():
                    derived = f"{prefix}.{expert}.{part}.weight"
                    self._derived[derived] = (name, expert, rows_of)
                    self.files[derived], self.dtypes[derived] = file, dtype
                    self.shapes[derived] = (rows_of.stop - rows_of.start, shape[2])

    def _split_stacked(self, kinds: tuple[str, ...]) -> None:
        for name in [n for n in self.shapes if n.rsplit(".", 1)[-1] in kinds and ".mlp.experts." in n]:
            prefix, kind = name.rsplit(".", 1)
            shape = self.shapes.pop(name)
            file, dtype = self.files.pop(name), self.dtypes.pop(name)
            self._fused_files[name] = file
            for expert in range(shape[0]):
                derived = f"{prefix}.{expert}.{kind}"
                self._derived[derived] = (name, expert, slice(None))
                self.files[derived], self.dtypes[derived], self.shapes[derived] = file, dtype, tuple(shape[1:])

    def _check_index(self, files: list[Path]) -> None:
        index = self.folder / INDEX_NAME
        if not index.is_file():
            return
        try:
            listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, TypeError, AttributeError):
            raise ConversionError(f"{index}: not a JSON object whose weight_map maps tensor names to files") from None
        missing = sorted(listed - {f.name for f in files})
        if missing:
            raise ConversionError(f"{index} lists files that are not in {self.folder}: {missing}")

    @property
    def file_bytes(self) -> int:
        """Size of the safetensors files."""
        return sum(f.stat().st_size for f in set(self.files.values()))

    def read(self, name: str) -> torch.Tensor:
        """One tensor: a read-only view of its memory-mapped file (copy it before changing it)."""
        if name in self._derived:
            fused, expert, rows = self._derived[name]
            return self._read(fused)[expert, rows]
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        file = self.files.get(name) or self._fused_files.get(name)
        if file is None:
            raise ConversionError(f"tensor {name!r} is not in the checkpoint {self.folder}")
        if file not in self._maps:
            self._maps[file] = MappedSafetensors(file)
        return self._maps[file].get(name)

    def close(self) -> None:
        """Forget the mappings (each is unmapped once no tensor read from it is alive)."""
        self._maps.clear()


def check_tensors(ckpt: HFCheckpoint, expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Raise ConversionError for the first missing tensor, unexpected tensor or wrong shape (names them)."""
    missing = [n for n in expected if n not in ckpt.shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"{ckpt.folder}: missing tensor {missing[0]!r}{more}, expected by {what}")
    unexpected = sorted(n for n in ckpt.shapes if n not in expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConversionError(
            f"{ckpt.folder}: unexpected tensor {unexpected[0]!r}{more} in {ckpt.files[unexpected[0]].name}; "
            f"{what} has no such tensor"
        )
    for name, shape in expected.items():
        if ckpt.shapes[name] != shape:
            raise ConversionError(
                f"{ckpt.folder}: tensor {name!r} has shape {list(ckpt.shapes[name])} in "
                f"{ckpt.files[name].name}, but {what} expects {list(shape)}"
            )
    bad = sorted({d for d in ckpt.dtypes.values() if d not in FLOAT_DTYPES})
    if bad:
        name = next(n for n, d in ckpt.dtypes.items() if d in bad)
        raise ConversionError(f"{ckpt.folder}: tensor {name!r} has dtype {ckpt.dtypes[name]}, not a float type")


def prepare_output_dir(path: str | Path, force: bool) -> Path:
    """`path` as an empty folder: created if absent; an existing non-empty one needs `force` (then it is emptied)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConversionError(f"output {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not force:
            raise ConversionError(f"output folder {path} already exists and is not empty; pass --force to overwrite it")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def copy_assets(src: str | Path, dst: str | Path) -> list[str]:
    """Copy generation config and tokenizer files of an HF folder; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied: list[str] = []
    for pattern in ASSET_PATTERNS:
        for file in sorted(src.glob(pattern)):
            if file.is_file() and file.name not in copied:
                shutil.copy2(file, dst / file.name)
                copied.append(file.name)
    return copied


def write_hf_config(folder: str | Path, hf: dict[str, Any], dtype: torch.dtype) -> None:
    """config.json with the weights' dtype (both spellings `transformers` reads)."""
    name = str(dtype).removeprefix("torch.")
    out = dict(hf)
    out["dtype"] = name
    if "torch_dtype" in out:
        out["torch_dtype"] = name
    Path(folder, "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


class ShardedSafetensorsWriter:
    """Writes tensors into `{prefix}-{k}.safetensors` files of at most `max_shard_bytes` (a larger
    tensor gets a file of its own); keeps only the current file's tensors in memory."""

    def __init__(self, folder: str | Path, prefix: str, max_shard_bytes: int, overwrite: bool = False) -> None:
        self.folder, self.prefix, self.max_bytes = Path(folder), prefix, max_shard_bytes
        self.overwrite = overwrite  # a file of the same size already there is overwritten in place
        self.files: list[tuple[str, list[str], int]] = []  # (file name, tensor names, bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ConversionError(f"tensor {name!r} written twice")
        self._seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._bytes + nbytes > self.max_bytes:
            self.flush()
        self._pending[name] = tensor.detach()  # written from where it is (no copy on the CPU)
        self._bytes += nbytes

    def flush(self) -> None:
        if not self._pending:
            return
        file = f"{self.prefix}-{len(self.files):05d}.safetensors"
        write_safetensors(self.folder / file, self._pending, in_place=self.overwrite)
        self.files.append((file, list(self._pending), self._bytes))
        self._pending, self._bytes = {}, 0


def finalize_hf_folder(
    folder: str | Path, files: Iterable[tuple[str, list[str], int]], rename: bool = True
) -> list[str]:
    """Rename the written files to `model.safetensors` (one) or `model-0000i-of-0000n.safetensors`
    plus the index, in the given order; returns the final file names. `rename=False`: the files
    keep their names, the index lists them, and any other safetensors file in `folder` (an earlier
    layout's) is removed."""
    folder = Path(folder)
    files = list(files)
    if not rename:
        keep = {file for file, _, _ in files}
        for stale in folder.glob("*.safetensors"):
            if stale.name not in keep:
                stale.unlink()
        final = [file for file, _, _ in files]
    elif len(files) == 1:
        os.replace(folder / files[0][0], folder / "model.safetensors")
        return ["model.safetensors"]
    else:
        final = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        for (file, _, _), new in zip(files, final, strict=True):
            os.replace(folder / file, folder / new)
    weight_map = {name: new for (_, names, _), new in zip(files, final, strict=True) for name in names}
    index = {"metadata": {"total_size": sum(b for _, _, b in files)}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return final
