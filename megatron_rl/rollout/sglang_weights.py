"""The weights client: SGLang's weight-update endpoints, its weight-update session (0.5.21+,
feature-detected), the LoRA adapter endpoints and the bodies they take, sent to every server
(`urls`: an sglang-router's workers), each reply required to say success. Its transport (servers,
retries, keys) is `sglang_transport.SGLangTransport`; the generation client is `sglang.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from megatron_rl.rollout.sglang_errors import BadRequestError, SGLangError
from megatron_rl.rollout.sglang_transport import SGLangTransport

log = logging.getLogger(__name__)


class WeightUpdates(SGLangTransport):
    """The weight-update calls to every server (`SGLangClient` holds them with the generation calls)."""

    def __init__(self, urls: Any, **options: Any) -> None:
        super().__init__(urls, **options)
        self._sessions: set[str] = set()  # servers with a weight-update session open

    async def _update(self, path: str, body: dict, retry: bool, per_server: list[dict] | None = None) -> list[dict]:
        async def one(i: int, url: str) -> dict:
            payload = {**body, **(per_server[i] if per_server else {})}
            try:
                reply = await self._json("POST", path, payload, server=url, retry=retry)
            except BadRequestError as err:
                raise BadRequestError(f"{path} on {url} failed: {err}", url, 400) from None
            if not isinstance(reply, dict) or not reply.get("success", False):
                raise SGLangError(f"{path} on {url} failed: {reply}", server=url)
            return reply

        return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(self.urls))))

    async def begin_weight_update(self) -> list[bool]:
        """Open a weight-update session on every server: SGLang >= 0.5.21 refuses distributed and
        tensor updates outside one (and, over NCCL, without joining the broadcast). True where a
        session was opened; False where the server has no such endpoint (HTTP 404: SGLang 0.5.9 to
        0.5.20, which needs none). A session left open (a trainer that died mid-sync) is closed
        and opened again. `end_weight_update` closes what this opened."""

        async def one(url: str) -> bool:
            for attempt in range(2):
                try:
                    reply = await self._json("POST", "/begin_weight_update", {}, server=url, retry=False)
                except BadRequestError as err:
                    if attempt == 0 and "already open" in str(err):
                        log.warning("%s had a weight-update session open; closing it first", url)
                        await self._json("POST", "/end_weight_update", {}, server=url, retry=False)
                        continue
                    raise
                except SGLangError as err:
                    if err.status == 404:
                        return False
                    raise
                if not isinstance(reply, dict) or not reply.get("success", False):
                    raise SGLangError(f"/begin_weight_update on {url} failed: {reply}", server=url)
                self._sessions.add(url)
                return True
            raise AssertionError("unreachable")

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def end_weight_update(self) -> None:
        """Close the sessions `begin_weight_update` opened (each server's, even if another fails)."""
        urls = [u for u in self.urls if u in self._sessions]
        self._sessions -= set(urls)
        replies = await asyncio.gather(
            *(self._json("POST", "/end_weight_update", {}, server=u, retry=False) for u in urls),
            return_exceptions=True,
        )
        for url, reply in zip(urls, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            if not isinstance(reply, dict) or not reply.get("success", False):
                raise SGLangError(f"/end_weight_update on {url} failed: {reply}", server=url)

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> list[dict]:
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return await self._update("/update_weights_from_disk", body, retry=True)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        ranks_per_server: int = 1,
    ) -> list[dict]:
        """Ask every server to join the group `group_name`, hosted by its rank 0 (the sender) at
        `master_address:master_port`; server i's first rank is 1 + i * ranks_per_server. A server
        holds one such group per sender, each under its own name (`init_group_bodies`)."""
        bodies = init_group_bodies(
            master_address, master_port, world_size, group_name, backend, ranks_per_server, len(self.urls)
        )
        return await self._update("/init_weights_update_group", {}, retry=False, per_server=bodies)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> list[dict]:
        return await self._update("/destroy_weights_update_group", {"group_name": group_name}, retry=False)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flattened_bucket: bool = False,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> list[dict]:
        """Announce the tensors rank 0 of group `group_name` (a sender) is about to broadcast, in this order."""
        body = distributed_update_body(
            names, dtypes, shapes, group_name, weight_version, flattened_bucket, flush_cache, abort_all_requests
        )
        return await self._update("/update_weights_from_distributed", body, retry=False)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str] | list[list[str]],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        shm_names: list[str] | None = None,
    ) -> list[dict]:
        """`serialized_named_tensors`: one payload per TP rank (`megatron_rl/weight_sync/send.py` writes
        them), the same for every server, or one such list per server (in `urls` order). `shm_names`:
        the shared-memory segments they refer to (the local engine maps no other; SGLang ignores it)."""
        body = {
            "shm_names": list(shm_names or []),
            "load_format": load_format,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if serialized_named_tensors and all(isinstance(p, list) for p in serialized_named_tensors):
            if len(serialized_named_tensors) != len(self.urls):
                raise ValueError(
                    f"update_weights_from_tensor: {len(serialized_named_tensors)} payload lists for {len(self.urls)} servers"
                )
            per_server = [{"serialized_named_tensors": p} for p in serialized_named_tensors]
            return await self._update("/update_weights_from_tensor", body, retry=False, per_server=per_server)
        body["serialized_named_tensors"] = serialized_named_tensors
        return await self._update("/update_weights_from_tensor", body, retry=False)

    # ---- LoRA adapters (every server; SGLang's LoRAUpdateOutput replies say success) ----
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[dict]:
        """Every server loads the PEFT folder `lora_path` (visible to it) as adapter `lora_name`."""
        return await self._update("/load_lora_adapter", lora_load_body(lora_name, lora_path), retry=True)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_named_tensors: list[str],
        shm_names: list[str] | None = None,
    ) -> list[dict]:
        """Every server loads adapter `lora_name` from one serialised (name, tensor) list per TP rank
        (`weight_sync/send.py`) and its PEFT config; `shm_names` as for `update_weights_from_tensor`."""
        body = lora_tensors_body(lora_name, config_dict, serialized_named_tensors)
        body["shm_names"] = list(shm_names or [])
        return await self._update("/load_lora_adapter_from_tensors", body, retry=False)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> list[dict]:
        """Every server reports `new_version` from now on (its weights unchanged: e.g. a new adapter)."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._update("/update_weight_version", body, retry=True)

    async def unload_lora_adapter(self, lora_name: str) -> list[dict]:
        return await self._update("/unload_lora_adapter", {"lora_name": lora_name}, retry=True)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self._json(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}, server=self.urls[0]
        )


def init_group_bodies(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str,
    ranks_per_server: int,
    servers: int,
) -> list[dict[str, Any]]:
    """SGLang's InitWeightsUpdateGroupReqInput body for each of `servers` servers: the group's rank
    0 (a trainer sender) hosts the store at `master_address:master_port`; server i's TP rank k is
    rank 1 + i * ranks_per_server + k (SGLang adds the TP rank to `rank_offset`)."""
    return [
        {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1 + i * ranks_per_server,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        for i in range(servers)
    ]


def distributed_update_body(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    group_name: str,
    weight_version: str | None = None,
    flattened_bucket: bool = False,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
) -> dict[str, Any]:
    """SGLang's UpdateWeightsFromDistributedReqInput body: the tensors rank 0 of `group_name` broadcasts."""
    return {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "weight_version": weight_version,
        "load_format": "flattened_bucket" if flattened_bucket else None,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
    }


def lora_load_body(lora_name: str, lora_path: str) -> dict[str, Any]:
    """SGLang's LoadLoRAAdapterReqInput body."""
    return {"lora_name": lora_name, "lora_path": lora_path, "pinned": False}


def lora_tensors_body(
    lora_name: str, config_dict: dict[str, Any], serialized_named_tensors: list[str]
) -> dict[str, Any]:
    """SGLang's LoadLoRAAdapterFromTensorsReqInput body (the tensors: one base64 payload per TP rank)."""
    return {
        "lora_name": lora_name,
        "config_dict": config_dict,
        "serialized_named_tensors": list(serialized_named_tensors),
        "pinned": False,
        "load_format": None,
    }
