"""Our wire formats read by SGLang 0.5.23's own code (tests/sglang_wheel.py loads it from the wheel,
without SGLang's dependencies): its `SafeUnpickler` on our tensor payloads, its
`FlattenedTensorBucket` on our buckets, its allowlist against the local engine's."""

from __future__ import annotations

import base64
import inspect
import io
import pickle
import re
from dataclasses import dataclass

import pytest
import sglang_wheel
import torch

from megatron_rl.rollout import wire
from megatron_rl.weight_sync import send
from megatron_rl.weight_sync.packing import pack_bucket


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=gen)),  # 60 bytes at 0
        ("model.norm.weight", torch.randn(7, generator=gen).to(torch.bfloat16)),  # 14 bytes at 64
        ("lm_head.weight", torch.randn(4, 2, generator=gen).to(torch.float16)),  # 16 bytes at 80
    ]


def _sglang_load(payload: str, monkeypatch: pytest.MonkeyPatch) -> object:
    sglang_wheel.tensor_bucket(monkeypatch)
    unpickler = sglang_wheel.safe_unpickler()
    return unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()


def test_local_unpickler_admits_only_what_sglang_admits() -> None:
    sglang_allowed = sglang_wheel.safe_unpickler().ALLOWED_GLOBALS
    extra = sorted(wire.ALLOWED_GLOBALS - sglang_allowed)
    assert not extra, f"the local engine admits globals SGLang 0.5.23 refuses: {extra}"
    assert wire.SGLANG_METADATA_CLASS in sglang_allowed


def test_sglang_reads_our_flattened_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = _bucket()
    flat, meta = pack_bucket(bucket)
    payload, _ = send.serialize_named_tensors({"flattened_tensor": flat, "metadata": meta})
    loaded = _sglang_load(payload, monkeypatch)
    tb = sglang_wheel.tensor_bucket(monkeypatch)
    assert all(type(m) is tb.FlattenedTensorMetadata for m in loaded["metadata"])
    assert [(m.start_idx, m.end_idx) for m in loaded["metadata"]] == [(0, 60), (64, 78), (80, 96)]
    got = tb.FlattenedTensorBucket(flattened_tensor=loaded["flattened_tensor"], metadata=loaded["metadata"])
    for (name, want), (got_name, value) in zip(bucket, got.reconstruct_tensors(), strict=True):
        assert got_name == name and value.dtype == want.dtype and torch.equal(value, want), name


def test_sglang_reads_our_named_tensor_list(monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = _bucket()
    loaded = _sglang_load(send.serialize_named_tensors(bucket)[0], monkeypatch)
    assert [n for n, _ in loaded] == [n for n, _ in bucket]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded, bucket, strict=True))


@dataclass
class FlattenedTensorMetadata:  # a metadata class of another module, as megatron-rl once sent
    name: str
    start_idx: int


def test_a_metadata_class_sglang_refuses_is_refused_by_the_local_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump({"metadata": [FlattenedTensorMetadata("x", 0)]})
    payload = base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        _sglang_load(payload, monkeypatch)
    with pytest.raises(pickle.UnpicklingError, match="admits only sglang.srt.weight_sync.tensor_bucket"):
        wire.deserialize_named_tensors(payload)


def test_distributed_flattened_layout_is_sglangs(monkeypatch: pytest.MonkeyPatch) -> None:
    tb = sglang_wheel.tensor_bucket(monkeypatch)
    names, dtypes, shapes = ["a", "b", "c"], [torch.float32, torch.bfloat16, torch.bfloat16], [[3], [5], [2, 2]]
    ours = wire.flattened_layout(names, dtypes, shapes)
    theirs = tb.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu").get_metadata()
    assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in ours] == [
        (m.name, m.start_idx, m.end_idx, m.numel) for m in theirs
    ]
    with pytest.raises(ValueError, match="not aligned"):
        wire.flattened_layout(["a", "b"], [torch.bfloat16, torch.float32], [[3], [1]])
    with pytest.raises(ValueError, match="Unaligned"):
        tb.FlattenedTensorBucket.empty(["a", "b"], [torch.bfloat16, torch.float32], [[3], [1]], "cpu")


