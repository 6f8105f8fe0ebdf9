"""The local engine as a subprocess, driven by the SGLang client: generation, log-probs, routed
experts, abort/pause, auth and validation, the three weight-update paths, and faults."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from mrl_engine import FakeEngine, on_loop, rollout_loop
from safetensors.torch import load_file, save_file

from megatron_rl.parallel.launch import free_port
from megatron_rl.rollout import wire
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.local.launcher import start_local_engine
from megatron_rl.rollout.sglang import BadRequestError, SGLangClient, SGLangError, UnauthorizedError
from megatron_rl.rollout.types import Sample, SamplingParams
from megatron_rl.weight_sync import send

from mrl_configs import make_tiny_model

KEY = "secret-key"
ENV = {"OMP_NUM_THREADS": "1"}
LONG = {"max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(str(root / name), "qwen3_moe", seed=i, **LONG) for i, name in enumerate("ABCD")}


@pytest.fixture(scope="module")
def engine(models):
    proc = start_local_engine(models["A"], api_key=KEY, extra_args=["--threads", "1"], env=ENV)
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def engine_serves_model_a(request: pytest.FixtureRequest):
    """Every test finds the module's engine serving model A at its start version ("default"): a test that
    updated its weights has them put back, so the tests hold in any order."""
    yield
    if "engine" not in request.fixturenames:
        return
    engine, models = request.getfixturevalue("engine"), request.getfixturevalue("models")

    async def restore() -> None:
        async with client_for(engine.url) as client:
            await client.update_weights_from_disk(models["A"], weight_version="default")

    asyncio.run(restore())


def client_for(*urls: str, **kwargs) -> SGLangClient:
    kwargs.setdefault("api_key", KEY)
    kwargs.setdefault("routed_experts_layout", (2, 2))
    return SGLangClient(list(urls), **kwargs)


async def until_state(client: SGLangClient, url: str, predicate, timeout_s: float = 120.0) -> None:
    """Poll the engine's scheduler state (/get_server_info: running, waiting, paused) until `predicate`
    holds (a hang guard of `timeout_s`)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate((await client._json("GET", "/get_server_info", server=url))["internal_states"][0]):
        assert asyncio.get_running_loop().time() < deadline, f"engine {url}: state not reached in {timeout_s} s"
        await asyncio.sleep(0.01)


def running(state: dict) -> bool:
    return state["running"] >= 1  # prefilled: it has sampled a token


_REFERENCE: dict[str, torch.nn.Module] = {}


