"""The generation client of SGLang servers, an sglang-router, or the local engine (same HTTP API),
and `SGLangClient`, which holds it with the weights client (`sglang_weights.py`) over one transport
(`sglang_transport.py`: the servers, bounded concurrency, retries moving across servers, keys,
router discovery, health and info).

- `/generate` with `input_ids` and explicit sampling parameters; log-probs of the output tokens,
  routed experts (base64 int32 [prompt + output - 1, layers, top_k]), the finish reason and the
  weight version of every output token (SGLang's `meta_info.weight_versions` spans, checked to
  cover the output exactly) come back as a `Sample`. Every attempt waits for `weights_current`.
- `token_versions_required` (partial rollouts, set by `sglang_versions.require_versions`): a reply
  without `meta_info.weight_versions` is an error instead of every token taking the reply's one version.
- The abort of a request that timed out goes where it runs; through a router, to every worker (the
  router answers /abort_request with 404).
- Control endpoints (pause, continue, abort, flush, memory) go to every server.
- `prompt_logprobs` / `prompt_scores`: the log-probs of given tokens (and the top-k at each position,
  `top_logprobs_num`), a prefill only (`max_new_tokens` 0, `logprob_start_len`): the teacher's answer in
  on-policy distillation.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_rl.rollout.sglang_errors import BadRequestError, EngineDiedError, SGLangError, UnauthorizedError
from megatron_rl.rollout.sglang_transport import ADMIN_PATHS, SGLangTransport
from megatron_rl.rollout.sglang_weights import WeightUpdates
from megatron_rl.rollout.types import PromptScores, Sample, SamplingParams

log = logging.getLogger(__name__)

# what other modules import from here
__all__ = [
    "ADMIN_PATHS",
    "TOKEN_VERSIONS_SINCE",
    "BadRequestError",
    "EngineDiedError",
    "GenerationClient",
    "SGLangClient",
    "SGLangError",
    "UnauthorizedError",
    "dotted",
    "token_versions",
]

TOKEN_VERSIONS_SINCE = (0, 5, 19)  # SGLang's meta_info.weight_versions: the version of every output token


def token_versions(spans: Any, version: str | None, n_tokens: int, where: str, url: str) -> list[str] | None:
    """One weight version per output token from SGLang's `meta_info.weight_versions` spans
    `[{version, start, end}]`, which must cover tokens [0, n_tokens) in order without a gap or an
    overlap; without spans, `version` (the reply's `weight_version`) for every token (None when the
    server reports neither)."""
    if spans is None:
        return None if version is None else [version] * n_tokens
    try:
        bounds = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    except (KeyError, TypeError, ValueError):
        bounds = []
    end = 0
    for _, start, stop in bounds:
        if start != end or stop < start:
            break
        end = stop
    else:
        if bounds and end == n_tokens:
            if len(bounds) == 1:  # the usual reply: one version for the whole response
                return [bounds[0][0]] * n_tokens
            return [v for v, start, stop in bounds for _ in range(stop - start)]
    raise SGLangError(
        f"{where}: meta_info.weight_versions {str(spans)[:500]} do not cover the {n_tokens} output "
        "tokens exactly (contiguous {version, start, end} spans from 0 to the last token)",
        server=url,
    )


def dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


class GenerationClient(SGLangTransport):
    """/generate and the control calls to every server; create and close it inside one event loop."""

    def __init__(
        self, urls: Sequence[str], *, routed_experts_layout: tuple[int, int] | None = None, **options: Any
    ) -> None:
        """`options`: the transport's (`SGLangTransport`: key, concurrency, timeouts, retries, admin key)."""
        super().__init__(urls, **options)
        self.routed_experts_layout = routed_experts_layout
        self.lora_path: str | None = None  # the adapter every /generate names (LoRA runs: the current policy)
        self.server_versions: dict[str, str] = {}  # what each server reports (`sglang_versions`)
        self.token_versions_required = False  # a reply without meta_info.weight_versions is an error

    # ---- generation ----
    def generate_body(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        rid: str,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> dict[str, Any]:
        """The /generate body for one prompt (explicit sampling parameters, output log-probs)."""
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": params.to_sglang(),
            "return_logprob": return_logprob,
            "logprob_start_len": -1,
            "stream": False,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        return body

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rid: str | None = None,
    ) -> Sample:
        """Generate one response for one prompt."""
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        rid = rid or uuid.uuid4().hex
        body = self.generate_body(input_ids, params, rid, return_logprob, return_routed_experts)
        await self.start()
        assert self._slots is not None
        async with self._slots:
            try:
                url, _, text = await self._call(
                    "POST", "/generate", body, what=f"rid={rid}", direct=return_routed_experts, gated=True
                )
            except SGLangError as err:
                if "timed out" in str(err) and err.server:
                    await self._quiet_abort(err.server, rid)
                raise
        return self._sample(url, rid, list(input_ids), text, return_logprob, return_routed_experts)

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        done: dict[int, Sample] | None = None,
    ) -> list[Sample]:
        """One response per prompt, in prompt order; requests run concurrently within the bound.
        `params`: shared, or one per prompt. `done` receives each sample by prompt index as soon as
        it is complete, so that after a failure only the unfinished requests need to be sent again."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"generate_batch: {len(per_prompt)} sampling params for {len(prompts)} prompts")

        async def one(index: int, prompt: Sequence[int], sp: SamplingParams) -> Sample:
            sample = await self.generate(prompt, sp, return_logprob, return_routed_experts)
            if done is not None:
                done[index] = sample
            return sample

        tasks = [
            asyncio.ensure_future(one(i, p, sp)) for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True))
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def prompt_logprobs(self, input_ids: Sequence[int], start: int, rid: str | None = None) -> list[float]:
        """The server's log-prob of each token of `input_ids[start:]` given the tokens before it (0 < start <
        len): `prompt_scores` without the top-k."""
        return (await self.prompt_scores(input_ids, start, rid=rid)).logprobs

    async def prompt_scores(
        self, input_ids: Sequence[int], start: int, top_k: int = 0, rid: str | None = None
    ) -> PromptScores:
        """The server's log-prob of each token of `input_ids[start:]` given the tokens before it (0 < start <
        len), and with `top_k` > 0 the k most likely tokens at each of those positions: a prefill only
        (/generate with `max_new_tokens` 0, `return_logprob`, `logprob_start_len`, `top_logprobs_num`), at
        temperature 1, retried as a generation is. What the teacher of on-policy distillation answers
        (`megatron_rl.rollout.teacher`)."""
        if not 0 < start < len(input_ids):
            raise ValueError(f"prompt_logprobs: start {start} is not inside the {len(input_ids)} tokens")
        rid = rid or uuid.uuid4().hex
        params = SamplingParams(temperature=1.0, max_new_tokens=1)
        body = self.generate_body(input_ids, params, rid)
        body["sampling_params"]["max_new_tokens"] = 0
        body["logprob_start_len"] = start - 1  # SGLang's first entry is None: one token before `start`
        if top_k:
            body["top_logprobs_num"] = top_k
        await self.start()
        assert self._slots is not None
        async with self._slots:
            url, _, text = await self._call("POST", "/generate", body, what=f"rid={rid}")
        where = f"/generate (prompt log-probs) rid={rid} on {url}"
        try:
            meta = json.loads(text)["meta_info"]
            entries = meta["input_token_logprobs"]
            values = [(None if e[0] is None else float(e[0]), int(e[1])) for e in entries]
            tops = [
                None if e is None else [(float(v[0]), int(v[1])) for v in e]
                for e in (meta["input_top_logprobs"] if top_k else [])
            ]
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise SGLangError(f"{where}: malformed reply ({err}): {text[:200]!r}", server=url) from None
        expected = [int(t) for t in input_ids[start - 1 :]]
        if [t for _, t in values] != expected or any(lp is None for lp, _ in values[1:]):
            raise SGLangError(
                f"{where}: {len(values)} input log-probs do not follow tokens {start - 1}..{len(input_ids) - 1} "
                f"({len(expected)} of them, the first unscored)",
                server=url,
            )
        if top_k and (len(tops) != len(values) or any(e is None or len(e) != top_k for e in tops[1:])):
            raise SGLangError(
                f"{where}: {len(tops)} input top log-probs for {len(values)} positions, not {top_k} at each but "
                "the first",
                server=url,
            )
        return PromptScores(
            [lp for lp, _ in values[1:]],  # type: ignore[misc]
            [[t for _, t in e] for e in tops[1:]],  # type: ignore[union-attr]
            [[lp for lp, _ in e] for e in tops[1:]],  # type: ignore[union-attr]
        )

    async def _quiet_abort(self, url: str, rid: str) -> None:
        """Abort `rid` where it runs: on `url`, or on every worker when `url` is the router."""

        async def one(server: str) -> None:
            try:
                await self._call("POST", "/abort_request", {"rid": rid}, server=server, retry=False, timeout_s=10)
            except SGLangError as err:
                log.warning("could not abort %s on %s: %s", rid, server, err)

        await asyncio.gather(*(one(u) for u in (self.urls if url == self.router else [url])))

    def _sample(self, url: str, rid: str, prompt: list[int], text: str, want_lp: bool, want_routed: bool) -> Sample:
        where = f"/generate rid={rid} on {url}"
        try:
            reply = json.loads(text)
            meta = reply["meta_info"]
            output_ids = [int(t) for t in reply["output_ids"]]
        except (ValueError, KeyError, TypeError) as err:
            raise SGLangError(f"{where}: malformed reply ({err}): {text[:200]!r}", server=url) from None
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind not in ("stop", "length", "abort"):
            raise SGLangError(f"{where}: unexpected finish_reason {finish!r}", server=url)
        logprobs = None
        if want_lp:
            entries = meta.get("output_token_logprobs")
            if entries is None or len(entries) != len(output_ids):
                n = None if entries is None else len(entries)
                raise SGLangError(f"{where}: {n} output log-probs for {len(output_ids)} output tokens", server=url)
            if any(int(e[1]) != t for e, t in zip(entries, output_ids, strict=True)):
                raise SGLangError(f"{where}: output log-probs do not follow output_ids", server=url)
            logprobs = [float(e[0]) for e in entries]
        routed = None
        if want_routed and meta.get("routed_experts") is not None:
            routed = self._decode_routed(meta["routed_experts"], len(prompt) + len(output_ids) - 1, where, url)
        version = meta.get("weight_version")
        version = None if version is None else str(version)
        if self.token_versions_required and meta.get("weight_versions") is None:
            runs = ", ".join(f"{u}: {v}" for u, v in self.server_versions.items()) or "unknown versions"
            raise SGLangError(
                f"{where}: no meta_info.weight_versions in the reply, and rollout.partial_rollout = true needs "
                f"the weight version of every token (SGLang >= {dotted(TOKEN_VERSIONS_SINCE)}; the servers "
                f"report {runs}); upgrade them or set rollout.partial_rollout=false",
                server=url,
            )
        return Sample(
            prompt_ids=prompt,
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=kind,
            matched_stop=finish.get("matched"),
            routed_experts=routed,
            weight_version=version,
            weight_versions=token_versions(meta.get("weight_versions"), version, len(output_ids), where, url),
            rid=rid,
            server=url,
            meta_info=meta,
        )

    def _decode_routed(self, encoded: str, tokens: int, where: str, url: str) -> np.ndarray:
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        if self.routed_experts_layout is None:
            raise SGLangError(
                f"{where}: cannot shape routed experts: call load_model_layout() or pass "
                "routed_experts_layout=(num_hidden_layers, num_experts_per_tok)",
                server=url,
            )
        layers, top_k = self.routed_experts_layout
        if flat.size != tokens * layers * top_k:
            raise SGLangError(
                f"{where}: routed experts hold {flat.size} ids, expected {tokens} tokens x {layers} layers x {top_k}",
                server=url,
            )
        return flat.reshape(tokens, layers, top_k)

    async def load_model_layout(self) -> tuple[int, int] | None:
        """Read (num_hidden_layers, num_experts_per_tok) from /model_info when the server reports it."""
        info = await self.get_model_info()
        if "num_hidden_layers" in info and info.get("num_experts_per_tok"):
            self.routed_experts_layout = (int(info["num_hidden_layers"]), int(info["num_experts_per_tok"]))
        return self.routed_experts_layout

    # ---- control (every server) ----
    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._each("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode {mode!r}: allowed abort, retract, in_place")
        await self._each("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._each("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        for url in self.urls:
            await self._call("POST", "/flush_cache", None, server=url)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._each("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._each("POST", "/resume_memory_occupation", {"tags": tags})


class SGLangClient(GenerationClient, WeightUpdates):
    """The generation and the weights client over one transport: what the engine handle holds."""
