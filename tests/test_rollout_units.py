"""Local engine pieces without HTTP: sampling, checkpoint-name mapping, payloads, batched generation."""

from __future__ import annotations

import base64
import io
import os
import pickle

import numpy as np
import pytest
import torch

from megatron_rl.rollout import wire
from megatron_rl.rollout.local.generator import Generator, GenRequest
from megatron_rl.rollout.local.model import load_model
from megatron_rl.rollout.local.sampling import sample_tokens
from megatron_rl.rollout.local.weights import CheckpointLayout, WeightUpdateError, apply_named_tensors
from megatron_rl.weight_sync import send

from mrl_configs import DENSE_FAMILIES, SIGMOID_FAMILIES, hf_config, make_tiny_model, save_random_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    out = {f: make_tiny_model(str(root / f), f, seed=3) for f in ("qwen3_moe", "mixtral", "qwen3", "qwen2")}
    for family in SIGMOID_FAMILIES + DENSE_FAMILIES:  # O(1) random weights (sigmoid: a non-zero expert bias)
        out[family] = str(save_random_hf_model(root / family, hf_config(family), seed=3))
    return out


# ---- sampling ----


def test_logprobs_are_taken_before_top_k_top_p_and_raw_for_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    temp = torch.tensor([0.5, 0.0, 2.0])
    top_p = torch.tensor([1.0, 1.0, 1.0])
    top_k = torch.tensor([1, -1, -1])
    tokens, lps = sample_tokens(logits, temp, top_p, top_k, torch.Generator().manual_seed(0))
    # row 0: top_k=1 forces token 0; its log-prob is log_softmax(logits / 0.5), not log(1)
    assert tokens[0] == 0
    assert lps[0].item() == pytest.approx(torch.log_softmax(logits[0] / 0.5, -1)[0].item(), abs=1e-6)
    # row 1: greedy = argmax with the raw log_softmax
    assert tokens[1] == 0
    assert lps[1].item() == pytest.approx(torch.log_softmax(logits[1], -1)[0].item(), abs=1e-6)
    expected = torch.log_softmax(logits[2] / 2.0, -1)[tokens[2]]
    assert lps[2].item() == pytest.approx(expected.item(), abs=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: p=0.7 keeps {0, 1} (mass before token 2 is 0.8 > 0.7)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    rows = logits.shape[0]
    tokens, _ = sample_tokens(
        logits, torch.ones(rows), torch.full((rows,), 0.7), torch.full((rows,), -1), torch.Generator().manual_seed(1)
    )
    counts = torch.bincount(tokens, minlength=4).float() / rows
    assert counts[2] == 0 and counts[3] == 0
    assert counts[0].item() == pytest.approx(0.5 / 0.8, abs=0.03)
    tokens, _ = sample_tokens(
        logits, torch.ones(rows), torch.ones(rows), torch.full((rows,), 3), torch.Generator().manual_seed(2)
    )
    counts = torch.bincount(tokens, minlength=4).float() / rows
    assert counts[3] == 0
    assert counts[2].item() == pytest.approx(0.15 / 0.95, abs=0.03)


# ---- checkpoint names <-> fused in-memory experts ----


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2", *SIGMOID_FAMILIES, "llama"])  # untied ones
def test_layout_covers_exactly_the_checkpoint_names(models, family):
    from safetensors.torch import load_file

    model, info = load_model(models[family])
    layout = CheckpointLayout(model, info.family)
    saved = load_file(os.path.join(models[family], "model.safetensors"))
    assert set(saved) == set(layout.targets)
    for name, value in saved.items():
        assert torch.equal(layout.targets[name], value), name


def test_expert_update_lands_in_the_fused_parameter(models):
    model, info = load_model(models["qwen3_moe"])
    layout = CheckpointLayout(model, info.family)
    fused = model.model.layers[1].mlp.experts
    inter = fused.down_proj.shape[2]
    up = torch.full((inter, fused.gate_up_proj.shape[2]), 0.25)
    down = torch.full(tuple(fused.down_proj.shape[1:]), -0.5)
    apply_named_tensors(
        layout,
        [("model.layers.1.mlp.experts.5.up_proj.weight", up), ("model.layers.1.mlp.experts.5.down_proj.weight", down)],
    )
    assert torch.equal(fused.gate_up_proj[5, inter:], up)  # the up half follows the gate half
    assert not torch.equal(fused.gate_up_proj[5, :inter], up)
    assert torch.equal(fused.down_proj[5], down)


def test_bad_update_names_the_tensor_and_changes_nothing(models):
    model, info = load_model(models["mixtral"])
    layout = CheckpointLayout(model, info.family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = ("model.layers.0.block_sparse_moe.experts.1.w2.weight", torch.zeros(32, 16))
    with pytest.raises(
        WeightUpdateError, match=r"'model.layers.0.self_attn.q_proj.weight': shape \[32, 31\].*\[32, 32\]"
    ):
        apply_named_tensors(layout, [good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 31))])
    with pytest.raises(WeightUpdateError, match="unknown tensor 'model.layers.0.mlp.experts.1.down_proj.weight'"):
        apply_named_tensors(layout, [good, ("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(32, 16))])
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


# ---- /update_weights_from_tensor payloads ----


def test_tensor_payload_round_trip_and_flattened_bucket():
    named = [("a.weight", torch.randn(3, 4)), ("b.weight", torch.randn(5, dtype=torch.float64).to(torch.bfloat16))]
    back = wire.deserialize_named_tensors(*send.serialize_named_tensors(named))
    assert [n for n, _ in back] == ["a.weight", "b.weight"]
    assert all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(named, back, strict=True))
    flat, meta = send.flatten_tensors(named)
    obj = wire.deserialize_named_tensors(*send.serialize_named_tensors({"flattened_tensor": flat, "metadata": meta}))
    rebuilt = wire.unflatten_tensors(obj["flattened_tensor"], obj["metadata"])
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named, rebuilt, strict=True))


