"""Weight updates in Hugging Face checkpoint names, applied to the in-memory `transformers` model.

Checkpoints (and SGLang's weight-update endpoints) name one tensor per expert
(`...mlp.experts.{e}.gate_proj.weight`, Mixtral and MiniMax-M2: `...block_sparse_moe.experts.{e}.w1.weight`),
while `transformers` 5.x keeps each layer's experts fused (`experts.gate_up_proj` [E, 2I, H] with
the gate rows first, `experts.down_proj` [E, H, I]); gpt-oss's checkpoints hold its stacked experts
as transformers does (`models.fused_experts`). `CheckpointLayout` maps every checkpoint name
onto the view of the in-memory parameter it fills; `apply_named_tensors` validates a whole update
(names, shapes, dtypes) before copying anything, so a rejected update leaves the old weights serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_rl.models.fused_experts import stacks_experts
from megatron_rl.models.safetensors_io import DTYPES, MappedSafetensors, SafetensorsFormatError, read_header

_FUSED = re.compile(r"(?P<prefix>.*)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)")
_FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


class WeightUpdateError(ValueError):
    """An update that cannot be applied; the message names the tensor."""


_BLOCK_SPARSE_MOE = ("mixtral", "minimax_m2")  # families whose checkpoints name the MoE block block_sparse_moe


def _expert_names(family: str, prefix: str, expert: int) -> tuple[str, str, str]:
    """Checkpoint names of one expert's (gate, up, down) weights."""
    if family in _BLOCK_SPARSE_MOE:
        base = f"{prefix}.block_sparse_moe.experts.{expert}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = f"{prefix}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def _checkpoint_name(family: str, name: str) -> str:
    if family in _BLOCK_SPARSE_MOE:  # the router (and MiniMax-M2's expert bias, held by the block)
        return re.sub(r"\.mlp\.(gate\.weight|e_score_correction_bias)$", r".block_sparse_moe.\1", name)
    return name


class CheckpointLayout:
    """Checkpoint tensor name -> the in-memory tensor view it is copied into."""

    def __init__(self, model: torch.nn.Module, family: str):
        self.targets: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            match = None if stacks_experts(family) else _FUSED.fullmatch(name)
            if match is None:
                self.targets[_checkpoint_name(family, name)] = tensor.data
                continue
            prefix, kind = match["prefix"], match["kind"]
            for e in range(tensor.shape[0]):
                gate, up, down = _expert_names(family, prefix, e)
                if kind == "down_proj":
                    self.targets[down] = tensor.data[e]
                else:
                    half = tensor.shape[1] // 2
                    self.targets[gate] = tensor.data[e, :half]
                    self.targets[up] = tensor.data[e, half:]

    def __contains__(self, name: str) -> bool:
        return name in self.targets

    def check(self, name: str, shape: Iterable[int], dtype: torch.dtype | None = None) -> None:
        """Raise `WeightUpdateError` unless `name` exists here with this shape (and a float dtype)."""
        target = self.targets.get(name)
        if target is None:
            close = [n for n in self.targets if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:3]
            hint = f"; similar names: {close}" if close else ""
            raise WeightUpdateError(f"unknown tensor {name!r}: the model has no such checkpoint name{hint}")
        shape = tuple(int(s) for s in shape)
        if shape != tuple(target.shape):
            raise WeightUpdateError(
                f"tensor {name!r}: shape {list(shape)} does not match the model's {list(target.shape)}"
            )
        if dtype is not None and dtype not in _FLOAT_DTYPES:
            raise WeightUpdateError(f"tensor {name!r}: dtype {dtype} is not a floating-point type")

    def in_place_targets(
        self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], device: torch.device
    ) -> list[torch.Tensor] | None:
        """The parameter views that tensors announced so can be received into directly (every name
        valid, and each view contiguous, of that dtype, on `device`), or None when any one cannot."""
        views = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            try:
                self.check(name, shape, dtype)
            except WeightUpdateError:
                return None
            view = self.targets[name]
            if view.dtype != dtype or view.device != device or not view.is_contiguous():
                return None
            views.append(view)
        return views

    def copy(self, name: str, value: torch.Tensor) -> None:
        target = self.targets[name]
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def apply_named_tensors(layout: CheckpointLayout, named: list[tuple[str, torch.Tensor]]) -> int:
    """Validate every (name, tensor), then copy them all; returns the number of bytes copied."""
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            raise WeightUpdateError(f"tensor {name!r}: expected a torch.Tensor, got {type(value).__name__}")
        layout.check(name, value.shape, value.dtype)
    with torch.no_grad():
        for name, value in named:
            layout.copy(name, value)
    return sum(v.numel() * v.element_size() for _, v in named)


def safetensors_files(folder: str) -> list[Path]:
    path = Path(folder)
    if not path.is_dir():
        raise WeightUpdateError(f"model_path {folder!r} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"model_path {folder!r} holds no *.safetensors file")
    return files


def check_safetensors_dir(layout: CheckpointLayout, folder: str) -> list[str]:
    """Validate every tensor of a safetensors folder from the file headers; returns their names."""
    names: list[str] = []
    for file in safetensors_files(folder):
        try:
            entries, _ = read_header(file)
        except SafetensorsFormatError as err:
            raise WeightUpdateError(str(err)) from None
        for name, entry in entries.items():
            dtype = DTYPES.get(entry["dtype"])
            if dtype not in _FLOAT_DTYPES:
                raise WeightUpdateError(f"tensor {name!r} in {file.name}: dtype {entry['dtype']} is not float")
            try:
                layout.check(name, entry["shape"], dtype)
            except WeightUpdateError as err:
                raise WeightUpdateError(f"{err} (in {file})") from None
            names.append(name)
    return names


def iter_safetensors_dir(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the folder as a view of its file's memory map (read once, by whoever copies it)."""
    for file in safetensors_files(folder):
        mapped = MappedSafetensors(file)
        for name in mapped.entries:
            yield name, mapped.get(name)


def load_safetensors_dir(layout: CheckpointLayout, folder: str) -> int:
    """Validate a folder from its headers, then copy its tensors from the page cache straight into the
    model's parameters (one copy per byte); returns bytes."""
    check_safetensors_dir(layout, folder)
    total = 0
    with torch.no_grad():
        for name, value in iter_safetensors_dir(folder):
            layout.copy(name, value)
            total += value.numel() * value.element_size()
    return total