def reference(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path not in _REFERENCE:
        _REFERENCE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _REFERENCE[path]


@torch.no_grad()
def check_sample(
    sample: Sample, model_path: str, temperature: float, routed: bool = True, tokens: slice = slice(None)
) -> None:
    """The engine's log-probs (of the output `tokens`) and routed experts equal a plain forward of
    prompt + response."""
    model = reference(model_path)
    ids = torch.tensor([sample.prompt_ids + sample.output_ids])
    out = model(ids, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float() / (temperature or 1.0), -1)
    p = len(sample.prompt_ids)
    expected = lp[p - 1 : -1].gather(1, torch.tensor(sample.output_ids)[:, None])[:, 0]
    assert len(sample.logprobs) == len(sample.output_ids)
    assert (torch.tensor(sample.logprobs)[tokens] - expected[tokens]).abs().max().item() <= 1e-4
    if routed:
        assert sample.routed_experts.shape == (ids.shape[1] - 1, 2, 2)
        for layer, logits in enumerate(out.router_logits):
            logits = logits[:-1]
            top = torch.topk(logits, 3, dim=-1).values
            clear = ((top[:, 1] - top[:, 2]) > 1e-5).numpy()  # near-ties may flip between batchings
            assert clear.mean() >= 0.75  # the comparison below covers most tokens
            ref = torch.topk(logits, 2, dim=-1).indices.numpy()
            assert (sample.routed_experts[clear, layer] == ref[clear]).all()


@pytest.mark.e2e
def test_generate_logprobs_routed_experts_and_finish(engine, models):
    settings = [
        SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True),
    ]
    prompts = [[5, 6, 7, 8]] * 4 + [[9, 10], [11, 12, 13, 14, 15, 16, 17], [3]]

    async def go():
        async with client_for(engine.url) as client:
            jobs = [client.generate(p, settings[i % 3], return_routed_experts=True) for i, p in enumerate(prompts)]
            return await asyncio.gather(*jobs)

    samples = asyncio.run(go())
    for i, sample in enumerate(samples):
        params = settings[i % 3]
        assert sample.prompt_ids == prompts[i]
        assert sample.finish_reason == "length" and len(sample.output_ids) == params.max_new_tokens
        assert sample.weight_version == "default" and sample.server == engine.url
        check_sample(sample, models["A"], params.temperature)
    greedy = samples[2]
    logits = reference(models["A"])(torch.tensor([greedy.prompt_ids + greedy.output_ids])).logits[0]
    assert greedy.output_ids == logits[len(greedy.prompt_ids) - 1 : -1].argmax(-1).tolist()

    # a stop token ends generation at its first occurrence and is kept in output_ids
    stop = greedy.output_ids[3]

    async def stopped():
        async with client_for(engine.url) as client:
            params = SamplingParams(temperature=0.0, max_new_tokens=7, stop_token_ids=(stop,), ignore_eos=True)
            return await client.generate(greedy.prompt_ids, params, return_routed_experts=True)

    sample = asyncio.run(stopped())
    first = greedy.output_ids.index(stop)
    assert sample.output_ids == greedy.output_ids[: first + 1]
    assert sample.finish_reason == "stop" and sample.matched_stop == stop
    assert sample.routed_experts.shape[0] == len(sample.prompt_ids) + first


@pytest.mark.e2e
def test_abort_pause_and_continue(engine):
    long = SamplingParams(temperature=1.0, max_new_tokens=3000, ignore_eos=True)

    async def go():
        async with client_for(engine.url) as client:
            job = asyncio.ensure_future(client.generate([4, 5, 6], long, rid="long-1"))
            await until_state(client, engine.url, running)
            await client.abort_request(rid="long")  # a prefix of the rid
            aborted = await job
            job = asyncio.ensure_future(client.generate([4, 5, 6], long))
            await until_state(client, engine.url, running)
            await client.pause_generation(mode="abort")
            paused_out = await job
            waiting = asyncio.ensure_future(client.generate([7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True)))
            await until_state(client, engine.url, lambda state: state["waiting"] == 1)  # it reached the engine
            still_waiting = not waiting.done()
            await client.continue_generation()
            return aborted, paused_out, still_waiting, await waiting

    aborted, paused_out, still_waiting, resumed = asyncio.run(go())
    for sample in (aborted, paused_out):
        assert sample.finish_reason == "abort" and 0 < len(sample.output_ids) < 3000
        assert len(sample.logprobs) == len(sample.output_ids)
    assert still_waiting, "a request sent while paused must wait for /continue_generation"
    assert resumed.finish_reason == "length" and len(resumed.output_ids) == 5

    async def memory():
        async with client_for(engine.url) as client:
            await client.release_memory_occupation()
            with pytest.raises(BadRequestError, match="memory is released"):
                await client.generate([7, 8], SamplingParams(max_new_tokens=2))
            await client.resume_memory_occupation(["weights", "kv_cache"])
            return await client.generate([7, 8], SamplingParams(max_new_tokens=2, ignore_eos=True))

    assert len(asyncio.run(memory()).output_ids) == 2


