"""Prompts of several training files (`data.train_path` as a list): one pool of every file's rows, or a weighted
mixture (`data.train_weights`), either with the `PromptSampler` interface a checkpoint saves and restores."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_rl.data.dataset import Prompt
from megatron_rl.data.sampler import PromptSampler


def pooled(datasets: Sequence[Sequence[Prompt]]) -> list[Prompt]:
    """The files' prompts end to end, each `index` its position in the pool."""
    rows = [p for dataset in datasets for p in dataset]
    return [dataclasses.replace(p, index=i) for i, p in enumerate(rows)]


class WeightedSampler:
    """Each prompt of a draw comes from file i with probability weights[i] / sum(weights), the choices a
    seeded stream of (seed, draw number); each file's prompts come epoch by epoch from its own
    `PromptSampler` (seeded seed + i), so the state is the draw count and the files' positions."""

    def __init__(self, datasets: Sequence[Sequence[Prompt]], weights: Sequence[float], shuffle: bool, seed: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"WeightedSampler: {len(datasets)} datasets for {len(weights)} weights")
        self.samplers = [PromptSampler(d, shuffle=shuffle, seed=seed + i) for i, d in enumerate(datasets)]
        total = float(sum(weights))
        self.probabilities = np.array([w / total for w in weights])
        self.seed, self.draws = seed, 0

    def next(self, n: int) -> list[Prompt]:
        """The next n prompts, each from a file drawn by the weights."""
        rng = np.random.default_rng([self.seed % 2**63, len(self.samplers), self.draws])
        self.draws += 1
        files = rng.choice(len(self.samplers), size=n, p=self.probabilities)
        taken = [iter(s.next(int((files == i).sum()))) for i, s in enumerate(self.samplers)]
        return [next(taken[f]) for f in files]

    @property
    def epochs_drawn(self) -> float:
        """Prompts drawn so far over the files' usable prompts (`data/epoch`)."""
        return sum(s.drawn for s in self.samplers) / sum(len(s.items) for s in self.samplers)

    def state_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "probabilities": self.probabilities.tolist(),
            "files": [s.state_dict() for s in self.samplers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the files and their weights must be the saved ones."""
        saved = state.get("probabilities")
        if saved is None or not np.allclose(saved, self.probabilities) or len(state["files"]) != len(self.samplers):
            raise ValueError(
                f"WeightedSampler.load_state_dict: the train files' weights are {self.probabilities.tolist()} but "
                f"the checkpoint was saved with {saved}; resuming would not continue the same prompt order"
            )
        for sampler, file_state in zip(self.samplers, state["files"], strict=True):
            sampler.load_state_dict(file_state)
        self.draws = int(state["draws"])
