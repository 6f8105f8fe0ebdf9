"""The local engine's weight updates, taken as SGLang 0.5.23 takes them.

- One at a time, in arrival order (`WeightUpdates.queue`, FIFO): group init and destroy, the session's
  begin and end, distributed, tensor and disk updates, and the LoRA loads and unloads (`lora_endpoints.py`).
  A request holds the queue until it is done, blocking inside its receive, as SGLang's scheduler runs
  one control request at a time (each communicator's `queueing_call` is FIFO, and the scheduler blocks
  in `init_custom_process_group` and in `receive_weights_from_distributed`'s broadcast).
- A group's init waits for every rank of the group (gloo connects them all; NCCL does at its first
  collective), and so does its first broadcast: the engine ranks meet in the group's store before the
  first receive (`EngineGroup.meet_engine_ranks`), as NCCL's first broadcast builds the communicator
  with every rank. So two servers that take two groups' requests in different orders wait for each
  other, as SGLang's would, until `group_init_timeout_s` fails the request naming the group.
- Distributed and tensor updates only inside a weight-update session (SGLang >= 0.5.21); begin, on a
  server that is not paused, waits for the generations in flight to end (SGLang's writer lock).
- An update is validated whole before anything is copied (`weights.py`): a refused one leaves the old
  weights serving.
- `/update_weight_version` (not queued) and `/get_weights_by_name` (the first values of a served
  tensor) are served here too.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from megatron_rl.rollout import wire
from megatron_rl.rollout.local.engine_thread import EngineStateError, EngineThread
from megatron_rl.rollout.local.model import ModelInfo
from megatron_rl.rollout.local.protocol import (
    DistributedUpdate,
    FieldError,
    UpdateOptions,
    check_body,
    get_field,
    json_body,
)
from megatron_rl.rollout.local.weights import WeightUpdateError, apply_named_tensors, load_safetensors_dir

log = logging.getLogger("megatron_rl.serve")

GROUP_INIT_TIMEOUT_S = 60.0
HOST_BUCKETS_KEPT = 16
_FIRST_BROADCAST = "megatron-rl/engine-ranks-at-first-broadcast"


def update_reply(ok: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


async def on_engine(engine: EngineThread, fn: Callable[[EngineThread], Any]) -> Any:
    """`fn(engine)` run on the engine thread, awaited."""
    return await asyncio.wrap_future(engine.call(fn))


@dataclass
class EngineGroup:
    """A weight-update group this engine joined: the process group, its store, and how many of its
    ranks are engine ranks (all but the trainer's rank 0)."""

    name: str
    process_group: Any
    store: Any
    engine_ranks: int
    received: bool = False  # a broadcast of the group has been received

    def meet_engine_ranks(self, timeout_s: float) -> str | None:
        """Wait until every engine rank of the group is at its first broadcast; what went wrong or None."""
        try:
            if self.store.add(_FIRST_BROADCAST, 1) >= self.engine_ranks:
                self.store.set(_FIRST_BROADCAST + "/all", "1")
            self.store.wait([_FIRST_BROADCAST + "/all"], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:  # torch's DistStoreError: the wait timed out, or the trainer's store is gone
            try:
                arrived = f"{self.store.add(_FIRST_BROADCAST, 0)} of {self.engine_ranks}"
            except RuntimeError:
                return f"the store of group {self.name!r} failed at its first broadcast: {err}"
            return (
                f"the first broadcast of group {self.name!r} waits for every engine rank, and {arrived} arrived "
                f"within {timeout_s:.0f} s: another server took another request first (each server takes one "
                "update at a time, so every server must get the senders' requests in one order)"
            )
        return None


class WeightUpdates:
    """The weight-update endpoints of a `LocalServer` (see the module docstring); `routes()` lists them.
    `generations_ended` waits until no /generate is being answered."""

    def __init__(self, engine: EngineThread, info: ModelInfo, generations_ended: Callable[[], Awaitable[None]]):
        self.engine, self.info, self.generations_ended = engine, info, generations_ended
        self.queue = asyncio.Lock()  # FIFO: the weight-update requests, one at a time in arrival order
        self.groups: dict[str, EngineGroup] = {}
        self.session_open = False  # SGLang >= 0.5.21's weight-update session
        self.group_init_timeout_s = GROUP_INIT_TIMEOUT_S
        # The last host bucket of each sender (by its shared-memory segments): while it is referenced,
        # torch maps a trainer buffer that is sent again (weight_sync.packing.PackBuffers reuses one per
        # sender) from its cache, without new page faults. At most HOST_BUCKETS_KEPT senders' buffers.
        self._host_buckets: dict[tuple[str, ...], torch.Tensor] = {}

    def routes(self) -> list[tuple[str, list[str], Callable[[web.Request], Awaitable[web.Response]]]]:
        return [
            ("/update_weights_from_disk", ["POST"], self.update_from_disk),
            ("/begin_weight_update", ["POST"], self.begin_weight_update),
            ("/end_weight_update", ["POST"], self.end_weight_update),
            ("/init_weights_update_group", ["POST"], self.init_group),
            ("/destroy_weights_update_group", ["POST"], self.destroy_group),
            ("/update_weights_from_distributed", ["POST"], self.update_from_distributed),
            ("/update_weights_from_tensor", ["POST"], self.update_from_tensor),
            ("/update_weight_version", ["POST"], self.update_weight_version),
            ("/get_weights_by_name", ["GET", "POST"], self.get_weights_by_name),
        ]

    def close(self) -> None:
        """Destroy every group (a gloo group left alive can abort the interpreter at exit)."""
        for group in self.groups.values():
            wire.destroy_weights_update_group(group.process_group)
        self.groups.clear()

    # ---- the weight version, and a tensor's values ----
    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        version = get_field(body, "new_version", "str", required=True)
        abort_all = get_field(body, "abort_all_requests", "bool", True)

        def set_version(e: EngineThread) -> None:
            if abort_all:
                e.abort(lambda r: True)
            e.generator.set_weight_version(version)

        await on_engine(self.engine, set_version)
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

        return web.json_response(await on_engine(self.engine, read))

    async def _apply(self, options: UpdateOptions, fn: Callable[[EngineThread], int], what: str) -> web.Response:
        def run(e: EngineThread) -> int:
            if "weights" in e.released:
                raise EngineStateError(f"{what}: weights are released; call /resume_memory_occupation first")
            if options.abort_all_requests:
                e.abort(lambda r: True)
            nbytes = fn(e)
            if options.weight_version is not None:
                e.generator.set_weight_version(options.weight_version)
            return nbytes

        started = time.monotonic()
        try:
            nbytes = await on_engine(self.engine, run)
        except (WeightUpdateError, ValueError, RuntimeError) as err:  # RuntimeError: EngineStateError, a gloo receive
            log.warning("%s rejected: %s", what, err)
            return update_reply(False, f"{what} failed: {err}")
        seconds = time.monotonic() - started
        log.info("%s: %.1f MB in %.2f s, weight version %s", what, nbytes / 1e6, seconds, self.engine.weight_version)
        return update_reply(True, f"Succeeded to update model weights ({what}).", num_paused_requests=0)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        async with self.queue:
            path = get_field(body, "model_path", "str", required=True)
            load_format = get_field(body, "load_format", "str")
            if load_format not in (None, "auto", "safetensors"):
                raise FieldError(f"load_format: {load_format!r}; the local engine reads safetensors (null, auto)")
            return await self._apply(
                UpdateOptions.parse(body), lambda e: load_safetensors_dir(e.layout, path), "update_weights_from_disk"
            )

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        selector = get_field(body, "selector", "str", "all")
        if selector not in ("target", "draft", "all"):
            raise FieldError(f"selector: {selector!r}; allowed: target, draft, all")
        if not self.engine.paused:
            # As SGLang's begin (its writer lock): on a server that is not paused, wait until every
            # generation in flight has ended; the client's request timeout bounds the wait.
            await self.generations_ended()
        async with self.queue:
            if self.session_open:
                return update_reply(False, "a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
            return update_reply(True, "Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        check_body(await json_body(request))
        async with self.queue:
            if not self.session_open:
                return update_reply(False, "no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
            return update_reply(True, "Success")

    def _outside_session(self, what: str) -> web.Response | None:
        """SGLang 0.5.23's refusal of a distributed or tensor update outside a session (given before
        anything is received, as SGLang gives it, so a trainer that skips the session sees it)."""
        if self.session_open:
            return None
        log.warning("%s refused: no weight-update session is open", what)
        return update_reply(False, f"{what} must run between begin_weight_update() and end_weight_update()")

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        async with self.queue:
            refused = self._outside_session("update_weights_from_tensor")
            if refused is not None:
                return refused
            payloads = get_field(body, "serialized_named_tensors", "str_list", required=True)
            if len(payloads) != 1:
                raise FieldError(
                    f"serialized_named_tensors: expected 1 entry (the local engine has tp_size 1), got {len(payloads)}"
                )
            load_format = get_field(body, "load_format", "str")
            if load_format not in (None, "direct", "flattened_bucket"):
                raise FieldError(f"load_format: {load_format!r}; allowed: null, 'direct', 'flattened_bucket'")
            shm_names = get_field(body, "shm_names", "str_list", [])
            obj = decode_tensors(payloads[0], shm_names)
            named = named_tensors(obj, load_format == "flattened_bucket")
            flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
            if isinstance(flat, torch.Tensor) and flat.device.type == "cpu" and shm_names:
                key = tuple(shm_names)
                self._host_buckets.pop(key, None)
                self._host_buckets[key] = flat
                while len(self._host_buckets) > HOST_BUCKETS_KEPT:
                    del self._host_buckets[next(iter(self._host_buckets))]
            return await self._apply(
                UpdateOptions.parse(body), lambda e: apply_named_tensors(e.layout, named), "update_weights_from_tensor"
            )

    async def init_group(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        address = get_field(body, "master_address", "str", required=True)
        port = get_field(body, "master_port", "int", required=True)
        rank_offset = get_field(body, "rank_offset", "int", required=True)
        world_size = get_field(body, "world_size", "int", required=True)
        group_name = get_field(body, "group_name", "str", "weight_update_group")
        backend = get_field(body, "backend", "str", "nccl")
        if backend not in ("nccl", "gloo"):
            raise FieldError(f"backend: {backend!r}; allowed: nccl, gloo")
        if backend == "nccl" and self.info.device.type != "cuda":
            raise FieldError("backend: 'nccl' needs the engine on a GPU; this engine runs on the CPU, use 'gloo'")
        if not 0 < rank_offset < world_size:
            raise FieldError(
                f"rank_offset: {rank_offset} must be in [1, world_size={world_size}) (rank 0 is the trainer)"
            )
        async with self.queue:
            if group_name in self.groups:
                return update_reply(False, f"group {group_name!r} already exists; destroy it first")
            log.info(
                "joining weight-update group %r at %s:%d as rank %d of %d (%s)",
                *(group_name, address, port, rank_offset, world_size, backend),
            )
            join = functools.partial(
                wire.join_weights_update_group,
                *(address, port, rank_offset, world_size, group_name, backend),
                store_timeout_s=self.group_init_timeout_s,
            )
            try:
                # a daemon thread, not the default executor: SIGTERM must not wait for a rendezvous to give up
                process_group, store = await asyncio.wrap_future(wire.in_daemon_thread(join))
            except Exception as err:  # rendezvous failures: reported to the trainer, the server keeps running
                return update_reply(False, f"Failed to initialize custom process group: {err}.")
            self.groups[group_name] = EngineGroup(group_name, process_group, store, world_size - 1)
            return update_reply(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = check_body(await json_body(request))
        name = get_field(body, "group_name", "str", "weight_update_group")
        async with self.queue:
            group = self.groups.pop(name, None)
            if group is None:
                return update_reply(False, "The group to be destroyed does not exist.")
            wire.destroy_weights_update_group(group.process_group)
            return update_reply(True, "Succeeded to destroy custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        spec = DistributedUpdate.parse(check_body(await json_body(request)))
        async with self.queue:
            what = "update_weights_from_distributed"
            refused = self._outside_session(what)
            if refused is not None:
                return refused
            group = self.groups.get(spec.group_name)
            if group is None:
                raise FieldError(f"group_name: no group {spec.group_name!r}; call /init_weights_update_group first")
            if not group.received:
                problem = await asyncio.to_thread(group.meet_engine_ranks, self.group_init_timeout_s)
                if problem is not None:
                    log.warning("%s refused: %s", what, problem)
                    return update_reply(False, f"{what} failed: {problem}")
                group.received = True
            device = self.info.device
            direct = not spec.flattened and await on_engine(
                self.engine,
                lambda e: (
                    "weights" not in e.released
                    and e.layout.in_place_targets(spec.names, spec.dtypes, spec.shapes, device) is not None
                ),
            )
            pg = group.process_group
            if direct:
                # Every tensor validates and its parameter can take the bytes as they come: receive
                # straight into the parameters, on the engine thread so no decoding step sees half of it.
                return await self._apply(spec.options, lambda e: _receive_in_place(spec, pg, e, device), what)
            # Otherwise receive everything the trainer broadcasts (keeping the group in step), then validate and apply.
            try:
                named = await asyncio.to_thread(_receive, spec, pg, device)
            except RuntimeError as err:  # the group's broadcast failed (a peer gone, its timeout)
                log.warning("%s failed: %s", what, err)
                return update_reply(False, f"{what} failed: Failed to receive weights: {err}")
            return await self._apply(spec.options, lambda e: apply_named_tensors(e.layout, named), what)


def decode_tensors(payload: str, shm_names: list[str]) -> Any:
    """A tensor payload (`wire.deserialize_named_tensors`); a malformed one is a `FieldError`."""
    try:
        return wire.deserialize_named_tensors(payload, shm_names)
    except Exception as err:  # binascii.Error, pickle.UnpicklingError, ...: all a malformed field
        raise FieldError(f"serialized_named_tensors[0]: cannot be decoded: {err}") from None


def named_tensors(obj: Any, flattened: bool) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a decoded payload: a flattened bucket or a list of pairs."""
    if flattened:
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
            raise FieldError("serialized_named_tensors[0]: a flattened bucket needs 'flattened_tensor' and 'metadata'")
        try:
            return wire.unflatten_tensors(obj["flattened_tensor"], list(obj["metadata"]))
        except ValueError as err:
            raise FieldError(f"serialized_named_tensors[0]: {err}") from None
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) for item in obj
    ):
        raise FieldError("serialized_named_tensors[0]: expected a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in obj]


def _receive_in_place(spec: DistributedUpdate, group: Any, e: EngineThread, device: torch.device) -> int:
    """Receive a per-tensor broadcast straight into the engine's parameters; returns the bytes."""
    import torch.distributed as dist

    views = e.layout.in_place_targets(spec.names, spec.dtypes, spec.shapes, device)
    if views is None:  # checked just before, on this thread; the model does not change in between
        raise EngineStateError("update_weights_from_distributed: the parameters changed under the update")
    for handle in [dist.broadcast(v, src=0, group=group, async_op=True) for v in views]:
        handle.wait()
    return sum(v.numel() * v.element_size() for v in views)


def _receive(spec: DistributedUpdate, group: Any, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    if spec.flattened:
        meta = wire.flattened_layout(spec.names, spec.dtypes, spec.shapes)
        flat = torch.empty(meta[-1].end_idx if meta else 0, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=group)
        return wire.unflatten_tensors(flat, meta)
    named = []
    handles = []
    for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        handles.append(dist.broadcast(tensor, src=0, group=group, async_op=True))
        named.append((name, tensor))
    for handle in handles:
        handle.wait()
    return named