@pytest.mark.e2e
def test_api_key_and_malformed_requests(engine, caplog):
    async def go():
        async with aiohttp.ClientSession() as session:
            for path, method in [("/generate", "POST"), ("/health", "GET"), ("/update_weights_from_disk", "POST")]:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    async with session.request(method, engine.url + path, json={}, headers=headers) as r:
                        assert r.status == (200 if path == "/health" else 401), (path, headers)  # SGLang's rule
            auth = {"Authorization": f"Bearer {KEY}"}
            async with session.post(engine.url + "/generate", data=b"{not json", headers=auth) as r:
                assert r.status == 400 and "body: not valid JSON" in (await r.json())["error"]["message"]
            bad = {"input_ids": [1, 2], "sampling_params": {"top_p": 2.0}}
            async with session.post(engine.url + "/generate", json=bad, headers=auth) as r:
                assert r.status == 400 and "sampling_params.top_p" in (await r.json())["error"]["message"]
            bad = {"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"temprature": 1}]}
            async with session.post(engine.url + "/generate", json=bad, headers=auth) as r:
                assert "sampling_params[1].temprature: unknown" in (await r.json())["error"]["message"]
            async with session.post(
                engine.url + "/update_weights_from_disk", json={"model_path": 3}, headers=auth
            ) as r:
                assert r.status == 400 and "model_path: expected str" in (await r.json())["error"]["message"]
        async with client_for(engine.url, api_key="wrong") as client:
            with pytest.raises(UnauthorizedError, match="401"):
                await client.generate([1, 2], SamplingParams(max_new_tokens=2))
        async with client_for(engine.url, max_retries=3, backoff_s=5.0) as client:
            with pytest.raises(BadRequestError, match=r"input_ids: token 999 is not an integer in \[0, 128\)"):
                await client.generate([1, 999], SamplingParams(max_new_tokens=2))

    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.sglang"):
        asyncio.run(go())
    assert not [r.getMessage() for r in caplog.records if "; try " in r.getMessage()]  # a 400 is not retried


def _checkpoint(path: str) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(os.path.join(path, "model.safetensors")).items())


