"""Prompts per step: epochs in a seeded order, with a position that a checkpoint can save and restore."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:
    from megatron_rl.config import DataConfig

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Draws items epoch by epoch without replacement. Epoch e's order is a permutation seeded by
    (seed, e), so the whole state is (epoch, position) and resuming reproduces the same stream."""

    def __init__(self, items: Sequence[T], shuffle: bool = True, seed: int = 0) -> None:
        if len(items) == 0:
            raise ValueError("PromptSampler: the dataset is empty")
        self.items = items
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, items: Sequence[T], cfg: DataConfig) -> PromptSampler[T]:
        return cls(items, shuffle=cfg.shuffle, seed=cfg.seed)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed % 2**63, epoch]).permutation(len(self.items))

    def next_indices(self, n: int) -> list[int]:
        """The next n dataset indices, continuing into the next epoch(s) when this one runs out."""
        if n < 0:
            raise ValueError(f"PromptSampler.next_indices: n = {n} must be >= 0")
        out: list[int] = []
        while len(out) < n:
            if self.position == len(self.items):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self.items) - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def next(self, n: int) -> list[T]:
        """The next n items (prompts for one step or one generation round)."""
        return [self.items[i] for i in self.next_indices(n)]

    @property
    def drawn(self) -> int:
        """Items drawn so far, over every epoch."""
        return self.epoch * len(self.items) + self.position

    @property
    def epochs_drawn(self) -> float:
        """Passes over the items drawn so far (`data/epoch`): 1.5 = the first epoch and half of the second."""
        return self.drawn / len(self.items)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.items),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the dataset size, seed and shuffle flag must be the saved ones."""
        for key, setting, now in (
            ("num_items", "the number of usable prompts", len(self.items)),
            ("seed", "data.seed", self.seed),
            ("shuffle", "data.shuffle", self.shuffle),
        ):
            if state[key] != now:
                raise ValueError(
                    f"PromptSampler.load_state_dict: {setting} is {now!r} but the checkpoint was saved with "
                    f"{state[key]!r}; resuming would not continue the same prompt order"
                )
        position = int(state["position"])
        if not 0 <= position <= len(self.items):
            raise ValueError(f"PromptSampler.load_state_dict: position {position} outside [0, {len(self.items)}]")
        self.epoch = int(state["epoch"])
        self.position = position
        self._order = self._epoch_order(self.epoch)