def test_payload_unpickling_refuses_other_globals():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    buf = io.BytesIO()
    pickle.Pickler(buf).dump([("x", Evil())])
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        wire.deserialize_named_tensors(base64.b64encode(buf.getvalue()).decode())
    # tensors shared by file descriptor cannot reach an unrelated process: refused with a hint
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_descriptor")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("x", torch.ones(2))])
    finally:
        tmp.set_sharing_strategy(previous)
    with pytest.raises(pickle.UnpicklingError, match="file_system strategy"):
        wire.deserialize_named_tensors(buf.getvalue())


# ---- batched generation against a plain forward ----


def _check_against_forward(model, info, req: GenRequest) -> None:
    full = torch.tensor([req.input_ids + req.output_ids])
    if info.family in SIGMOID_FAMILIES:
        _check_sigmoid_against_forward(model, info, req, full)
        return
    out = model(full, output_router_logits=info.is_moe)
    temp = req.temperature if req.temperature > 0 else 1.0
    lp = torch.log_softmax(out.logits[0].float() / temp, -1)
    p = len(req.input_ids)
    expected = lp[p - 1 : -1].gather(1, torch.tensor(req.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(req.output_logprobs), expected, atol=1e-4), req.rid
    if info.is_moe:
        routed = np.concatenate(req.routed)
        assert routed.shape == (full.shape[1] - 1, info.num_layers, info.top_k)
        for j, layer in enumerate(info.moe_layers):
            logits = out.router_logits[j][:-1]
            top = torch.topk(logits, info.top_k + 1, dim=-1).values
            clear = (top[:, info.top_k - 1] - top[:, info.top_k]) > 1e-5  # skip near-ties
            ref = torch.topk(logits, info.top_k, dim=-1).indices.numpy()
            assert clear.float().mean() > 0.9
            assert (routed[clear.numpy(), layer] == ref[clear.numpy()]).all(), (req.rid, layer)


def _check_sigmoid_against_forward(model, info, req: GenRequest, full: torch.Tensor) -> None:
    """DeepSeek-V3 / GLM-4.5: log-probs as a plain forward's, and the routed experts (SGLang's
    [tokens - 1, layers, top_k]) the routers' own choice there (sigmoid + expert bias, groups)."""
    chosen: list[torch.Tensor] = []
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, o: chosen.append(o[2]))
        for i in info.moe_layers
    ]
    try:
        logits = model(full).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    temp = req.temperature if req.temperature > 0 else 1.0
    p = len(req.input_ids)
    expected = torch.log_softmax(logits / temp, -1)[p - 1 : -1].gather(1, torch.tensor(req.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(req.output_logprobs), expected, atol=1e-4), req.rid
    routed = np.concatenate(req.routed)
    assert routed.shape == (full.shape[1] - 1, info.num_layers, info.top_k)
    for j, layer in enumerate(info.moe_layers):
        ref = chosen[j][:-1].sort(dim=-1).values.numpy()
        assert (np.sort(routed[:, layer], axis=-1) == ref).all(), (req.rid, layer)
    assert not routed[:, 0].any(), "the dense first layer has no routing"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3", *SIGMOID_FAMILIES, *DENSE_FAMILIES])
def test_continuous_batching_matches_a_plain_forward(models, family):
    model, info = load_model(models[family])
    gen = Generator(model, info, max_running=4, max_prefill_tokens=64, seed=5)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [5, 6, 7], [20], [30, 31, 32, 33], [40, 41]]
    settings = [(1.0, 1.0, -1), (0.7, 1.0, 7), (1.0, 1.0, -1), (0.0, 1.0, -1), (1.3, 0.9, -1), (1.0, 0.8, 20)]
    reqs = []
    for i, (prompt, (t, p, k)) in enumerate(zip(prompts, settings, strict=True)):
        reqs.append(
            GenRequest(
                rid=str(i),
                input_ids=prompt,
                max_new_tokens=6 + 5 * i,
                temperature=t,
                top_p=p,
                top_k=k,
                return_logprob=True,
                return_routed_experts=info.is_moe,
            )
        )
    for req in reqs[:3]:
        gen.add(req)
    steps = 0
    while gen.has_work:
        gen.step()
        steps += 1
        if steps == 2:  # joins while others decode; max_running=4 makes the last ones wait for a free row
            for req in reqs[3:]:
                gen.add(req)
    for req in reqs:
        assert req.finish_reason == {"type": "length", "length": req.max_new_tokens}
        assert len(req.output_ids) == req.max_new_tokens
        _check_against_forward(model, info, req)
    greedy = reqs[3]
    ids = torch.tensor([greedy.input_ids + greedy.output_ids])
    assert (
        ids[0, 1:].tolist()[len(greedy.input_ids) - 1 :]
        == model(ids).logits[0, :-1].argmax(-1).tolist()[len(greedy.input_ids) - 1 :]
    )


