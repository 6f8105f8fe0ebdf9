"""The local engine's LoRA adapter endpoints, as SGLang 0.5.23 serves them: `/load_lora_adapter` (a
PEFT folder), `/load_lora_adapter_from_tensors` (the tensor payload of a weight update) and
`/unload_lora_adapter`, each answered with SGLang's `LoRAUpdateOutput` (success, error_message,
loaded_adapters). Each takes its turn in the weight updates' queue (`updates.WeightUpdates.queue`), as
SGLang queues adapter loads and unloads with them; the adapters themselves: `lora.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from megatron_rl.rollout.local.engine_thread import EngineStateError, EngineThread
from megatron_rl.rollout.local.lora import AdapterError, LocalAdapters, read_adapter_folder
from megatron_rl.rollout.local.protocol import FieldError, check_body, get_field, json_body
from megatron_rl.rollout.local.updates import decode_tensors, named_tensors, on_engine

log = logging.getLogger("megatron_rl.serve")


class LoraEndpoints:
    """The adapter endpoints of a `LocalServer` over `engine`, in turn in `queue`; `routes()` lists them."""

    def __init__(self, engine: EngineThread, queue: asyncio.Lock) -> None:
        self.engine, self.queue = engine, queue

    def routes(self) -> list[tuple[str, list[str], Callable[[web.Request], Awaitable[web.Response]]]]:
        return [
            ("/load_lora_adapter", ["POST"], self.load_lora_adapter),
            ("/load_lora_adapter_from_tensors", ["POST"], self.load_lora_adapter_from_tensors),
            ("/unload_lora_adapter", ["POST"], self.unload_lora_adapter),
        ]

    async def _apply(self, fn: Callable[[LocalAdapters], None], what: str) -> web.Response:
        def run(e: EngineThread) -> None:
            if "weights" in e.released:
                raise EngineStateError(f"{what}: weights are released; call /resume_memory_occupation first")
            fn(e.generator.adapters)

        try:
            async with self.queue:  # SGLang queues adapter loads and unloads with the weight updates
                await on_engine(self.engine, run)
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
        return await self._apply(lambda a: a.load(name, config, tensors), f"load_lora_adapter {name}")

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
        return await self._apply(lambda a: a.load(name, config, tensors), f"load_lora_adapter_from_tensors {name}")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        name = get_field(body, "lora_name", "str", required=True)
        return await self._apply(lambda a: a.unload(name), f"unload_lora_adapter {name}")