@pytest.mark.e2e
def test_weight_updates_from_disk_tensor_and_distributed(engine, models, tmp_path):
    params = SamplingParams(temperature=0.9, max_new_tokens=8)
    prompts = [[5, 6, 7], [20, 21, 22, 23]]

    async def generate(client) -> list[Sample]:
        return await client.generate_batch(prompts, params, return_routed_experts=True)

    def serves(samples: list[Sample], path: str, version: str) -> None:
        for sample in samples:
            assert sample.weight_version == version
            check_sample(sample, path, params.temperature)

    async def go():
        async with client_for(engine.url) as client:
            await client.update_weights_from_disk(models["B"], weight_version="v-disk")
            serves(await generate(client), models["B"], "v-disk")

            named = _checkpoint(models["C"])
            payload, shm = send.serialize_named_tensors(named)
            # as SGLang >= 0.5.21: tensor and distributed updates only inside a weight-update session
            with pytest.raises(BadRequestError, match=r"must run between begin_weight_update\(\) and end_weight_"):
                await client.update_weights_from_tensor([payload], weight_version="no-session", shm_names=shm)
            assert await client.begin_weight_update() == [True]
            await client.update_weights_from_tensor([payload], weight_version="v-tensor", shm_names=shm)
            serves(await generate(client), models["C"], "v-tensor")

            port = free_port()
            joining = asyncio.ensure_future(client.init_weights_update_group("127.0.0.1", port, 2, backend="gloo"))
            group = await asyncio.to_thread(wire.init_weights_update_group, "127.0.0.1", port, 0, 2)
            await joining
            for source, version, flat in (("D", "v-dist", False), ("A", "v-flat", True)):
                named = _checkpoint(models[source])
                names, dtypes, shapes = send.tensor_specs(named)
                reply = asyncio.ensure_future(
                    client.update_weights_from_distributed(
                        names, dtypes, shapes, weight_version=version, flattened_bucket=flat
                    )
                )
                await asyncio.to_thread(send.broadcast_named_tensors, group, named, flat, reply)
                await reply
                serves(await generate(client), models[source], version)

            # rejected updates name the tensor and leave model A serving
            wrong = [("model.layers.0.mlp.experts.3.up_proj.weight", torch.zeros(16, 31))]
            with pytest.raises(
                BadRequestError, match=r"up_proj.weight': shape \[16, 31\] does not match the model's \[16, 32\]"
            ):
                payload, shm = send.serialize_named_tensors(wrong)
                await client.update_weights_from_tensor([payload], weight_version="bad", shm_names=shm)
            names, dtypes, shapes = send.tensor_specs([("model.layers.0.mlp.experts.3.up.weight", torch.zeros(16, 32))])
            reply = asyncio.ensure_future(
                client.update_weights_from_distributed(names, dtypes, shapes, weight_version="bad")
            )
            await asyncio.to_thread(send.broadcast_named_tensors, group, [("x", torch.zeros(16, 32))], False, reply)
            with pytest.raises(BadRequestError, match="unknown tensor 'model.layers.0.mlp.experts.3.up.weight'"):
                await reply
            broken = dict(_checkpoint(models["B"]))
            broken["model.norm.weight"] = torch.ones(7)
            save_file(broken, str(tmp_path / "model.safetensors"))
            with pytest.raises(
                BadRequestError, match=r"'model.norm.weight': shape \[7\] does not match the model's \[32\]"
            ):
                await client.update_weights_from_disk(str(tmp_path), weight_version="bad")
            serves(await generate(client), models["A"], "v-flat")
            await client.end_weight_update()
            # outside a session the engine refuses before receiving: the broadcast ends with its error, never hangs
            named = _checkpoint(models["B"])
            reply = asyncio.ensure_future(client.update_weights_from_distributed(*send.tensor_specs(named)))
            with pytest.raises((RuntimeError, BadRequestError), match="must run between begin_weight_update"):
                await asyncio.to_thread(send.broadcast_named_tensors, group, named, False, reply, 60.0)
                await reply
            if not reply.done():
                await asyncio.gather(reply, return_exceptions=True)
            serves(await generate(client), models["A"], "v-flat")
            await client.destroy_weights_update_group()

    asyncio.run(go())


@pytest.mark.e2e
def test_colocated_engines_release_before_the_trainer_builds_its_state(engine, models):
    from megatron_rl.config import Config, RolloutConfig
    from megatron_rl.weight_sync.memory import colocated_engines_released, release_colocated_engines

    colocated = RolloutConfig(engine="sglang", sglang_urls=[engine.url], api_key=KEY, colocate=True)
    assert not release_colocated_engines(Config(rollout=dataclasses.replace(colocated, colocate=False)), rollout_loop())
    assert colocated_engines_released(Config(rollout=colocated))
    assert release_colocated_engines(Config(rollout=colocated), rollout_loop())

    async def go():
        async with client_for(engine.url) as client:
            # released: the engine takes no weights until the first sync resumes them
            with pytest.raises(BadRequestError, match="weights are released; call /resume_memory_occupation"):
                await client.update_weights_from_disk(models["A"], weight_version="released")
            await client.resume_memory_occupation()
            await client.update_weights_from_disk(models["A"], weight_version="resumed")

    asyncio.run(go())


@pytest.mark.e2e
def test_engine_killed_mid_request(engine, models):
    spare = start_local_engine(models["A"], api_key=KEY, extra_args=["--threads", "1"], env=ENV)
    params = SamplingParams(temperature=1.0, max_new_tokens=500, ignore_eos=True)
    try:

        async def go():
            async with client_for(spare.url, engine.url, backoff_s=0.1) as client:
                jobs = [asyncio.ensure_future(client.generate([4, 5, 6, i], params)) for i in range(4)]
                await until_state(client, spare.url, running)  # requests in flight on the spare
                spare.process.kill()
                return await asyncio.gather(*jobs)

        samples = asyncio.run(go())
        assert all(s.server == engine.url and len(s.output_ids) == 500 for s in samples)

        async def dead():
            async with client_for(spare.url, max_retries=1, backoff_s=0.1) as client:
                await client.generate([1, 2], params, rid="req-7")

        with pytest.raises(
            SGLangError, match=rf"POST /generate \(rid=req-7\) failed after 2 tries; last server {spare.url}"
        ):
            asyncio.run(dead())
    finally:
        spare.stop()


