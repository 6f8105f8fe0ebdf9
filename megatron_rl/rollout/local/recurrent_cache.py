"""The local engine's cache for Qwen3-Next and Qwen3.5: the slot KV cache of the full-attention layers, and for each
Gated DeltaNet layer a recurrent state and a convolution window per sequence, in the same rows.

A DeltaNet layer has no keys to keep: what a sequence's next token needs is the state after its last token
([value heads, key width, value width], fp32, as transformers' delta rule returns it) and the last `kernel` inputs of
its causal convolution. transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5MoeGatedDeltaNet` ask their cache for both
(`get_recurrent_state`, `get_conv_state`: none in a prefill, which starts from zero) and hand back the new ones
(`update_recurrent_state`, `update_conv_state`; a decode step's convolution window is updated in place, through the
view this cache returns). A prefill must end the state at each sequence's own last token, so the engine prefills a
recurrent model one sequence at a time (`Generator`); decode steps run every row at once. Rows are copied and
compacted with the KV rows (`copy_row`); no past is recorded (no speculative rollback).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.rollout.local.kv_cache import SlotKVCache


class SlotRecurrentCache(SlotKVCache):
    """`SlotKVCache` plus DeltaNet's per-row recurrent and convolution states of `linear_layers`."""

    def __init__(
        self,
        *args: Any,
        linear_layers: tuple[int, ...],
        conv_shape: tuple[int, int],
        state_shape: tuple[int, int, int],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.linear_layers = linear_layers
        self.conv_shape, self.state_shape = conv_shape, state_shape  # [channels, kernel], [heads, key, value]
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        self._prefilling = False

    def reserve(self, slots: int, capacity: int) -> None:
        super().reserve(slots, capacity)
        for layer in self.linear_layers:
            for store, shape, dtype in ((self.conv, self.conv_shape, self.dtype), (self.state, self.state_shape, None)):
                old = store.get(layer)
                if old is not None and old.shape[0] == self.slots:
                    continue
                fresh = torch.zeros((self.slots, *shape), dtype=dtype or torch.float32, device=self.device)
                if old is not None:
                    fresh[: old.shape[0]] = old
                store[layer] = fresh

    def begin_prefill(self, row_start: int, row_end: int, length: int) -> None:
        super().begin_prefill(row_start, row_end, length)
        self._prefilling = True

    def begin_decode(self, rows: int, positions: torch.Tensor, kv_len: int) -> None:
        super().begin_decode(rows, positions, kv_len)
        self._prefilling = False

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' states before this forward (None in a prefill: zero)."""
        return None if self._prefilling else self.state[layer_idx][self._rows]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' last convolution inputs, a view transformers' decode step updates in place (None in a prefill)."""
        return None if self._prefilling else self.conv[layer_idx][self._rows]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        """Keep the prefill's last `kernel` inputs ([rows, channels, tokens], zeros before the first); return the
        inputs as they are (the convolution pads them itself)."""
        kernel = self.conv_shape[1]
        tail = conv_states[..., -kernel:]
        window = self.conv[layer_idx][self._rows]
        window.zero_()
        window[..., kernel - tail.shape[-1] :] = tail
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, **kwargs: Any) -> torch.Tensor:
        self.state[layer_idx][self._rows] = recurrent_states
        return recurrent_states

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers counts tokens for its own cache; positions here come from the engine."""

    def copy_row(self, src: int, dst: int, length: int) -> None:
        super().copy_row(src, dst, length)
        if src != dst:
            for store in (self.conv, self.state):
                for buf in store.values():
                    buf[dst] = buf[src]

    def release(self) -> None:
        super().release()
        self.conv, self.state = {}, {}
