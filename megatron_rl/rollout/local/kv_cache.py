"""A slot-based KV cache shared by all running requests of the local engine.

Every layer owns key and value buffers of shape [slots, kv_heads, capacity, head_dim] (values of
`value_dim` when it differs: MLA caches its latent as the "key" and the rotary key as the "value"). A running
request owns one row (slot); rows 0..n-1 are always the live ones (a finished request's row is
refilled by moving the last row into it), so a decode step reads plain views of the buffers.
Before each forward the engine says which rows it runs and where each new token's K/V goes; the
attention modules of the `transformers` model call `update`, which writes there and returns the
rows' keys and values up to the longest sequence. Unused positions are hidden by the 4D mask the
engine passes with the same forward. DeepSeek sparse attention's indexers (DeepSeek-V3.2, GLM-5) keep one more key
per token and layer, of `indexer_dim` channels, through `update_indexer`, stored as the keys are.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Per-row KV storage that `transformers` attention layers use as their `cache`."""

    is_compileable = False

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: int | None = None,
        indexer_dim: int = 0,
    ):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.value_dim = value_dim or head_dim
        self.indexer_dim = indexer_dim
        self.dtype, self.device = dtype, device
        self.slots, self.capacity = 0, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.index_keys: list[torch.Tensor] = []  # [slots, 1, capacity, indexer_dim] per layer, when indexer_dim
        self._rows = slice(0, 0)
        self._write_pos: torch.Tensor | None = None  # [rows] start position of each row's new tokens
        self._contiguous_from_zero = False
        self._kv_len = 0

    def reserve(self, slots: int, capacity: int) -> None:
        """Grow the buffers (keeping their contents) to at least `slots` rows and `capacity` positions."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = max(slots, self.slots, 1)
        new_cap = max(capacity, self.capacity, 16)
        if new_slots > self.slots and self.slots:
            new_slots = max(new_slots, self.slots * 2)
        if new_cap > self.capacity and self.capacity:
            new_cap = max(new_cap, self.capacity * 2)
        for store, width in self._stores():
            shape = (new_slots, self.kv_heads, new_cap, width)
            for i in range(self.num_layers):
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    fresh[: self.slots, :, : self.capacity] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self.slots, self.capacity = new_slots, new_cap

    def _stores(self) -> list[tuple[list[torch.Tensor], int]]:
        stores = [(self.keys, self.head_dim), (self.values, self.value_dim)]
        return stores + [(self.index_keys, self.indexer_dim)] if self.indexer_dim else stores

    def begin_prefill(self, row_start: int, row_end: int, length: int) -> None:
        """The next forward writes positions 0..length-1 of rows [row_start, row_end)."""
        self.reserve(row_end, length)
        self._rows = slice(row_start, row_end)
        self._contiguous_from_zero = True
        self._kv_len = length

    def begin_decode(self, rows: int, positions: torch.Tensor, kv_len: int) -> None:
        """The next forward writes one token per row 0..rows-1 at `positions` ([rows], long)."""
        self.reserve(rows, kv_len)
        self._rows = slice(0, rows)
        self._contiguous_from_zero = False
        self._write_pos = positions
        self._kv_len = kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new keys/values ([rows, kv_heads, q, head_dim]); return the rows' full keys/values.
        (`store=`: the indexer's keys, written as both.)"""
        store = kwargs.get("store")
        keys, values = (store[layer_idx],) * 2 if store is not None else (self.keys[layer_idx], self.values[layer_idx])
        rows = self._rows
        if self._contiguous_from_zero:
            q = key_states.shape[2]
            keys[rows, :, :q] = key_states
            values[rows, :, :q] = value_states
        else:
            index = torch.arange(rows.start, rows.stop, device=self.device)
            keys[index, :, self._write_pos] = key_states[:, :, 0]
            values[index, :, self._write_pos] = value_states[:, :, 0]
        return keys[rows, :, : self._kv_len], values[rows, :, : self._kv_len]

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store the indexer's new keys ([rows, q, indexer_dim]); return the rows' full keys [rows, kv, dim]."""
        stored, _ = self.update(key_states[:, None], key_states[:, None], layer_idx, store=self.index_keys)
        return stored[:, 0]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of row `src` into row `dst` (shared prompts, compaction)."""
        if src == dst:
            return
        for store, _ in self._stores():
            for buf in store:
                buf[dst, :, :length] = buf[src, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def release(self) -> None:
        """Drop the buffers (idle engine, or memory released)."""
        self.keys, self.values, self.index_keys = [], [], []
        self.slots, self.capacity = 0, 0