@pytest.mark.e2e
def test_rollout_engine_facade_starts_the_local_engine(models):
    from megatron_rl.config import RolloutConfig

    cfg = RolloutConfig(api_key=KEY, max_concurrency=8, max_retries=1)  # engine = local, no SGLang address
    rollout = RolloutEngine.from_config(cfg, rollout_loop(), models["A"], extra_args=["--threads", "1"], env=ENV)
    try:
        assert rollout.client.routed_experts_layout == (2, 2)  # read from the model's config.json
        params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
        samples = on_loop(rollout.generate([[5, 6], [5, 6]], params, return_routed_experts=True))
        assert [len(s.output_ids) for s in samples] == [4, 4]
        check_sample(samples[0], models["A"], 1.0)
        url = rollout.local_process.url
        rollout.run(rollout.client.flush_cache())
        assert rollout.run(rollout.client.health()) == {url: True}
    finally:
        rollout.close()
    assert not rollout.local_process.alive()


def test_local_engine_needs_a_model_folder():
    from megatron_rl.config import RolloutConfig

    with pytest.raises(ValueError, match="rollout.engine = local needs a model folder"):
        RolloutEngine.from_config(RolloutConfig(), rollout_loop())


@pytest.mark.e2e
def test_request_bodies_match_sglang_schema(engine, tmp_path_factory):
    api = _sglang_api_types(tmp_path_factory)
    client = client_for(engine.url)
    bodies = [
        client.generate_body([1, 2, 3], SamplingParams(), "r1"),
        client.generate_body([1], SamplingParams(temperature=0.0, top_k=5, stop_token_ids=(1, 2)), "r2", True, True),
    ]
    for body in bodies:
        api.GenerateRequest.from_json_value(body)
    with pytest.raises(api.JsonContractError):  # the schema does reject what SGLang rejects
        api.GenerateRequest.from_json_value({**bodies[0], "sampling_params": {"temprature": 1.0}})

    async def replies():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
            out = []
            for body in bodies:
                async with session.post(engine.url + "/generate", json=body) as r:
                    out.append(await r.json())
            async with session.get(engine.url + "/get_model_info") as r:
                out.append(await r.json())
            return out

    *gen_replies, info = asyncio.run(replies())
    for reply in gen_replies:
        parsed = api.GenerateResponse.from_json_value(reply)
        assert parsed.meta_info.completion_tokens == len(reply["output_ids"])
    api.GetModelInfoResponse.from_json_value(info)


def _sglang_api_types(tmp_path_factory):
    """SGLang 0.5.23's generated request schema, loaded by file path from the wheel (never committed)."""
    pytest.importorskip("msgspec", reason="msgspec is needed to load sglang's api_types.py")
    import sglang_wheel

    return sglang_wheel.load_module("api/v1/api_types.py", "sglang_api_types")


def test_routed_experts_decode_checks_the_size():
    client = client_for("http://127.0.0.1:9", routed_experts_layout=(2, 2))
    import base64

    ok = base64.b64encode(np.arange(12, dtype=np.int32).tobytes()).decode()
    assert client._decode_routed(ok, 3, "w", "u").tolist()[2] == [[8, 9], [10, 11]]
    with pytest.raises(SGLangError, match="hold 12 ids, expected 4 tokens x 2 layers x 2"):
        client._decode_routed(ok, 4, "w", "u")


