"""Checkpoints holding each layer's routed experts stacked, one tensor per kind (gpt-oss: `mlp.experts.gate_up_proj`
[experts, hidden, 2 x width], `gate_up_proj_bias`, `down_proj`, `down_proj_bias`), as the Hub files, transformers
and SGLang name them. The mapping (`hf_mapping`) works with one slice per expert, named `mlp.experts.{e}.{kind}`:
reading presents the slices (`hf_io.HFCheckpoint.split_fused_experts`), writing stacks them back (`ExpertFuser`)
once every expert of the layer has come (the exporter gathers a layer's experts on one sender).
"""

from __future__ import annotations

import re

import torch

STACKED_KINDS: dict[str, tuple[str, ...]] = {
    "gpt_oss": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
}
_SLICE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>[a-z_]+)$")


def stacks_experts(family: str) -> bool:
    """Whether `family`'s checkpoints stack each layer's experts into one tensor per kind."""
    return family in STACKED_KINDS


def stacked_name(name: str, family: str) -> tuple[str, int] | None:
    """(the stacked tensor's name, the expert) of a per-expert slice name of `family`; None for any other name."""
    found = _SLICE.fullmatch(name)
    if found is None or found["kind"] not in STACKED_KINDS.get(family, ()):
        return None
    return f"{found['prefix']}.{found['kind']}", int(found["expert"])


def stacked_shapes(shapes: dict[str, tuple[int, ...]], family: str, experts: int) -> dict[str, tuple[int, ...]]:
    """`shapes` (per-expert slices) as the checkpoint files hold them: the slices of a layer stacked."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        stacked = stacked_name(name, family)
        if stacked is None:
            out[name] = shape
        else:
            out[stacked[0]] = (experts, *shape)
    return out


class ExpertFuser:
    """Stacks per-expert slices into the checkpoint's tensors: `add` returns what is complete (any other
    tensor at once, a stacked tensor when its last expert came)."""

    def __init__(self, family: str, experts: int) -> None:
        self.family, self.experts = family, experts
        self._open: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        stacked = stacked_name(name, self.family)
        if stacked is None:
            return [(name, tensor)]
        full, expert = stacked
        if full not in self._open:
            self._open[full] = (tensor.new_empty((self.experts, *tensor.shape)), set())
        buffer, seen = self._open[full]
        if expert in seen or not 0 <= expert < self.experts:
            raise RuntimeError(f"expert slice {name!r} came twice or is out of range ({self.experts} experts)")
        buffer[expert].copy_(tensor)
        seen.add(expert)
        if len(seen) < self.experts:
            return []
        del self._open[full]
        return [(full, buffer)]

    def check_done(self) -> None:
        """RuntimeError naming a stacked tensor some of whose experts never came."""
        if self._open:
            name, (_, seen) = next(iter(self._open.items()))
            raise RuntimeError(f"{name}: only experts {sorted(seen)} of {self.experts} were exported")