def test_stop_tokens_end_generation_and_are_kept(models):
    model, info = load_model(models["qwen3"])
    probe = GenRequest(rid="probe", input_ids=[9, 8, 7], max_new_tokens=5, temperature=0.0)
    gen = Generator(model, info)
    gen.add(probe)
    while gen.has_work:
        gen.step()
    stop_at = probe.output_ids[2]
    first = probe.output_ids.index(stop_at)
    req = GenRequest(
        rid="r", input_ids=[9, 8, 7], max_new_tokens=5, temperature=0.0, stop_token_ids=frozenset([stop_at])
    )
    gen.add(req)
    while gen.has_work:
        gen.step()
    assert req.output_ids == probe.output_ids[: first + 1]
    assert req.finish_reason == {"type": "stop", "matched": stop_at}
    assert gen.cache.slots == 0  # the idle engine holds no KV memory


def test_retracted_requests_resume_with_their_tokens(models):
    """Retracted twice mid-generation (SGLang's pause mode "retract"), seeded requests, two of them the
    same prompt and so the same resumed sequence (prefilled once), end with the tokens of an uninterrupted
    run and log-probs and routing of a plain forward; spans record the version that sampled each token."""
    model, info = load_model(models["qwen3_moe"])

    def requests() -> list[GenRequest]:
        prompts = [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11], [20]]
        return [
            GenRequest(
                rid=str(i),
                input_ids=p,
                max_new_tokens=9 + i,
                temperature=1.0,
                return_logprob=True,
                return_routed_experts=True,
                sampling_seed=7 if i < 2 else i,
            )
            for i, p in enumerate(prompts)
        ]

    plain, retracted = requests(), requests()
    for reqs, retract_at in ((plain, ()), (retracted, (3, 6))):
        gen = Generator(model, info, max_running=4, max_prefill_tokens=64, seed=5)
        for req in reqs:
            gen.add(req)
        steps = 0
        while gen.has_work:
            gen.step()
            steps += 1
            if steps in retract_at:
                assert gen.retract() == 4 and not gen.running and len(gen.waiting) == 4
                gen.set_weight_version(f"v{steps}")
    for a, b in zip(plain, retracted, strict=True):
        assert b.output_ids == a.output_ids and b.retractions == 2
        assert b.finish_reason == {"type": "length", "length": b.max_new_tokens}
        _check_against_forward(model, info, b)
        # a step prefills (one token) and decodes (one more), then decodes one per step: 4 tokens after
        # step 3, and 8 after step 6 (resumed at step 4 with a prefill and a decode)
        assert b.weight_versions == [
            {"version": "default", "start": 0, "end": 4},
            {"version": "v3", "start": 4, "end": 8},
            {"version": "v6", "start": 8, "end": b.max_new_tokens},
        ]
    assert gen.cache.slots == 0