@pytest.mark.e2e
def test_multi_turn_episode_is_token_in_token_out_with_routing_across_turns(engine, models):
    """Each turn is one /generate of the whole trajectory; the assembled trajectory's log-probs and
    routed experts equal a plain forward of the final token sequence (observation tokens excluded)."""
    from megatron_rl.config import EnvConfig
    from megatron_rl.envs import Environment, Observation, TurnRenderer, run_episodes

    class TokenObservations(Environment):
        def step(self, turn):
            return Observation(token_ids=[20, 21, 22]) if turn.index == 0 else Observation(done=True)

    class Engine(FakeEngine):
        async def answer(self, ids, params, routed):
            async with client_for(engine.url) as client:
                return await client.generate(ids, params, return_routed_experts=routed)

    class IdText:
        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in rows]

    cfg = EnvConfig(max_turns=2)
    row = type("Row", (), {"input_ids": (5, 6, 7, 8)})()
    vocab = json.loads((Path(models["A"]) / "config.json").read_text())["vocab_size"]
    every_token = tuple(range(vocab))  # turn 0 stops at its first token (finish "stop"), turn 1 runs 6 tokens

    def params(turn: int, i: int) -> SamplingParams:
        stop = every_token if turn == 0 else ()
        return SamplingParams(
            temperature=1.0, max_new_tokens=6, stop_token_ids=stop, ignore_eos=turn == 1, sampling_seed=turn
        )

    eng = Engine()
    (traj,) = on_loop(
        run_episodes(
            eng, [TokenObservations(cfg)], [row], params, TurnRenderer(IdText()), cfg, return_routed_experts=True
        )
    )
    out0, out1 = traj.output_ids[:1], traj.output_ids[4:]
    assert traj.output_ids[1:4] == [20, 21, 22] and len(out1) == 6 and traj.end_reason == "length"
    assert [ids for ids, _ in eng.requests] == [[5, 6, 7, 8], [5, 6, 7, 8, *out0, 20, 21, 22]]
    assert traj.loss_mask == [True] + [False] * 3 + [True] * 6
    check_sample(Sample([5, 6, 7, 8], out0, traj.logprobs[:1], "stop"), models["A"], 1.0, routed=False)
    last = Sample(eng.requests[1][0], out1, traj.logprobs[4:], "length", routed_experts=traj.routed_experts)
    check_sample(last, models["A"], 1.0)  # routing of every position of the final trajectory


def _spans(sample: Sample) -> list[tuple[str, int, int]]:
    """The reply's weight-version spans, checked against the client's per-token versions."""
    spans = [(s["version"], s["start"], s["end"]) for s in sample.meta_info["weight_versions"]]
    assert sample.weight_versions == [v for v, a, b in spans for _ in range(a, b)]
    assert sample.weight_version == spans[-1][0]
    return spans


