"""DeepSeek sparse attention in one process: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`).

Their config.json (the Hub's) -> `model` and TransformerConfig, every refusal naming its field, the way back; the
name/shape table against what `transformers` writes and HF -> Megatron -> HF bit for bit (the indexer's tensors
included, MTP layers dropped as DeepSeek-V3's); the Megatron model on one rank against transformers' eager model:
fp32 log-probs within 1e-5, right-padded, on tiny random models whose indexer keeps 5 keys of sequences of 16 (the
sparsity moves the log-probs by ~5, so a wrong selection cannot hide); the local engine serving them, its indexer
picking the trainer's keys, and the trainer's log-probs, right-padded and packed (the selection restarting at each
sequence), against the engine's and transformers' within 1e-5, with R3 replaying the engine's routing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from presets import DEEPSEEK_V32_671B, GLM_5_744B
from safetensors.torch import load_file

from megatron_rl.config import ConfigError, LoraConfig, ParallelConfig
from megatron_rl.models.builder import transformer_config
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.import_hf import open_hf_checkpoint

from mrl_configs import (
    DSA_FAMILIES,
    hf_config,
    layout,
    megatron_names,
    save_random_hf_model,
    with_key,
)
from mrl_replay import r2_record_and_replay, r3_replay_config

_CLASSES = {"deepseek_v32": transformers.DeepseekV32Config, "glm_moe_dsa": transformers.GlmMoeDsaConfig}


def _tiny_folder(folder: Path, family: str, **overrides: Any) -> Path:
    return save_random_hf_model(folder, hf_config(family, "split", **overrides), seed=3)


def _model_of(folder: Path, **fields: Any) -> Any:
    return model_config_from_hf(json.loads((folder / "config.json").read_text()), params_dtype="fp32", **fields)


def test_hub_configs() -> None:
    v32 = model_config_from_hf(DEEPSEEK_V32_671B)
    assert (v32.family, v32.num_layers, v32.q_lora_rank, v32.rope_scaling, v32.yarn_factor) == (
        "deepseek_v32", 61, 1536, "yarn", 40.0
    )  # fmt: skip
    assert (v32.dsa_index_n_heads, v32.dsa_index_head_dim, v32.dsa_index_topk) == (64, 128, 2048)
    glm = model_config_from_hf(GLM_5_744B)
    assert (glm.family, glm.num_layers, glm.hidden_size, glm.qk_nope_head_dim, glm.v_head_dim, glm.norm_epsilon) == (
        "glm_moe_dsa", 78, 6144, 192, 256, 1e-5
    )  # fmt: skip
    assert (glm.dsa_index_n_heads, glm.dsa_index_head_dim, glm.dsa_index_topk, glm.rope_scaling) == (
        32, 128, 2048, "none"
    )  # fmt: skip
    config = transformer_config(v32, ParallelConfig(expert_model_parallel_size=8, expert_tensor_parallel_size=1))
    assert (config.experimental_attention_variant, config.dsa_indexer_n_heads, config.dsa_indexer_topk) == (
        "dsa", 64, 2048
    )  # fmt: skip
    assert not config.dsa_indexer_interleaved and transformer_config(glm, ParallelConfig()).dsa_indexer_interleaved
    assert model_config_from_hf(hf_config_from_model(v32)) == v32
    assert model_config_from_hf(hf_config_from_model(glm)) == glm


@pytest.mark.parametrize(
    ("base", "path", "value", "needle"),
    [
        (DEEPSEEK_V32_671B, "index_topk", 0, "index_topk = 0 is not an integer >= 1"),
        (DEEPSEEK_V32_671B, "index_n_heads", ..., "missing key 'index_n_heads'"),
        (DEEPSEEK_V32_671B, "q_lora_rank", None, "the indexer reads the compressed query: set model.q_lora_rank"),
        (DEEPSEEK_V32_671B, "index_head_dim", 32, "dsa_index_head_dim (32) must be >= model.qk_rope_head_dim (64"),
        (DEEPSEEK_V32_671B, "indexer_types", ["full"] * 61, "indexer_types is not handled by the deepseek_v32"),
        (DEEPSEEK_V32_671B, "layer_types", ["full_attention"] * 61, "layer_types = ['full_attention'"),
        (DEEPSEEK_V32_671B, "mlp_layer_types", ["sparse"] * 61, "contradicts first_k_dense_replace = 3"),
        (DEEPSEEK_V32_671B, "mlp_bias", True, "mlp_bias = true is not supported"),
        (DEEPSEEK_V32_671B, "indexer_rope_interleave", True, "deepseek_v32's indexer rotates the two halves"),
        (DEEPSEEK_V32_671B, "index_share_kv", True, "index_share_kv is not handled by the deepseek_v32 mapping"),
        (GLM_5_744B, "indexer_types", ["full", "shared"] * 39, "indexer_types: layer 1 is 'shared'"),
        (GLM_5_744B, "index_topk_pattern", "FFS" * 26, "indexer_types: layer 2 is 'shared'"),
        (GLM_5_744B, "index_topk_freq", 2, "indexer_types: layer 2 is 'shared'"),
        (GLM_5_744B, "indexer_types", ["full"] * 77, "is not a list of 78 of ['full', 'shared']"),
        (GLM_5_744B, "indexer_rope_interleave", False, "glm_moe_dsa's indexer rotates interleaved pairs"),
    ],
)
def test_refusals_name_the_field(base: dict[str, Any], path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(with_key(base, path, value) if value is not ... else with_key(base, path, ...))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_settings_only_the_families_have() -> None:
    """The indexer's keys belong to these families; context parallelism, SDPA, recomputing the core attention
    selectively (Megatron's MLA would call it without the indexer's inputs) and LoRA (as for DeepSeek-V3: MLA's
    projections have no adapters) are refused for them."""
    from megatron_rl.models.attention_choice import check_attention_backend
    from megatron_rl.models.families import check_family
    from megatron_rl.models.lora_targets import check_target_modules
    from megatron_rl.models.recompute_choice import check_recompute

    from mrl_configs import tiny_sigmoid_model

    with pytest.raises(ConfigError, match=r"'deepseek_v3' has no model.dsa_index_topk \(only deepseek_v32"):
        check_family(dataclasses.replace(tiny_sigmoid_model("deepseek_v3"), dsa_index_topk=4))
    model = model_config_from_hf(GLM_5_744B)
    with pytest.raises(ConfigError, match="has DeepSeek sparse attention: set model.dsa_index_topk"):
        check_family(dataclasses.replace(model, dsa_index_topk=None))
    for te in (False, True):
        with pytest.raises(ConfigError, match="parallel.context_parallel_size = 2: model.family = 'glm_moe_dsa' has"):
            check_attention_backend(model, layout(tp=8, cp=2), transformer_engine=te)
    with pytest.raises(ConfigError, match="core_attn cannot be recomputed here: Megatron-Core 0.16.1's MLA recomputes"):
        check_recompute(dataclasses.replace(model, recompute="selective"))
    check_recompute(dataclasses.replace(model, recompute="selective", recompute_modules=["moe"]))
    with pytest.raises(ConfigError, match="LoRA is not available for model.family = 'glm_moe_dsa'"):
        check_target_modules(dataclasses.replace(model, lora=LoraConfig(rank=4)))
    with pytest.raises(ConfigError, match="model.attention_backend = sdpa: .* has DeepSeek sparse attention"):
        check_attention_backend(
            dataclasses.replace(model, attention_backend="sdpa"), layout(), transformer_engine=False
        )


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_config_round_trip_and_table_match_what_transformers_writes(tmp_path: Path, family: str) -> None:
    """transformers' config.json gives the model and comes back; save_pretrained's names and shapes (the indexer's
    wq_b, wk, k_norm weight and bias, weights_proj) are the mapping's table; every tensor converts to Megatron and
    back bit for bit."""
    folder = _tiny_folder(tmp_path / "hf", family)
    saved = json.loads((folder / "config.json").read_text())
    model = _model_of(folder)
    assert (model.dsa_index_n_heads, model.dsa_index_head_dim, model.dsa_index_topk) == (8, 10, 5)
    assert model_config_from_hf(hf_config_from_model(model), params_dtype="fp32") == model
    again = _CLASSES[family](**{k: v for k, v in hf_config_from_model(model).items() if k != "model_type"})
    assert again.index_topk == saved["index_topk"] and again.layer_types == saved["layer_types"]
    mapping = HFMapping(model)
    original = load_file(folder / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in original.items()} == mapping.checkpoint_shapes()
    assert mapping.checkpoint_shapes()["model.layers.2.self_attn.indexer.wq_b.weight"] == (80, 22)
    ckpt = open_hf_checkpoint(str(folder), model)
    for name in megatron_names(mapping):
        hf_names = mapping.hf_names(name)
        shape = list(ckpt.shapes[hf_names[0]])
        if len(hf_names) > 1:
            shape[0] = sum(ckpt.shapes[n][0] for n in hf_names)
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            shape[0] = 384  # Megatron's padded vocabulary
        for hf_name, tensor in mapping.to_hf(name, mapping.to_megatron(name, ckpt.read, shape)):
            assert torch.equal(ckpt.read(hf_name), tensor), hf_name


def _hf_model(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_megatron_forward_equals_transformers_and_exports_the_checkpoint(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank, local spec, fp32, two rows of 16 tokens whose queries keep 5 keys each: log-probs within 1e-5 of
    transformers' (its MLA latent norms at rms_norm_eps, as Megatron, SGLang and the local engine compute them),
    which move by far more with every key kept; the indexer is frozen; the exporter writes the checkpoint back bit
    for bit; in blocks of 5 queries the same; the near-tie share of the selections is counted once (all of them with
    every score 0)."""
    from megatron_rl.models import dsa_attention
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.dsa_attention import take_near_ties
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.import_hf import load_hf_weights
    from megatron_rl.parallel import init_distributed
    from megatron_rl.rollout.local.model import latent_norms_at_rms_norm_eps

    from mrl_configs import launch_of_one
    from mrl_multiproc.model_helpers import forward_logits

    folder = _tiny_folder(tmp_path / "hf", family)
    model = _model_of(folder)
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out = tmp_path / "out"
    out.mkdir()
    with launch_of_one():
        init_distributed(layout(), model)
        chunks = build_model(model, layout(), use_transformer_engine=False)
        indexer = [p for n, p in chunks[0].named_parameters() if ".indexer." in n]
        assert len(indexer) == 5 * model.num_layers and not any(p.requires_grad for p in indexer)
        load_hf_weights(chunks, model, open_hf_checkpoint(str(folder), model))
        logp = forward_logits(chunks, ids, model.vocab_size).log_softmax(-1)
        save_hf_folder(chunks, model, out, hf_config_from_model(model))
        monkeypatch.setattr(dsa_attention, "QUERY_CHUNK", 5)  # blocks of 5, 5, 5 and 1 queries: the same
        assert (forward_logits(chunks, ids, model.vocab_size).log_softmax(-1) - logp).abs().max() <= 1e-5
        near = take_near_ties(chunks)["indexer_near_tie_frac"]  # of 2 rows x 11 queries with > 5 keys x 4 layers
        assert 0 <= near < 0.1 and take_near_ties(chunks) == {}, near  # counted once (both forwards)
        for weights in (p for n, p in chunks[0].named_parameters() if n.endswith("indexer.linear_weights_proj.weight")):
            weights.data.zero_()  # every score 0: every contested selection a tie
        forward_logits(chunks, ids, model.vocab_size)
        assert take_near_ties(chunks) == {"indexer_near_tie_frac": 1.0}
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reference = _hf_model(folder)
    with torch.no_grad():
        as_is = reference(input_ids=ids).logits.log_softmax(-1)
        latent_norms_at_rms_norm_eps(reference, model.norm_epsilon)  # as the local engine serves it
        expected = reference(input_ids=ids).logits.log_softmax(-1)
        gap = (logp - expected).abs().max().item()
        assert gap <= 1e-5, gap
        # transformers' MLA latent norms are at 1e-6 whatever rms_norm_eps (GLM-5's 1e-5) says
        assert ((as_is - expected).abs().max().item() > 2e-5) == (model.norm_epsilon != 1e-6)
        for layer in reference.model.layers:
            layer.self_attn.indexer.index_topk = 16
        moved = (reference(input_ids=ids).logits.log_softmax(-1) - expected).abs().max().item()
        assert moved > 1e-1, ("every key kept", moved)


