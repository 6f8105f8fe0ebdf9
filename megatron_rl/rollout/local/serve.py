"""`megatron-rl serve`: the local engine's command line. Checks the arguments before the model loads
(one line, exit code 2), loads the model and the tokenizer, starts the engine thread and serves
`LocalServer` (`server.py`) until SIGTERM or SIGINT, writing the bound port to `--port-file` once it
listens (`megatron_rl.http.server`'s start-up, which `launcher.py` waits for).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from megatron_rl.http.server import add_read_timeout_argument, command_start, start
from megatron_rl.rollout.local.engine_thread import EngineThread
from megatron_rl.rollout.local.generator import Generator
from megatron_rl.rollout.local.launcher import ADMIN_API_KEY_ENV, API_KEY_ENV
from megatron_rl.rollout.local.model import load_model
from megatron_rl.rollout.local.server import LocalServer
from megatron_rl.rollout.local.updates import GROUP_INIT_TIMEOUT_S

log = logging.getLogger("megatron_rl.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument(
        "--port", type=int, default=30000, help="port to listen on (default 30000, as SGLang; 0 = any free port)"
    )
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
    add_read_timeout_argument(parser)
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
    api_key, refused = command_start("serve", args, API_KEY_ENV, _start_problem, "update the weights")
    if refused:
        return refused
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
    generator = Generator(
        model, info, args.max_running_requests, args.max_prefill_tokens, args.random_seed, tokenizer=tokenizer
    )
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
    serving = await start(
        server.app(),
        host=host,
        port=port,
        read_timeout_s=server.read_timeout_s,
        shutdown_timeout_s=5.0,
        handler_cancellation=True,
    )
    try:
        serving.write_port(port_file)
        log.info("serving on http://%s:%d%s", host, serving.port, " (API key required)" if server.api_key else "")
        await serving.until_stop_signal()
        log.info("shutting down")
    finally:
        await serving.close()
        server.updates.close()