def test_token_versions_expand_sglang_spans_and_refuse_gaps():
    from megatron_rl.rollout.sglang import SGLangError, token_versions

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, "4", 5, "w", "u") == ["3", "3", "4", "4", "4"]
    assert token_versions([{"version": 0, "start": 0, "end": 0}], "0", 0, "w", "u") == []
    assert token_versions(None, "7", 3, "w", "u") == ["7"] * 3
    assert token_versions(None, None, 3, "w", "u") is None
    bad = [
        [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}],  # a gap
        [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 2, "end": 5}],  # an overlap
        [{"version": "3", "start": 0, "end": 4}],  # short of the 5 tokens
        [{"version": "3", "start": 1, "end": 5}],  # not from token 0
        [],
        [{"version": "3", "start": 0}],
        "3",
    ]
    for spans in bad:
        with pytest.raises(
            SGLangError, match=r"/generate rid=r on http://s: meta_info.weight_versions .* the 5 output"
        ):
            token_versions(spans, "3", 5, "/generate rid=r on http://s", "http://s")


def test_moe_layout_reads_the_text_sub_config_as_sglang_does(tmp_path):
    """A multimodal MoE nests its language model's config in `text_config`; SGLang shapes routed experts
    by that sub-config, so the client does too (and a dense model has no layout)."""
    import json

    from megatron_rl.rollout.engine import moe_layout

    nested = {
        "model_type": "qwen3_vl_moe",
        "vision_config": {"depth": 27, "num_hidden_layers": 27},
        "text_config": {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8},
    }
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert moe_layout(str(tmp_path)) == (48, 8)
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2})
    )
    assert moe_layout(str(tmp_path)) == (4, 2)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4}}))
    assert moe_layout(str(tmp_path)) is None


def test_close_stops_the_local_engine_even_when_the_client_or_the_loop_is_stuck(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio
    import threading

    from megatron_rl.rollout import engine as engine_module
    from megatron_rl.rollout import event_loop

    class StuckOnClose:
        routed_experts_layout = (1, 1)
        dead_reason = None
        max_retries, timeout_s, backoff_s = 0, 60.0, 0.0

        async def start(self) -> None:
            pass

        async def close(self) -> None:
            await asyncio.Event().wait()  # a session that never closes

    class Process:
        stopped = 0

        def stop(self) -> None:
            self.stopped += 1

    monkeypatch.setattr(engine_module, "CLOSE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(event_loop, "CLOSE_TIMEOUT_S", 0.05)
    loop = event_loop.RolloutLoop()
    release = threading.Event()
    process = Process()
    handle = engine_module.RolloutEngine(StuckOnClose(), loop, process)  # type: ignore[arg-type]
    try:
        with pytest.raises(TimeoutError, match="within 0 s"):
            handle.close()
        assert process.stopped == 1  # the engine's child ends all the same
        # a callback that never ends holds the loop's thread: closing the loop warns instead of hanging
        loop.loop.call_soon_threadsafe(release.wait, 60)
        loop.close()
        assert "the rollout loop's thread did not stop" in caplog.text
    finally:
        release.set()
