"""The local SGLang-compatible engine's HTTP front (`megatron-rl serve`: `serve.py`): its app, its
key and body checks, /generate and the control endpoints.

Speaks the subset of SGLang's server API that an RL trainer uses, with SGLang's field names and
response shapes: /generate (input_ids, sampling params, log-probs, routed experts), /pause_generation,
/continue_generation, /abort_request, /flush_cache, /release_memory_occupation,
/resume_memory_occupation, /health, /model_info and /server_info here; the weight updates and their
groups and session (`updates.py`: one at a time in arrival order, as SGLang takes them) and the LoRA
adapters (`lora_endpoints.py`).

Keys as SGLang checks them (`auth.py`): the API key (`--api-key` or $MEGATRON_RL_ENGINE_API_KEY, or
`--no-auth`) on every endpoint but /health*, the admin key (`--admin-api-key` or
$MEGATRON_RL_ENGINE_ADMIN_API_KEY), when given, instead of it on the control endpoints. Request bodies
are bounded per endpoint by what it can carry (`body_limits`, HTTP 413 beyond; /generate also by its
number of prompts), must arrive within `--read-timeout-s` (HTTP 408), and are parsed as strict JSON
(`megatron_rl.http.body`: NaN/Infinity, integers over 4300 digits, lone surrogates and deep nesting
answer 400 naming the field).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import numpy as np
import torch
from aiohttp import web

from megatron_rl.http.body import READ_TIMEOUT_S, BodyError, read_body
from megatron_rl.http.server import application, key_check
from megatron_rl.rollout.local import auth
from megatron_rl.rollout.local.engine_thread import PAUSE_MODES, EngineStateError, EngineThread
from megatron_rl.rollout.local.generator import GenRequest
from megatron_rl.rollout.local.lora import AdapterError
from megatron_rl.rollout.local.lora_endpoints import LoraEndpoints
from megatron_rl.rollout.local.model import ModelInfo
from megatron_rl.rollout.local.protocol import RAW_BODY, FieldError, check_body, get_field, json_body, parse_generate
from megatron_rl.rollout.local.updates import WeightUpdates, on_engine
from megatron_rl.rollout.types import MEMORY_TAGS

log = logging.getLogger("megatron_rl.serve")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


# What /generate may carry per prompt: 16 bytes per position (a token id and its separator, or a few
# characters of text) plus the request's other fields (sampling parameters, rid, stop ids).
GENERATE_BYTES_PER_POSITION = 16
GENERATE_BYTES_PER_PROMPT = 64 << 10
# A weight update announces every tensor (name, dtype, shape, offsets: a few hundred bytes each, never
# the data itself: the tensor payload carries handles, the distributed one only metadata).
UPDATE_BYTES_PER_TENSOR = 1 << 10
CONTROL_BODY_BYTES = 1 << 20  # every other endpoint: a few fields (and /update_weights_from_disk a path)
_WEIGHT_PATHS = ("/update_weights_from_tensor", "/update_weights_from_distributed")


def body_limits(info: ModelInfo, max_running: int, checkpoint_tensors: int) -> dict[str, int]:
    """The largest body of each endpoint in bytes: /generate a batch of `max_running` prompts of the
    model's positions, the weight updates an announcement of every checkpoint tensor; the others
    `CONTROL_BODY_BYTES`."""
    prompt = info.max_positions * GENERATE_BYTES_PER_POSITION + GENERATE_BYTES_PER_PROMPT
    weights = CONTROL_BODY_BYTES + checkpoint_tensors * UPDATE_BYTES_PER_TENSOR
    return {"/generate": max_running * prompt, **dict.fromkeys(_WEIGHT_PATHS, weights)}


class LocalServer:
    """The HTTP front of an `EngineThread`."""

    def __init__(
        self,
        engine: EngineThread,
        info: ModelInfo,
        api_key: str | None,
        tokenizer: Any = None,
        admin_api_key: str | None = None,
    ):
        self.engine, self.info, self.api_key, self.tokenizer = engine, info, api_key, tokenizer
        self.admin_api_key = admin_api_key
        # /generate requests being answered, and their end: SGLang's begin waits for them (its writer lock)
        self._generating = 0
        self._generation_ended = asyncio.Condition()
        self.updates = WeightUpdates(engine, info, self._generations_ended)
        self.adapters = LoraEndpoints(engine, self.updates.queue)
        self.read_timeout_s = READ_TIMEOUT_S
        self.body_limits = body_limits(info, engine.generator.max_running, len(engine.layout.targets))

    async def _generations_ended(self) -> None:
        async with self._generation_ended:
            await self._generation_ended.wait_for(lambda: self._generating == 0)

    def app(self) -> web.Application:
        # the body middleware enforces each endpoint's limit; aiohttp's own cap is never reached first
        biggest = max(CONTROL_BODY_BYTES, *self.body_limits.values())
        checked = key_check(self._allowed, lambda: web.json_response({"error": "Unauthorized"}, status=401))
        app = application(biggest, [checked, self._errors, self._body])
        post, get_post = ["POST", "PUT"], ["GET", "POST"]
        routes = [
            ("/generate", post, self.generate),
            ("/abort_request", ["POST"], self.abort_request),
            ("/pause_generation", ["POST"], self.pause_generation),
            ("/continue_generation", ["POST"], self.continue_generation),
            ("/flush_cache", get_post, self.flush_cache),
            ("/release_memory_occupation", get_post, self.release_memory),
            ("/resume_memory_occupation", get_post, self.resume_memory),
            ("/health", ["GET"], self.health),
            ("/health_generate", ["GET"], self.health_generate),
            ("/get_model_info", ["GET"], self.model_info),
            ("/model_info", ["GET"], self.model_info),
            ("/get_server_info", ["GET"], self.server_info),
            ("/server_info", ["GET"], self.server_info),
            *self.updates.routes(),
            *self.adapters.routes(),
        ]
        for path, methods, handler in routes:
            for method in methods:
                app.router.add_route(method, path, handler)
        return app

    # ---- middlewares ----
    def _allowed(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization")
        return auth.allowed(request.method, request.path, header, self.api_key, self.admin_api_key)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except (FieldError, EngineStateError) as err:
            return _error(400, str(err))
        except BodyError as err:
            return _error(err.status, str(err))

    @web.middleware
    async def _body(self, request: web.Request, handler):
        """Reads the body within the endpoint's limit (after the key is checked: an unauthenticated
        client's body is never read)."""
        limit = self.body_limits.get(request.path, CONTROL_BODY_BYTES)
        request[RAW_BODY] = await read_body(request, limit, timeout_s=self.read_timeout_s)
        return await handler(request)

    # ---- generation ----
    async def generate(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        batch = parse_generate(await json_body(request), self.info, self.tokenizer, self.engine.generator.max_running)
        try:
            for req in batch.requests:
                self.engine.generator.adapters.check(req.lora_name)
        except AdapterError as err:
            raise FieldError(str(err)) from None
        futures = [asyncio.wrap_future(f) for f in self.engine.submit(batch.requests)]
        self._generating += 1
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: stop generating for it
            ids = {r.rid for r in batch.requests}
            self.engine.call(lambda e: e.abort(lambda r: r.rid in ids, "client disconnected"))
            raise
        finally:
            self._generating -= 1
            async with self._generation_ended:
                self._generation_ended.notify_all()
        latency = time.monotonic() - started
        items = [self._generate_item(r, latency, batch.return_text_in_logprobs) for r in done]
        return web.json_response(items if batch.is_batch else items[0])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _generate_item(self, req: GenRequest, latency: float, text_in_logprobs: bool) -> dict:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            # SGLang's spans: which version sampled output tokens [start, end); one empty span before any
            "weight_versions": req.weight_versions or [{"version": self.engine.weight_version, "start": 0, "end": 0}],
            "num_retractions": req.retractions,
            "e2e_latency": latency,
        }
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
        if req.return_logprob:

            def text(tok: int) -> str | None:
                return self._decode([tok]) if text_in_logprobs and self.tokenizer is not None else None

            meta["output_token_logprobs"] = [
                [lp, tok, text(tok)] for lp, tok in zip(req.output_logprobs, req.output_ids, strict=True)
            ]
            start = len(req.input_ids) - len(req.input_logprobs)
            meta["input_token_logprobs"] = [
                [lp, tok, text(tok)] for lp, tok in zip(req.input_logprobs, req.input_ids[start:], strict=True)
            ]
            if req.top_logprobs_num:  # SGLang's nested form: per position None or [[logprob, id, text], ...]
                meta["input_top_logprobs"] = [
                    None if e is None else [[lp, tok, text(tok)] for lp, tok in zip(*e, strict=True)]
                    for e in req.input_top
                ]
                meta["output_top_logprobs"] = []
        if req.return_routed_experts and req.routed:
            routed = np.ascontiguousarray(np.concatenate(req.routed)[req.routed_experts_start_len :], dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode("ascii")
        return {"text": self._text(req), "output_ids": req.output_ids, "meta_info": meta}

    def _text(self, req: GenRequest) -> str:
        """The output's text trimmed of its matched stop as SGLang's detokenizer trims it (unless no_stop_trim):
        a stop token is left out, and the text ends before a stop string; `output_ids` keep both."""
        matched = (req.finish_reason or {}).get("matched")
        if isinstance(matched, int) and not req.no_stop_trim:
            return self._decode(req.output_ids[:-1])
        text = self._decode(req.output_ids)
        if isinstance(matched, str) and (pos := text.find(matched)) != -1:
            return text[: pos + len(matched)] if req.no_stop_trim else text[:pos]
        return text

    async def _engine(self, fn) -> Any:
        return await on_engine(self.engine, fn)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        rid = get_field(body, "rid", "str", "")
        abort_all = get_field(body, "abort_all", "bool", False)
        if abort_all:
            n = await self._engine(lambda e: e.abort(lambda r: True))
        else:
            n = await self._engine(lambda e: e.abort(lambda r: bool(rid) and r.rid.startswith(rid)))
        log.info("aborted %d request(s) (rid=%r, abort_all=%s)", n, rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        mode = get_field(body, "mode", "str", "abort")
        if mode not in PAUSE_MODES:
            raise FieldError(f"mode: {mode!r}; allowed: {', '.join(PAUSE_MODES)}")
        n = await self._engine(lambda e: e.pause(mode))
        log.info("generation paused (mode %s, %d request(s) %s)", mode, n, "aborted" if mode == "abort" else "kept")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        check_body(await json_body(request))
        await self._engine(lambda e: e.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        def flush(e: EngineThread) -> bool:
            # as SGLang: requests retracted by a pause wait without a cache; running ones hold one
            return not e.generator.running and (e.paused or not e.generator.waiting)

        if not await self._engine(flush):
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
        return web.Response(text="Cache flushed.\n")

    # ---- memory ----
    async def _tags(self, request: web.Request) -> list[str]:
        body = check_body(await json_body(request))
        tags = get_field(body, "tags", "str_list", list(MEMORY_TAGS))
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise FieldError(f"tags: unknown {bad}; allowed: {list(MEMORY_TAGS)}")
        return tags

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)

        def release(e: EngineThread) -> None:
            if e.generator.has_work:
                raise EngineStateError("release_memory_occupation: requests are running; pause or abort them first")
            if "weights" in tags and "weights" not in e.released and e.info.device.type == "cuda":
                e.model.to("cpu")
            if "kv_cache" in tags:
                e.generator.cache.release()
            e.released |= set(tags)
            if e.info.device.type == "cuda":
                torch.cuda.empty_cache()

        await self._engine(release)
        log.info("released memory: %s", tags)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)

        def resume(e: EngineThread) -> None:
            if "weights" in tags and "weights" in e.released and e.info.device.type == "cuda":
                e.model.to(e.info.device)
                e.layout = type(e.layout)(e.model, e.info.family)
            e.released -= set(tags)

        await self._engine(resume)
        log.info("resumed memory: %s", tags)
        return web.json_response(None)

    # ---- info ----
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_alive() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        probe = GenRequest(rid=f"HEALTH_CHECK_{time.monotonic_ns()}", input_ids=[0], max_new_tokens=1, temperature=0.0)
        try:
            (fut,) = self.engine.submit([probe])
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout=20)
        except (asyncio.TimeoutError, EngineStateError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        info = self.info
        return web.json_response(
            {
                "model_path": info.path,
                "tokenizer_path": info.path,
                "served_model_name": info.path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                # Not in SGLang's reply: what a client needs to decode routed experts.
                "model_type": info.family,
                "num_hidden_layers": info.num_layers,
                "num_experts": info.num_experts,
                "num_experts_per_tok": info.top_k,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        gen = self.engine.generator
        return web.json_response(
            {
                "model_path": self.info.path,
                "device": str(self.info.device),
                "dtype": str(self.info.dtype).removeprefix("torch."),
                "max_running_requests": gen.max_running,
                "max_prefill_tokens": gen.max_prefill_tokens,
                "weight_version": self.engine.weight_version,
                "internal_states": [
                    {"running": len(gen.running), "waiting": len(gen.waiting), "paused": self.engine.paused}
                ],
                "version": "megatron-rl-local",
                # Not in SGLang's reply: the request body limits (413 beyond), by endpoint.
                "max_body_bytes": {**self.body_limits, "other": CONTROL_BODY_BYTES},
            }
        )
