"""Continuous batching over a `transformers` causal LM: prefill newcomers, decode all running rows.

One `step()` admits waiting requests (prefilled together, identical prompts once), then runs one
decode forward over every running request. Finished requests leave at once and their KV rows are
reused, so a long response never holds back a short one. Routed experts are read from each
router's own top-k output during the same forwards.

`retract()` (SGLang's pause mode "retract") moves the running requests back to the front of the
queue, keeping their tokens and dropping their KV rows. Readmitted, a request is prefilled over its
prompt and the tokens it has so far, with the weights served then, and samples its next token from
that prefill, so every token's log-prob is the one a plain forward of the version that sampled it
gives. Each request records which version sampled which output tokens, as SGLang's
`meta_info.weight_versions` spans `[{version, start, end}]`.

A request with `max_new_tokens` 0 is a prefill only (SGLang's prompt scoring, which the teacher of
on-policy distillation asks for): its prompt log-probs from `logprob_start_len` (the first entry
None, as SGLang's), finish reason length 0, no token. Prompt log-probs are log_softmax of the logits at temperature 1, as SGLang's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from megatron_rl.rollout.local.kv_cache import SlotKVCache
from megatron_rl.rollout.local.lora import LocalAdapters
from megatron_rl.rollout.local.model import ModelInfo, router_of
from megatron_rl.rollout.local.recurrent_cache import SlotRecurrentCache
from megatron_rl.rollout.local.sampling import sample_tokens


@dataclass(eq=False)
class GenRequest:
    """One prompt being generated; the engine fills the fields below `row` as it runs."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    stop_strs: tuple[str, ...] = ()  # SGLang's stop strings, matched in the decoded tail of the output
    stop_str_max_len: int = 0  # the longest stop string's token count: the tail decoded is one token longer
    no_stop_trim: bool = False  # the response's text keeps the matched stop (its output_ids always do)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0  # a prefill only: the top log-probs of every scored prompt position
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    sampling_seed: int | None = None  # the request's own random stream (SGLang's sampling_seed)
    lora_name: str | None = None  # the adapter this request runs (SGLang's lora_path); None = the base
    row: int = -1
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[tuple[list[float], list[int]] | None] = field(default_factory=list)  # aligned with it
    routed: list[np.ndarray] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_versions: list[dict] = field(default_factory=list)
    retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    rng: torch.Generator | None = field(default=None, repr=False)

    @property
    def cached_len(self) -> int:
        """Tokens whose K/V are in the cache: the prompt and every output token but the last."""
        return len(self.input_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill runs on: the prompt, and the tokens generated before a retraction."""
        return self.input_ids + self.output_ids if self.output_ids else self.input_ids


class Generator:
    """Batched generation with a shared slot KV cache; not thread-safe (one engine thread drives it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        max_running: int = 256,
        max_prefill_tokens: int = 16384,
        seed: int = 0,
        tokenizer: Any = None,
    ):
        """`tokenizer`: what decodes the output's tail for stop strings (None: requests carry none)."""
        self.model, self.info, self.tokenizer = model, info, tokenizer
        self.adapters = LocalAdapters(model)  # LoRA adapters loaded through the LoRA endpoints
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        cache_args = (info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, info.device)
        self.cache = (
            SlotRecurrentCache(*cache_args, value_dim=info.value_dim, linear_layers=info.linear_layers,
                               conv_shape=info.conv_shape, state_shape=info.state_shape)
            if info.linear_layers
            else SlotKVCache(*cache_args, value_dim=info.value_dim, indexer_dim=info.indexer_dim)
        )  # fmt: skip
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.weight_version = "default"
        self.rng = torch.Generator(device=info.device)
        self.rng.manual_seed(seed)
        self._capture = False
        self._captured: list[torch.Tensor] = []
        self._hooks = [
            router_of(model.model.layers[i]).register_forward_hook(self._record_routing) for i in info.moe_layers
        ]
        self._min_value = torch.finfo(info.dtype).min

    # ---- queue ----
    def add(self, req: GenRequest) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, match, message: str = "Abort request") -> list[GenRequest]:
        """Finish every waiting or running request for which `match(req)` is true, keeping its output."""
        done = [r for r in self.waiting if match(r)]
        self.waiting = deque(r for r in self.waiting if not match(r))
        done_rows = [r for r in self.running if match(r)]
        for req in done + done_rows:
            req.finish_reason = {"type": "abort", "message": message}
        self._retire(done_rows)
        return done + done_rows

    def retract(self) -> int:
        """Send every running request back to the front of the queue with its tokens, freeing its KV
        row; returns how many. They resume, prefilled again, at the next `step()`."""
        retracted = sorted(self.running, key=lambda r: r.row)
        for req in retracted:
            req.row = -1
            req.retractions += 1
        self.running = []
        self.waiting.extendleft(reversed(retracted))
        self.cache.release()
        return len(retracted)

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    # ---- one scheduling step ----
    @torch.inference_mode()
    def step(self) -> list[GenRequest]:
        """Admit and prefill waiting requests, then decode one token for the running ones."""
        finished: list[GenRequest] = []
        newcomers = self._admit()
        if newcomers:
            finished += self._prefill(newcomers)
        if self.running:
            finished += self._decode()
        if not self.running and not self.waiting:
            self.cache.release()
        return finished

    def _admit(self) -> list[GenRequest]:
        batch: list[GenRequest] = []
        prompts: set[tuple[int, ...]] = set()
        longest, unique = 0, 0
        # adapters on the experts serve one adapter per forward: the next adapter's requests wait for a drained batch
        one_adapter = not self.adapters.mixes_adapters
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            req = self.waiting[0]
            if one_adapter and any(r.lora_name != req.lora_name for r in (*self.running[:1], *batch[:1])):
                break
            key = tuple(req.prefill_ids)
            new_unique = unique + (key not in prompts)
            new_longest = max(longest, len(key))
            if batch and new_unique * new_longest > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            batch.append(req)
            prompts.add(key)
            longest, unique = new_longest, new_unique
        return batch

    def _prefill(self, batch: list[GenRequest]) -> list[GenRequest]:
        seqs = [req.prefill_ids for req in batch]
        first_of: dict[tuple, int] = {}  # (adapter, *tokens) -> index into uniques
        uniques: list[int] = []  # index into batch of each distinct sequence's first request
        for i, seq in enumerate(seqs):
            key = (batch[i].lora_name, *seq)  # the same tokens under another adapter are another sequence
            if key not in first_of:
                first_of[key] = len(uniques)
                uniques.append(i)
        keys = [(req.lora_name, *seq) for req, seq in zip(batch, seqs, strict=True)]
        order = uniques + [i for i in range(len(batch)) if uniques[first_of[keys[i]]] != i]
        ordered = [batch[i] for i in order]
        ordered_seqs = [seqs[i] for i in order]
        base = len(self.running)
        for i, req in enumerate(ordered):
            req.row = base + i
        self.running.extend(ordered)

        dev = self.info.device
        n_unique = len(uniques)
        lengths = torch.tensor([len(seqs[i]) for i in uniques], device=dev)
        width = int(lengths.max())
        ids = torch.zeros(n_unique, width, dtype=torch.long, device=dev)
        for row, i in enumerate(uniques):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i], device=dev)
        self.cache.reserve(base + len(ordered), width)
        capture, lora_names = any(r.return_routed_experts for r in batch), [batch[i].lora_name for i in uniques]
        if self.info.linear_layers:  # a recurrent state must end at its own sequence's last token
            hidden = self._prefill_one_by_one(ids, lengths, base, capture, lora_names)
        else:
            pos = torch.arange(width, device=dev)
            allowed = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None, None])
            self.cache.begin_prefill(base, base + n_unique, width)
            mask = self._mask(allowed.unsqueeze(1), pos[:, None], pos[None, :])
            hidden = self._forward(ids, pos.expand(n_unique, width), mask, capture, lora_names)
        last_hidden = hidden[torch.arange(n_unique, device=dev), lengths - 1]
        logits = self._logits(last_hidden)
        src = [first_of[keys[i]] for i in order]
        for req, seq, s in zip(ordered[n_unique:], ordered_seqs[n_unique:], src[n_unique:], strict=True):
            self.cache.copy_row(base + s, req.row, len(seq))
        routing = self._take_routing(n_unique, width)
        for req, seq, s in zip(ordered, ordered_seqs, src, strict=True):
            resumed = bool(req.output_ids)
            if routing is not None and req.return_routed_experts:
                # a resumed request's positions were all recomputed: their routing replaces the old
                req.routed = [routing[s, : len(seq)]]
            if not resumed:
                if req.return_logprob and req.logprob_start_len >= 0:
                    req.input_logprobs, req.input_top = self._input_logprobs(req, hidden[s])
                req.weight_versions.append({"version": self.weight_version, "start": 0, "end": 0})
        # a prefill only (max_new_tokens 0, SGLang's prompt scoring) ends here, with no token
        scored = [req for req in ordered if req.max_new_tokens == 0]
        for req in scored:
            req.finish_reason = {"type": "length", "length": 0}
        sampled = [k for k, req in enumerate(ordered) if req.max_new_tokens > 0]
        index = torch.tensor([src[k] for k in sampled], device=dev, dtype=torch.long)
        self._retire(scored)
        if not sampled:
            return scored
        return scored + self._sample_and_finish([ordered[k] for k in sampled], logits.index_select(0, index))

    def _prefill_one_by_one(
        self, ids: torch.Tensor, lengths: torch.Tensor, base: int, capture: bool, lora_names: list[str | None]
    ) -> torch.Tensor:
        """`_forward`'s hidden states [rows, width, hidden] of right-padded `ids`, one row (cache row base + i) per
        forward, unpadded; the routing captured as one batched forward would have."""
        rows, width = ids.shape
        hidden = torch.zeros(rows, width, self.model.config.hidden_size, dtype=self.info.dtype, device=ids.device)
        routing: list[list[torch.Tensor]] = []
        for i, length in enumerate(lengths.tolist()):
            pos = torch.arange(length, device=ids.device)
            self.cache.begin_prefill(base + i, base + i + 1, length)
            mask = self._mask((pos[None, :] <= pos[:, None])[None, None], pos[:, None], pos[None, :])
            out = self._forward(ids[i : i + 1, :length], pos[None], mask, capture, lora_names[i : i + 1])
            hidden[i, :length] = out[0]
            routing.append([F.pad(r, (0, 0, 0, width - length)) for r in self._captured])
        self._captured = [torch.cat(layer) for layer in zip(*routing, strict=True)] if routing[0] else []
        return hidden

    def _decode(self) -> list[GenRequest]:
        rows = len(self.running)
        dev = self.info.device
        positions = torch.tensor([r.cached_len for r in self.running], device=dev)
        kv_len = int(positions.max()) + 1
        ids = torch.tensor([r.output_ids[-1] for r in self.running], device=dev).unsqueeze(1)
        keys = torch.arange(kv_len, device=dev)
        allowed = keys[None, :] <= positions[:, None]
        mask = self._mask(allowed[:, None, None, :], positions[:, None, None, None], keys)
        self.cache.begin_decode(rows, positions, kv_len)
        hidden = self._forward(
            ids,
            positions.unsqueeze(1),
            mask,
            any(r.return_routed_experts for r in self.running),
            [r.lora_name for r in self.running],
        )
        logits = self._logits(hidden[:, 0])
        routing = self._take_routing(rows, 1)
        if routing is not None:
            for i, req in enumerate(self.running):
                if req.return_routed_experts:
                    req.routed.append(routing[i])
        return self._sample_and_finish(list(self.running), logits)

    # ---- pieces ----
    def _mask(
        self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive mask of `allowed` ([rows, 1, queries, keys]); with sliding layers, the one per layer type
        transformers takes, the sliding layers' keeping the keys within the window of each query."""
        full = self._additive(allowed)
        window = self.info.sliding_window
        if self.info.indexer_dim:  # DeepSeek sparse attention's layers take theirs under this name
            return {"indexed_attention": full}
        if self.info.linear_layers:  # DeltaNet's: none (its rows are never padded: `_prefill_one_by_one`)
            return {"full_attention": full, "linear_attention": None}
        if window is None:
            return full
        return {"full_attention": full, "sliding_attention": self._additive(allowed & (key_pos > query_pos - window))}

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's logits of `hidden`, soft-capped where the model's are (Gemma)."""
        logits = self.model.lm_head(hidden)
        cap = self.info.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.info.dtype, device=self.info.device)
        return torch.where(allowed, zero, torch.full_like(zero, self._min_value))

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | dict[str, torch.Tensor],
        capture: bool,
        lora_names: list[str | None],
    ) -> torch.Tensor:
        self._capture, self._captured = capture and self.info.is_moe, []
        try:
            with self.adapters.rows(lora_names):
                out = self.model.model(
                    input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True
                )
        finally:
            self._capture = False
        return out.last_hidden_state

    def _record_routing(self, module, args, output) -> None:
        if self._capture:
            self._captured.append(output[2])  # the router's top-k expert indices, [tokens, top_k]

    def _take_routing(self, rows: int, width: int) -> np.ndarray | None:
        """Captured routing as int32 [rows, width, num_layers, top_k]; dense layers hold zeros."""
        if not self._captured:
            return None
        info = self.info
        stacked = torch.stack(self._captured, dim=1).to(torch.int32).cpu().numpy()  # [tokens, moe_layers, k]
        out = np.zeros((rows * width, info.num_layers, info.top_k), dtype=np.int32)
        out[:, list(info.moe_layers)] = stacked
        self._captured = []
        return out.reshape(rows, width, info.num_layers, info.top_k)

    def _input_logprobs(
        self, req: GenRequest, hidden: torch.Tensor
    ) -> tuple[list[float | None], list[tuple[list[float], list[int]] | None]]:
        """Entries for tokens `logprob_start_len`.., as SGLang 0.5.23's: the first always None (its context
        is not scored: "the first token logprob has no meaning in sglang"), then each token's log-prob; and,
        with `top_logprobs_num` k, each position's k largest log-probs and their token ids, in descending
        order (None first, as SGLang's `input_top_logprobs`; [] without k)."""
        start = min(req.logprob_start_len, len(req.input_ids))
        if start == len(req.input_ids):
            return [], []
        values: list[float | None] = [None]
        top: list[tuple[list[float], list[int]] | None] = [None] if req.top_logprobs_num else []
        first = start + 1
        if first < len(req.input_ids):
            logits = self._logits(hidden[first - 1 : len(req.input_ids) - 1]).float()
            lp = torch.log_softmax(logits, dim=-1)  # as SGLang 0.5.23: the prompt's, at temperature 1
            targets = torch.tensor(req.input_ids[first:], device=lp.device)
            values += lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            if req.top_logprobs_num:
                best = lp.topk(req.top_logprobs_num, dim=-1)
                top += list(zip(best.values.tolist(), best.indices.tolist(), strict=True))
        return values, top

    def _sample_and_finish(self, reqs: list[GenRequest], logits: torch.Tensor) -> list[GenRequest]:
        dev = logits.device
        temp = torch.tensor([r.temperature for r in reqs], device=dev, dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in reqs], device=dev, dtype=torch.float32)
        top_k = torch.tensor([r.top_k for r in reqs], device=dev, dtype=torch.long)
        generator: torch.Generator | list[torch.Generator] = self.rng
        if any(r.sampling_seed is not None for r in reqs):
            # seeded requests draw from their own streams: their tokens do not depend on the batch
            generator = [self._request_rng(r) for r in reqs]
        tokens, logprobs = sample_tokens(logits, temp, top_p, top_k, generator)
        finished = []
        for req, tok, lp in zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            span = req.weight_versions[-1]
            if span["version"] == self.weight_version:
                span["end"] = len(req.output_ids)
            else:
                n = len(req.output_ids)
                req.weight_versions.append({"version": self.weight_version, "start": n - 1, "end": n})
            matched_str = self._matched_stop_str(req)
            if matched_str is not None:
                req.finish_reason = {"type": "stop", "matched": matched_str}
            elif tok in req.stop_token_ids:
                req.finish_reason = {"type": "stop", "matched": tok}
            elif len(req.output_ids) >= req.max_new_tokens or req.cached_len + 1 >= self.info.max_positions:
                req.finish_reason = {"type": "length", "length": len(req.output_ids)}
            if req.finish_reason is not None:
                finished.append(req)
        self._retire(finished)
        return finished

    def _matched_stop_str(self, req: GenRequest) -> str | None:
        """The first of the request's stop strings in its last stop_str_max_len + 1 output tokens, decoded as
        SGLang's `Req.tail_str` does (special tokens kept). A stop string beats a stop token of the same step,
        and the output keeps every token up to the one that completed it, as SGLang's `output_ids` do."""
        if not req.stop_strs:
            return None
        tail = self.tokenizer.decode(req.output_ids[-(req.stop_str_max_len + 1) :])
        return next((s for s in req.stop_strs if s in tail), None)

    def _request_rng(self, req: GenRequest) -> torch.Generator:
        if req.sampling_seed is None:
            return self.rng
        if req.rng is None:
            req.rng = torch.Generator(device=self.info.device)
            req.rng.manual_seed(req.sampling_seed)
        return req.rng

    def _retire(self, done: list[GenRequest]) -> None:
        """Remove finished rows, moving the last live row into each freed slot."""
        for req in sorted(done, key=lambda r: r.row, reverse=True):
            last = self.running[-1]
            if last is not req:
                self.cache.copy_row(last.row, req.row, last.cached_len)
                self.running[req.row] = last
                last.row = req.row
            self.running.pop()
            req.row = -1