def test_weight_update_session_is_feature_detected() -> None:
    """0.5.9-0.5.20 have no session endpoints (404: updated without one); a session left open by a
    trainer that died is closed and opened again; any other refusal is raised."""
    import asyncio

    from aiohttp import web

    from megatron_rl.parallel.launch import free_port
    from megatron_rl.rollout.sglang import BadRequestError, SGLangClient

    calls: list[str] = []
    state = {"open": True}  # SGLang 0.5.23's messages (scheduler_components/weight_updater.py)

    async def begin(request: web.Request) -> web.Response:
        calls.append("begin")
        if state["open"]:
            message = "a weight-update session is already open; call end_weight_update() first"
            return web.json_response({"success": False, "message": message}, status=400)
        state["open"] = True
        return web.json_response({"success": True, "message": "Success"})

    async def end(request: web.Request) -> web.Response:
        calls.append("end")
        ok, state["open"] = state["open"], False
        return web.json_response(
            {"success": ok, "message": "Success" if ok else "no session"}, status=200 if ok else 400
        )

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "the engine is shutting down"}, status=400)

    async def go() -> None:
        new, old, refusing = web.Application(), web.Application(), web.Application()
        new.router.add_post("/begin_weight_update", begin)
        new.router.add_post("/end_weight_update", end)
        refusing.router.add_post("/begin_weight_update", refuse)
        runners = [web.AppRunner(app) for app in (new, old, refusing)]
        urls = []
        for runner in runners:
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            urls.append(f"http://127.0.0.1:{port}")
        try:
            async with SGLangClient(urls[:2], max_retries=0) as client:
                assert await client.begin_weight_update() == [True, False]
                assert calls == ["begin", "end", "begin"] and state["open"]  # the stale session was closed first
                await client.end_weight_update()
                assert calls[-1] == "end" and not state["open"]
                await client.end_weight_update()  # nothing open any more: no call
                assert calls.count("end") == 2
            async with SGLangClient(urls[2:], max_retries=0) as client:
                with pytest.raises(BadRequestError, match="the engine is shutting down"):
                    await client.begin_weight_update()
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(go())


def test_admin_paths_are_the_endpoints_sglang_guards_with_the_admin_key() -> None:
    """Every endpoint the client calls that SGLang 0.5.23's http_server guards with
    AuthLevel.ADMIN_OPTIONAL (only --admin-api-key opens it when set) gets `admin_api_key`, and no other."""
    import ast

    from megatron_rl.rollout import sglang, sglang_weights

    tree = ast.parse(sglang_wheel.source("srt/entrypoints/http_server.py").read_text())
    admin: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if "auth_level(AuthLevel.ADMIN_OPTIONAL)" in decorators:
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant):
                    admin.add(d.args[0].value)
    called = {p for m in (sglang, sglang_weights) for p in re.findall(r'"(/[a-z_]+)"', inspect.getsource(m))}
    assert sglang.ADMIN_PATHS == called & admin, (sorted(sglang.ADMIN_PATHS ^ (called & admin)), sorted(admin))


