"""The local engine serves LoRA adapters on the routed experts of an MoE (Qwen3-MoE, Mixtral), in this
process: a one-rank actor with adapters on every target (attention, the experts' gate, up and down) writes the base, the merged model and PEFT folders of two adapters (per-expert tensors, as SGLang
takes them and the adapter sync writes them: Mixtral's targets by role, its tensors as w1, w3, w2); the engine on the base, with both adapters loaded through
peft (its fused-expert layout, `rollout.local.lora`), gives each adapter's requests the merged model's
fp32 log-probs and tokens within 1e-5, and the base's requests the base's, from one queue of mixed
requests (experts run one adapter per forward, so the generator batches one adapter at a time)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_rl.config import Config, ConfigError, LoraConfig, RolloutConfig, TrainConfig, preset

from mrl_configs import actor_of_one, layout, tiny_model

pytest.importorskip("peft")
TOLERANCE = 1e-5


@dataclasses.dataclass
class Folders:
    base: Path
    merged: dict[str, Path]  # adapter name -> the base with it merged
    adapters: dict[str, Path]  # adapter name -> its PEFT folder


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def folders(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Folders]:
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.hf_config import hf_config_from_model
    from megatron_rl.models.lora import gather_adapters, load_adapters, merged_weights
    from megatron_rl.models.lora_targets import family_module_names, sglang_target_modules
    from megatron_rl.models.peft_format import adapter_config, write_adapter_folder

    root = tmp_path_factory.mktemp(request.param)
    # every target: attention, and the routed experts' gate, up, down (Qwen3-MoE's are the defaults)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=family_module_names(request.param))
    model = dataclasses.replace(tiny_model(request.param, first_k_dense_layers=0, ffn_hidden_size=32), lora=lora)
    cfg = Config(model=model, parallel=layout(), algorithm=preset("grpo"), train=TrainConfig(seed=4))
    out = Folders(root / "base", {}, {})
    with actor_of_one(cfg) as actor:
        hf = hf_config_from_model(model)
        out.base.mkdir()
        save_hf_folder(actor.chunks, model, out.base, hf)
        shapes = gather_adapters(actor.lora)
        assert any(".experts.3." in k for k in shapes)  # per-expert adapters, as SGLang takes them
        for seed, name in enumerate(("policy-v1", "policy-v2")):
            gen = torch.Generator().manual_seed(seed)
            load_adapters(actor.lora, {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in shapes.items()})
            out.merged[name], out.adapters[name] = root / f"merged-{name}", root / name
            out.merged[name].mkdir()
            with merged_weights(actor.lora):
                save_hf_folder(actor.chunks, model, out.merged[name], hf)
            config = adapter_config(model, str(out.base), target_modules=sglang_target_modules(model))
            write_adapter_folder(out.adapters[name], gather_adapters(actor.lora), config, torch.float32)
    yield out


def _serve(folder: Path, prompts: list[list[int]], names: list[str | None], adapters: dict[str, Path]) -> list:
    """Each prompt scored and continued greedily for 4 tokens under its adapter, by the local engine on
    `folder` with `adapters` loaded."""
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.lora import read_adapter_folder
    from megatron_rl.rollout.local.model import load_model

    served, info = load_model(str(folder), dtype="float32")
    gen = Generator(served, info, max_running=8, max_prefill_tokens=256, seed=0)
    for name, path in adapters.items():
        gen.adapters.load(name, *read_adapter_folder(str(path)))
    reqs = [
        GenRequest(rid=str(i), input_ids=p, max_new_tokens=4, top_k=1, return_logprob=True, logprob_start_len=0,
                   lora_name=name)
        for i, (p, name) in enumerate(zip(prompts, names, strict=True))
    ]  # fmt: skip
    for req in reqs:
        gen.add(req)
    while gen.has_work:
        gen.step()
    return reqs


def _gap(a: list, b: list) -> float:
    """The largest log-prob difference of two runs of the same requests (their tokens must agree)."""
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids, (x.rid, x.output_ids, y.output_ids)
        mine = torch.tensor(x.input_logprobs[1:] + x.output_logprobs)
        theirs = torch.tensor(y.input_logprobs[1:] + y.output_logprobs)
        gap = max(gap, (mine - theirs).abs().max().item())
    return gap


def test_expert_adapters_served_through_peft_equal_the_merged_model(folders: Folders) -> None:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 12, 5, 9, 12, 6)]
    names: list[str | None] = ["policy-v1", None, "policy-v2", "policy-v1", "policy-v2", None]
    served = _serve(folders.base, prompts, names, folders.adapters)
    for name in ("policy-v1", "policy-v2", None):
        rows = [i for i, n in enumerate(names) if n == name]
        reference = _serve(
            folders.base if name is None else folders.merged[name], [prompts[i] for i in rows], [None] * len(rows), {}
        )
        assert _gap([served[i] for i in rows], reference) <= TOLERANCE, name
    base = _serve(folders.base, prompts[:1], [None], {})
    moved = torch.tensor(served[0].input_logprobs[1:]) - torch.tensor(base[0].input_logprobs[1:])
    assert moved.abs().max() > 1e-2  # the adapter changes the model


def test_experts_serve_one_adapter_per_forward(folders: Folders) -> None:
    """Once the experts carry adapters, a forward naming two of them is refused rather than run on their sum."""
    from megatron_rl.rollout.local.lora import LocalAdapters, read_adapter_folder
    from megatron_rl.rollout.local.model import load_model

    served, _ = load_model(str(folders.base), dtype="float32")
    adapters = LocalAdapters(served)
    assert adapters.mixes_adapters
    for name, path in folders.adapters.items():
        adapters.load(name, *read_adapter_folder(str(path)))
    assert not adapters.mixes_adapters
    with pytest.raises(RuntimeError, match="experts run one"), adapters.rows(["policy-v1", "policy-v2"]):
        pass
    adapters.unload("policy-v1")
    adapters.unload("policy-v2")
    assert not adapters.loaded


def _train_config(tmp_path: Path, **rollout: object) -> Config:
    model = dataclasses.replace(tiny_model("qwen3_moe"), lora=LoraConfig(rank=4))  # a dense first layer
    return Config(model=model, rollout=RolloutConfig(**rollout))


def test_auto_sync_resolves_to_merged_where_peft_cannot_serve(caplog: pytest.LogCaptureFixture, tmp_path) -> None:  # noqa: ANN001
    """An MoE with a dense first layer: peft puts gate/up/down on the fused experts only, so `auto` syncs
    merged weights with one info line, and an explicit `adapter` is refused naming the dense layers."""
    from megatron_rl.models.lora_targets import check_local_engine_adapters, resolve_lora_sync

    cfg = _train_config(tmp_path)
    assert cfg.rollout.lora_sync == "auto"
    with caplog.at_level(logging.INFO, logger="megatron_rl.models.lora_targets"):
        assert resolve_lora_sync(cfg).rollout.lora_sync == "merged"
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.lora_sync = merged (auto): model.lora.target_modules ['down_proj', 'gate_proj', 'up_proj'] adapt "
        "both the routed experts and the dense layers' MLP (model.first_k_dense_layers = 1, model.moe_layer_freq = "
        "1); peft puts those names on the fused experts only, so the local engine cannot serve the dense layers' "
        "adapters; full merged weights are synced"
    ]
    all_moe = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, first_k_dense_layers=0))
    assert resolve_lora_sync(all_moe).rollout.lora_sync == "adapter"
    servers = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, engine="sglang", sglang_urls=["http://127.0.0.1:1"])
    )
    assert resolve_lora_sync(servers).rollout.lora_sync == "adapter"  # SGLang serves expert adapters (>= 0.5.10)
    check_local_engine_adapters(all_moe.model)
    with pytest.raises(ConfigError, match=r"rollout.lora_sync = 'adapter' with the local engine: .* dense layers"):
        check_local_engine_adapters(cfg.model)
