"""`megatron-rl serve`: the local SGLang-compatible engine over HTTP.

Speaks the subset of SGLang's server API that an RL trainer uses, with SGLang's field names and
response shapes: /generate (input_ids, sampling params, log-probs, routed experts), the weight
updates and their groups and session (`updates.py`: one at a time in arrival order, as SGLang takes
them), the LoRA adapters, /pause_generation, /continue_generation, /abort_request, /flush_cache,
/release_memory_occupation, /resume_memory_occupation, /health, /get_model_info.

Keys as SGLang checks them (`auth.py`): the API key (`--api-key` or $MEGATRON_RL_ENGINE_API_KEY, or
`--no-auth`) on every endpoint but /health*, the admin key (`--admin-api-key` or
$MEGATRON_RL_ENGINE_ADMIN_API_KEY), when given, instead of it on the control endpoints. Request bodies
are bounded per endpoint by what it can carry (`body_limits`, HTTP 413 beyond; /generate also by its
number of prompts), must arrive within `--read-timeout-s` (HTTP 408), and are parsed as strict JSON
(`megatron_rl.http_body`: NaN/Infinity, integers over 4300 digits, lone surrogates and deep nesting
answer 400 naming the field).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web

from megatron_rl.http_body import READ_TIMEOUT_S, BodyError, app_runner, exposed_without_key, read_body, server_api_key
from megatron_rl.rollout.local import auth
from megatron_rl.rollout.local.engine_thread import PAUSE_MODES, EngineStateError, EngineThread
from megatron_rl.rollout.local.generator import Generator, GenRequest
from megatron_rl.rollout.local.launcher import ADMIN_API_KEY_ENV, API_KEY_ENV
from megatron_rl.rollout.local.lora import AdapterError, read_adapter_folder
from megatron_rl.rollout.local.model import ModelInfo, load_model
from megatron_rl.rollout.local.protocol import RAW_BODY, FieldError, check_body, get_field, json_body, parse_generate
from megatron_rl.rollout.local.updates import (
    GROUP_INIT_TIMEOUT_S,
    WeightUpdates,
    decode_tensors,
    named_tensors,
    on_engine,
)
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
        self.read_timeout_s = READ_TIMEOUT_S
        self.body_limits = body_limits(info, engine.generator.max_running, len(engine.layout.targets))

    async def _generations_ended(self) -> None:
        async with self._generation_ended:
            await self._generation_ended.wait_for(lambda: self._generating == 0)

    def app(self) -> web.Application:
        # the body middleware enforces each endpoint's limit; aiohttp's own cap is never reached first
        biggest = max(CONTROL_BODY_BYTES, *self.body_limits.values())
        app = web.Application(middlewares=[self._auth, self._errors, self._body], client_max_size=biggest + 1)
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
            ("/update_weight_version", ["POST"], self.update_weight_version),
            ("/get_weights_by_name", get_post, self.get_weights_by_name),
            ("/load_lora_adapter", ["POST"], self.load_lora_adapter),
            ("/load_lora_adapter_from_tensors", ["POST"], self.load_lora_adapter_from_tensors),
            ("/unload_lora_adapter", ["POST"], self.unload_lora_adapter),
            *self.updates.routes(),
        ]
        for path, methods, handler in routes:
            for method in methods:
                app.router.add_route(method, path, handler)
        return app

    # ---- middlewares ----
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        header = request.headers.get("Authorization")
        if not auth.allowed(request.method, request.path, header, self.api_key, self.admin_api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

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
        if req.return_routed_experts and req.routed:
            routed = np.ascontiguousarray(np.concatenate(req.routed)[req.routed_experts_start_len :], dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode("ascii")
        return {"text": self._decode(req.output_ids), "output_ids": req.output_ids, "meta_info": meta}

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

    # ---- LoRA adapters (SGLang's LoRAUpdateOutput replies: success, error_message, loaded_adapters) ----
    async def _lora(self, fn, what: str) -> web.Response:
        def run(e: EngineThread) -> None:
            if "weights" in e.released:
                raise EngineStateError(f"{what}: weights are released; call /resume_memory_occupation first")
            fn(e.generator.adapters)

        try:
            async with self.updates.queue:  # SGLang queues adapter loads and unloads with the weight updates
                await self._engine(run)
        except (AdapterError, EngineStateError) as err:
            log.warning("%s rejected: %s", what, err)
            return web.json_response({"success": False, "error_message": f"{what} failed: {err}"}, status=400)
        loaded = {name: name for name in self.engine.generator.adapters.loaded}
        log.info("%s: adapters loaded %s", what, sorted(loaded))
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": loaded})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        name = get_field(body, "lora_name", "str", required=True)
        path = get_field(body, "lora_path", "str", required=True)
        try:
            config, tensors = read_adapter_folder(path)
        except (AdapterError, OSError, ValueError) as err:
            return web.json_response(
                {"success": False, "error_message": f"load_lora_adapter failed: {err}"}, status=400
            )
        return await self._lora(lambda a: a.load(name, config, tensors), f"load_lora_adapter {name}")

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        name = get_field(body, "lora_name", "str", required=True)
        config = body.get("config_dict")
        if not isinstance(config, dict):
            raise FieldError("config_dict: expected the PEFT adapter_config.json as an object")
        payloads = get_field(body, "serialized_named_tensors", "str_list", required=True)
        if len(payloads) != 1:
            raise FieldError(
                f"serialized_named_tensors: expected 1 entry (the local engine has tp_size 1), got {len(payloads)}"
            )
        load_format = get_field(body, "load_format", "str")
        if load_format not in (None, "direct"):
            raise FieldError(f"load_format: {load_format!r}; allowed: null, 'direct'")
        obj = decode_tensors(payloads[0], get_field(body, "shm_names", "str_list", []))
        tensors = dict(named_tensors(obj, False))
        return await self._lora(lambda a: a.load(name, config, tensors), f"load_lora_adapter_from_tensors {name}")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        name = get_field(body, "lora_name", "str", required=True)
        return await self._lora(lambda a: a.unload(name), f"unload_lora_adapter {name}")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        version = get_field(body, "new_version", "str", required=True)
        abort_all = get_field(body, "abort_all_requests", "bool", True)

        def set_version(e: EngineThread) -> None:
            if abort_all:
                e.abort(lambda r: True)
            e.generator.set_weight_version(version)

        await self._engine(set_version)
        return web.json_response({"success": True, "message": "Weight version updated", "new_version": version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        if request.method == "GET":
            body = dict(request.query)
            if "truncate_size" in body:
                text = body["truncate_size"]
                try:
                    body["truncate_size"] = int(text)
                except ValueError:
                    raise FieldError(f"truncate_size: expected an integer, got {text[:80]!r}") from None
        name = get_field(body, "name", "str", required=True)
        size = get_field(body, "truncate_size", "int", 100)

        def read(e: EngineThread) -> list:
            if name not in e.layout:
                raise FieldError(f"name: unknown tensor {name!r}")
            return e.layout.targets[name][:size].float().cpu().tolist()

        return web.json_response(await self._engine(read))


# ---- command line ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (0 = any free port)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health* (default: ${API_KEY_ENV}, kept off "
        "the command line)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=None,
        help=f"the only key of the control endpoints (weight updates, pause, memory, abort, LoRA) when given "
        f"(default: ${ADMIN_API_KEY_ENV})",
    )
    parser.add_argument(
        "--no-auth", action="store_true", help="serve without an API key: anyone who reaches the port may use it"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (one GPU)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's on GPU), float32, bfloat16, float16"
    )
    parser.add_argument("--max-running-requests", type=int, default=256, help="requests decoded together at most")
    parser.add_argument("--max-prefill-tokens", type=int, default=16384, help="padded prompt tokens per prefill batch")
    parser.add_argument("--random-seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--weight-version", default="default", help="initial weight version reported in meta_info")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="do not load a tokenizer (input_ids only)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once serving")
    parser.add_argument(
        "--group-init-timeout-s",
        type=float,
        default=GROUP_INIT_TIMEOUT_S,
        help="an /init_weights_update_group whose ranks do not all join, or a group's first broadcast that not "
        "every engine rank reaches, fails after this many seconds",
    )
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=READ_TIMEOUT_S,
        help="a connection without a complete request head, or a body not received, within this many seconds is "
        "closed (408 for the body)",
    )
    parser.add_argument("--log-level", default="info", help="debug, info, warning")


def _start_problem(args: argparse.Namespace) -> str | None:
    """What makes these arguments unusable, checked before the model is loaded."""
    for flag, value in [
        ("--max-running-requests", args.max_running_requests),
        ("--max-prefill-tokens", args.max_prefill_tokens),
    ]:
        if value < 1:
            return f"{flag} {value}: must be >= 1"
    for flag, seconds in [
        ("--read-timeout-s", args.read_timeout_s),
        ("--group-init-timeout-s", args.group_init_timeout_s),
    ]:
        if not seconds > 0:
            return f"{flag} {seconds}: must be > 0"
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _tokenizer(path: str) -> Any:
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        log.info("no tokenizer files in %s; the engine accepts input_ids only", path)
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:  # a model folder without tokenizer files
        log.info("no tokenizer loaded (%s); the engine accepts input_ids only", str(err).splitlines()[0][:120])
        return None


def run(args: argparse.Namespace) -> int:
    try:
        api_key = server_api_key(args.api_key, API_KEY_ENV, args.no_auth)
        problem = _start_problem(args)
    except ValueError as err:
        problem = str(err)
    if problem is not None:
        print(f"megatron-rl serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if exposed_without_key(args.host, api_key):
        log.warning("serving on %s without an API key: anyone who reaches the port may update the weights", args.host)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    log.info("loading %s on %s (dtype %s)", args.model, args.device, args.dtype)
    model, info = load_model(args.model, args.device, args.dtype)
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "loaded %s: %d layers, %s, %.2fM parameters, %s on %s in %.1f s",
        info.family,
        info.num_layers,
        f"{info.num_experts} experts top-{info.top_k} in {len(info.moe_layers)} layers" if info.is_moe else "dense",
        params / 1e6,
        str(info.dtype).removeprefix("torch."),
        info.device,
        time.monotonic() - started,
    )
    tokenizer = None if args.skip_tokenizer_init else _tokenizer(args.model)
    generator = Generator(model, info, args.max_running_requests, args.max_prefill_tokens, args.random_seed)
    generator.set_weight_version(args.weight_version)
    engine = EngineThread(model, info, generator)
    engine.start()
    admin_api_key = args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None
    server = LocalServer(engine, info, api_key, tokenizer, admin_api_key)
    server.updates.group_init_timeout_s = args.group_init_timeout_s
    server.read_timeout_s = args.read_timeout_s
    try:
        asyncio.run(_serve(server, args.host, args.port, args.port_file))
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    return 0


async def _serve(server: LocalServer, host: str, port: int, port_file: str | None) -> None:
    # on SIGTERM, requests still running (a pending group init, a long generate) get a few seconds
    runner = app_runner(
        server.app(), server.read_timeout_s, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked for
    if port_file:
        with open(port_file, "w") as handle:
            handle.write(str(bound))
    log.info("serving on http://%s:%d%s", host, bound, " (API key required)" if server.api_key else "")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()
        server.updates.close()