def test_multi_sender_update_payloads_are_sglangs() -> None:
    """Two senders (pipeline stages 0 and 1) updating two servers of TP 2: each sender's group bodies
    and update bodies read as SGLang's own request classes; each group has its own name and its
    sender's store, and the engine ranks 1..4 of every group are the servers' TP ranks. And what the
    design rests on, read in the wheel: SGLang keys its groups by `group_name`, receives every
    update from rank 0 of the group it names, ranks an engine's TP rank at `rank_offset + tp_rank`,
    and queues the control requests (one sender's update never interleaves with another's)."""
    pytest.importorskip("msgspec", reason="SGLang's request classes are msgspec Structs")
    from megatron_rl.rollout.sglang_weights import distributed_update_body, init_group_bodies

    classes = sglang_wheel.io_struct_classes("InitWeightsUpdateGroupReqInput", "UpdateWeightsFromDistributedReqInput")
    servers, tp = 2, 2
    world = 1 + servers * tp
    senders = {"megatron-rl-7-pp0-ep0-1": ("10.0.0.1", 29600), "megatron-rl-9-pp1-ep0-1": ("10.0.0.2", 29611)}
    for name, (address, port) in senders.items():
        bodies = init_group_bodies(address, port, world, name, "nccl", tp, servers)
        parsed = [sglang_wheel.as_request(classes["InitWeightsUpdateGroupReqInput"], b) for b in bodies]
        assert {(p.master_address, p.master_port, p.group_name, p.world_size) for p in parsed} == {
            (address, port, name, world)
        }
        engine_ranks = sorted(p.rank_offset + k for p in parsed for k in range(tp))
        assert engine_ranks == list(range(1, world)), engine_ranks
        update = distributed_update_body(
            ["model.layers.2.mlp.gate.weight"], ["bfloat16"], [[8, 64]], name, weight_version=None, flush_cache=False
        )
        got = sglang_wheel.as_request(classes["UpdateWeightsFromDistributedReqInput"], update)
        assert (got.group_name, got.names, got.shapes, got.flush_cache, got.weight_version) == (
            name,
            ["model.layers.2.mlp.gate.weight"],
            [[8, 64]],
            False,
            None,
        )
    last = distributed_update_body(["lm_head.weight"], ["bfloat16"], [[256, 64]], "megatron-rl-7-pp0-ep0-1", "5")
    got = sglang_wheel.as_request(classes["UpdateWeightsFromDistributedReqInput"], last)
    assert (got.weight_version, got.flush_cache, got.load_format) == ("5", True, None)

    updater = sglang_wheel.source("srt/model_executor/model_runner_components/weight_updater.py").read_text()
    assert "self._model_update_group[group_name] = init_custom_process_group(" in updater
    assert "rank = rank_offset + self.tp_rank" in updater
    receives = re.findall(r"broadcast\(\s*\w+,\s*src=(\d+),\s*group=self\._model_update_group\[group_name\]", updater)
    assert receives and set(receives) == {"0"}, receives
    control = sglang_wheel.source("srt/managers/tokenizer_control_mixin.py").read_text()
    assert '("update_weights_from_distributed", UpdateWeightsFromDistributedReqOutput)' in control
    assert 'mode = spec[2] if len(spec) > 2 else "queueing"' in control


# ---- stop strings and stop tokens: the local engine ends a response where SGLang's scheduler does ----

_FINISH_METHODS = (
    "finished",
    "update_finish_state",
    "_check_vocab_boundary_finish",
    "_check_str_based_finish",
    "_locate_str_stop_finished_len",
    "_stop_match_tail_len",
    "tail_str",
    "_check_token_based_finish",
    "_cap_finished_len_at_max_new_tokens",
)
_FINISH_CLASSES = ("BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISH_LENGTH", "FINISH_ABORT")


def _sglang_request_class() -> type:
    """A class whose finish checks are SGLang 0.5.23's `Req` methods (schedule_batch.py), run as they are."""
    import ast
    import logging
    import typing
    from http import HTTPStatus

    path = "srt/managers/schedule_batch.py"
    tree = ast.parse(sglang_wheel.source(path).read_text(encoding="utf-8"))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in _FINISH_CLASSES]
    namespace = {"re": re, "logger": logging.getLogger("sglang"), "HTTPStatus": HTTPStatus}
    namespace.update(List=list, Optional=typing.Optional, Union=typing.Union)  # its source's annotations
    exec(compile(ast.Module(body=classes, type_ignores=[]), path, "exec"), namespace)
    methods = "\n".join(
        "    " + line
        for name in _FINISH_METHODS
        for line in sglang_wheel.function_source(path, name, "Req").splitlines()
    )
    exec(compile(f"class Req:\n{methods}\n", path, "exec"), namespace)
    return namespace["Req"]