@pytest.mark.e2e
def test_partial_rollout_across_weight_updates_carries_per_token_versions(engine, models):
    """A long request keeps generating while the weights change twice under it (disk, then tensor),
    paused with mode "retract": the tokens of each span have the log-probs of a plain forward of that
    span's model over the whole sequence (the prefix is prefilled again under the new weights), and
    the routing of every position is the last model's. "in_place" keeps the request running on its old
    KV cache; "abort" returns it aborted."""
    params = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)

    async def pause_when_running(client, mode: str) -> None:
        """Once the engine runs one request (prefilled, so it has sampled a token with the weights
        now), pause generation with `mode`."""
        await until_state(client, engine.url, lambda state: state["running"] == 1)
        await client.pause_generation(mode)

    async def go():
        async with client_for(engine.url) as client:
            await client.update_weights_from_disk(models["A"], weight_version="0")
            job = asyncio.ensure_future(client.generate([4, 5, 6], params, return_routed_experts=True))
            await pause_when_running(client, "retract")
            info = await client._json("GET", "/get_server_info", server=engine.url)
            assert info["internal_states"][0] == {"running": 0, "waiting": 1, "paused": True}
            await client.flush_cache()  # retracted requests hold no cache (SGLang flushes here too)
            await client.update_weights_from_disk(models["B"], weight_version="1", abort_all_requests=False)
            await client.continue_generation()
            await pause_when_running(client, "retract")
            assert await client.begin_weight_update() == [True]
            payload, shm = send.serialize_named_tensors(_checkpoint(models["C"]))
            await client.update_weights_from_tensor(
                [payload], weight_version="2", abort_all_requests=False, shm_names=shm
            )
            await client.end_weight_update()
            await client.continue_generation()
            partial = await job

            job = asyncio.ensure_future(client.generate([7, 8], params))
            await pause_when_running(client, "in_place")
            await client.update_weights_from_disk(models["A"], weight_version="3", abort_all_requests=False)
            info = await client._json("GET", "/get_server_info", server=engine.url)
            assert info["internal_states"][0]["running"] == 1  # kept in place with its KV cache
            with pytest.raises(BadRequestError, match="Cache not flushed"):
                await client.flush_cache()
            await client.continue_generation()
            in_place = await job

            job = asyncio.ensure_future(client.generate([9, 10], params))
            await pause_when_running(client, "abort")
            aborted = await job
            await client.continue_generation()
            return partial, in_place, aborted

    partial, in_place, aborted = asyncio.run(go())
    assert partial.finish_reason == "length" and len(partial.output_ids) == 400
    assert partial.meta_info["num_retractions"] == 2
    spans = _spans(partial)
    assert [v for v, _, _ in spans] == ["0", "1", "2"] and all(a < b for _, a, b in spans)
    for (_, start, end), model in zip(spans, "ABC", strict=True):
        check_sample(partial, models[model], 1.0, routed=model == "C", tokens=slice(start, end))

    assert in_place.finish_reason == "length" and in_place.meta_info["num_retractions"] == 0
    spans = _spans(in_place)
    assert [v for v, _, _ in spans] == ["2", "3"] and all(a < b for _, a, b in spans)
    check_sample(in_place, models["C"], 1.0, routed=False, tokens=slice(0, spans[0][2]))

    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 400
    assert _spans(aborted) == [("3", 0, len(aborted.output_ids))]
    check_sample(aborted, models["A"], 1.0, routed=False)


@pytest.mark.e2e
def test_begin_weight_update_waits_for_running_generations_unless_paused(engine):
    """As SGLang's /begin_weight_update (its writer lock): on a server that is not paused it answers only
    once every generation in flight has ended; on a paused one at once."""
    params = SamplingParams(temperature=1.0, max_new_tokens=60, ignore_eos=True)

    async def running(client) -> None:
        while (await client._json("GET", "/get_server_info", server=engine.url))["internal_states"][0]["running"] < 1:
            await asyncio.sleep(0.01)

    async def go():
        async with client_for(engine.url) as client:
            job = asyncio.ensure_future(client.generate([4, 5, 6], params))
            await running(client)
            begin = asyncio.ensure_future(client.begin_weight_update())
            first, _ = await asyncio.wait({job, begin}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
            ended_first = first == {job}
            opened = await asyncio.wait_for(begin, 120)
            await client.end_weight_update()
            job = asyncio.ensure_future(client.generate([4, 5, 6], params))
            await running(client)
            await client.pause_generation("retract")
            opened_paused = await asyncio.wait_for(client.begin_weight_update(), 120)
            still_running = not job.done()  # retracted: waiting in the queue, its reply not sent
            await client.end_weight_update()
            await client.continue_generation()
            return ended_first, opened, (await job).finish_reason, opened_paused, still_running

    ended_first, opened, finish, opened_paused, still_running = asyncio.run(go())
    assert ended_first, "begin_weight_update answered while a generation was running on a server not paused"
    assert opened == [True] and finish == "length"
    assert opened_paused == [True] and still_running