def test_indexer_layouts_differ(tmp_path: Path) -> None:
    """The two families' indexers differ only in their RoPE layout, and it matters: DeepSeek-V3.2's weights read
    as GLM-5's (interleaved) pick other keys."""
    from megatron_rl.models.dsa_attention import _rotate

    x = torch.arange(8.0).view(1, 1, 1, 8)
    cos, sin = torch.zeros(1, 8), torch.ones(1, 8)
    assert _rotate(x, cos, sin, interleaved=False).flatten().tolist() == [-4, -5, -6, -7, 0, 1, 2, 3]
    assert _rotate(x, cos, sin, interleaved=True).flatten().tolist() == [-1, -3, -5, -7, 0, 2, 4, 6]


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_local_engine_serves_it_and_the_trainer_picks_its_keys(tmp_path: Path, family: str) -> None:
    """The local engine serves the family through transformers (its indexer's keys cached with the latents), its
    weight-update names are the checkpoint's, the routed experts it returns (SGLang's layout [tokens - 1, layers,
    top_k]) are its routers' own. Sequences of 10 to 19 tokens, each query keeping 5 keys: the trainer (one rank)
    picks the keys transformers' indexer picks in a plain forward of each sequence, and gives the sampled tokens
    the engine's log-probs and transformers' within 1e-5, right-padded and packed (the selection restarting at each
    sequence of the pack), recording the routing (R2: the engine's) and replaying it, replaying the engine's (R3)."""
    import numpy as np

    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.micro_batches import TokenBudget
    from megatron_rl.models.dsa_attention import LightningIndexer
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.model import load_model
    from megatron_rl.rollout.local.weights import CheckpointLayout

    from mrl_configs import actor_log_probs, actor_of_one

    folder = _tiny_folder(tmp_path / "hf", family)
    served, info = load_model(str(folder))
    assert (info.family, info.moe_layers, info.indexer_dim, info.num_kv_heads) == (family, (1, 2, 3), 10, 1)
    assert set(CheckpointLayout(served, info.family).targets) == set(load_file(folder / "model.safetensors"))
    gen = Generator(served, info, max_running=3, max_prefill_tokens=64, seed=5)
    prompts = ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17])
    reqs = [
        GenRequest(rid=str(i), input_ids=p, max_new_tokens=6 + 3 * i, temperature=1.0, top_p=1.0, top_k=-1,
                   return_logprob=True, return_routed_experts=True)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    for req in reqs:
        gen.add(req)
    while gen.has_work:
        gen.step()
    tokens = [torch.tensor(r.input_ids + r.output_ids) for r in reqs]
    assert [len(t) for t in tokens] == [10, 11, 19]
    routed = [torch.from_numpy(np.concatenate(r.routed)) for r in reqs]
    reference, picked = [], []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, a, o: picked.append(o)) for layer in served.model.layers
    ]
    for prompt, ids, experts in zip(prompts, tokens, routed, strict=True):
        with torch.no_grad():
            logits = served(ids[None]).logits[0].log_softmax(-1)
        reference.append(logits[len(prompt) - 1 : -1].gather(1, ids[len(prompt) :, None])[:, 0])
        assert experts.shape == (len(ids) - 1, 4, info.top_k)  # every layer's row (the dense one's unused)
    for hook in hooks:
        hook.remove()
    cfg = r3_replay_config(folder)
    batch = ActorBatch(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], advantages=[torch.tensor(1.0) for _ in prompts]
    )
    engine = [torch.tensor(r.output_logprobs) for r in reqs]
    kept: list[torch.Tensor] = []
    with actor_of_one(cfg) as actor:
        indexers = [m for m in actor.state.model[0].modules() if isinstance(m, LightningIndexer)]
        hooks = [m.register_forward_hook(lambda m, a, o: kept.append(o)) for m in indexers]
        packed = actor_log_probs(actor, batch, TokenBudget(64, packed=True)).log_probs
        for hook in hooks:
            hook.remove()
        padded = actor_log_probs(actor, batch, TokenBudget(64)).log_probs
        recorded, r2 = r2_record_and_replay(actor, batch, routed, moe_layers=slice(1, None))
        replayed = actor_log_probs(
            actor, batch.with_fields(routed_experts=routed), TokenBudget(40, packed=True), "replay"
        ).log_probs
        before = actor.full_params()
        history = actor.train(batch.with_fields(old_log_probs=padded, routed_experts=routed))
        after = actor.full_params()
    # one RL step: the indexer stays as loaded (frozen), the rest moves; the near-tie share is reported
    assert 0 <= history[-1]["indexer_near_tie_frac"] < 0.1
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and not any(".indexer." in n for n in moved)
    assert "decoder.layers.1.self_attention.linear_q_up_proj.weight" in moved
    # the packed forward ran each sequence's selection alone, layer by layer: the keys transformers' indexer picked
    # kept: layer by layer, the pack's sequences in its order; picked: sequence by sequence (told apart by length)
    assert len(kept) == len(picked) == 3 * 4
    theirs_of = {(int(p.shape[1]), i % 4): p for i, p in enumerate(picked)}
    for i, mine in enumerate(kept):
        theirs = theirs_of[(int(mine.shape[1]), i // 3)]
        want = torch.zeros_like(mine).scatter_(-1, theirs.long(), True) & mine.new_ones(mine.shape).tril()
        assert torch.equal(mine, want)
        assert int(mine[0, -1].sum()) == 5  # the last query keeps 5 of its 10 to 19 keys
    runs = (("padded", padded), ("packed", packed), ("R2 record, packed", recorded), ("R2 replay, padded", r2),
            ("R3 replay, packed", replayed))  # fmt: skip
    for name, got in runs:
        for against, want in (("engine", engine), ("transformers", reference)):
            gap = max((g - e).abs().max().item() for g, e in zip(got, want, strict=True))
            assert gap <= 1e-5, (name, against, gap)