def _sglang_finish(tokenizer, tokens, stops, stop_ids, max_new_tokens):
    """(output_ids through the stop, finish_reason as JSON) of SGLang's scheduler fed `tokens` one per step;
    no end-of-text token but `stop_ids` (the local requests below send ignore_eos)."""
    from types import SimpleNamespace

    req = _sglang_request_class()()
    req.sampling_params = SimpleNamespace(
        stop_strs=list(stops),
        stop_regex_strs=[],
        stop_str_max_len=max((len(tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0),
        stop_regex_max_len=0,
        stop_token_ids=set(stop_ids) or None,
        ignore_eos=False,
        max_new_tokens=max_new_tokens,
    )
    decoder = SimpleNamespace(decode=tokenizer.decode, eos_token_id=None, additional_stop_token_ids=None)
    req.tokenizer, req.eos_token_ids, req.vocab_size, req.decoded_text = decoder, None, len(tokenizer), ""
    req.output_ids, req.finished_reason, req.finished_len, req.to_finish, req.grammar = [], None, None, None, None
    for token in tokens:
        req.output_ids.append(token)
        req.update_finish_state()
        if req.finished():
            break
    return req.output_ids[: req.finished_len], req.finished_reason.to_json()


def test_stop_strings_and_tokens_end_a_local_response_where_sglang_ends_it(tmp_path) -> None:
    """A stop string completed inside a multi-character token, one spanning two tokens, a stop string and
    a stop token completed by the same token (the string wins), a stop token: the local engine's output
    ids and finish reason are those of SGLang's scheduler on the same tokens; the text is trimmed before
    the stop as SGLang's detokenizer trims it."""
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.model import load_model
    from megatron_rl.rollout.local.protocol import parse_generate
    from megatron_rl.rollout.local.server import LocalServer

    import tiny_tokenizer
    from mrl_configs import make_tiny_model

    tok = tiny_tokenizer.build_tokenizer(words=("Answer:", "wer"))
    model, info = load_model(make_tiny_model(str(tmp_path / "m"), "qwen3", seed=11, vocab_size=len(tok)))
    gen = Generator(model, info, tokenizer=tok)
    probe = GenRequest(rid="probe", input_ids=[4, 7, 8], max_new_tokens=24, temperature=0.0)
    gen.add(probe)
    while gen.has_work:
        gen.step()
    out = probe.output_ids
    pieces = [tok.decode([t]) for t in out]
    long_piece = next(i for i in range(3, len(out)) if len(pieces[i]) > 1 or i == len(out) - 1)
    cases = [
        ([pieces[4] + pieces[5]], []),  # spans two tokens
        ([pieces[long_piece][1:]], []),  # completed inside one token's text
        ([pieces[6]], [out[6]]),  # the same token completes both: the string wins
        ([], [out[5]]),
    ]
    for stops, stop_ids in cases:
        body = {"input_ids": probe.input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}
        body["sampling_params"].update(stop=stops, stop_token_ids=stop_ids, ignore_eos=True)
        (req,) = parse_generate(body, info, tok).requests
        gen.add(req)
        while gen.has_work:
            gen.step()
        want_ids, want_finish = _sglang_finish(tok, out, stops, stop_ids, 24)
        assert (req.output_ids, req.finish_reason) == (want_ids, want_finish), (stops, stop_ids)
        assert req.finish_reason["type"] == "stop" and len(req.output_ids) < len(out)
        server = LocalServer.__new__(LocalServer)
        server.tokenizer = tok
        text = server._text(req)
        full = tok.decode(req.output_ids, skip_special_tokens=True)
        if stops:
            assert text == full[: full.find(req.finish_reason["matched"])]
        else:
            assert text == tok.decode(req.output_ids[:-1], skip_special_tokens=True)
    # the match window, stop_str_max_len, is SGLang's normaliser's (the oracle above computes it the same way)
    normalize = sglang_wheel.function_source("srt/sampling/sampling_params.py", "normalize", "SamplingParams")
    assert "tokenizer.encode(stop_str, add_special_tokens=False)" in normalize
