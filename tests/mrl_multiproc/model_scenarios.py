"""Scenarios for tests/test_models_distributed.py (run by launcher.py, one process per rank)."""

from __future__ import annotations

import torch

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.parallel.device import local_device

from mrl_configs import SIGMOID_FAMILIES, hf_config, layout, save_random_hf_model, tiny_model, tiny_sigmoid_model
from mrl_multiproc.model_helpers import assert_close, forward_logits, reference_logits, sample_batch, setup

LOGIT_TOL = 1e-5


def hf_tolerance() -> float:
    """Megatron vs transformers, fp32: on the CPU both sum in one order; on a GPU cuBLAS picks other
    kernels for the two models' differently shaped products (1.8e-5 measured on an H200)."""
    return 5e-5 if local_device().type == "cuda" else LOGIT_TOL


def _check_full_params(chunks: list[torch.nn.Module], model: ModelConfig, seed: int = 0) -> None:
    """Gathered parameters are exactly the deterministic global tensors: every shard sits where
    Megatron's layout puts it (TP dims, SwiGLU halves, experts over EP, layers over PP)."""
    from megatron_rl.models.init import deterministic_full_tensor, gather_full_params

    full = gather_full_params(chunks, model)
    for name, value in full.items():
        expected = deterministic_full_tensor(name, tuple(value.shape), model, seed)
        if not torch.equal(value, expected):
            raise AssertionError(f"{name}: gathered tensor differs from its deterministic value")
    _check_exporter_gather(chunks, model, seed)
    layers = {name.split(".")[2] for name in full if name.startswith("decoder.layers.")}
    if layers != {str(i) for i in range(model.num_layers)}:
        raise AssertionError(f"gathered layers {sorted(layers)} != 0..{model.num_layers - 1}")


def _check_exporter_gather(chunks: list[torch.nn.Module], model: ModelConfig, seed: int) -> None:
    """The exporter's gather (`models.shard_gather`: shards received into one preallocated full tensor,
    SwiGLU halves into their blocks, row-parallel shards laid out by one strided copy) gives each
    split parameter's deterministic full tensor, padding rows included, bit for bit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.models.init import deterministic_full_tensor, iter_param_shards
    from megatron_rl.models.shard_gather import gather_full

    kinds: set[tuple[int, bool]] = set()
    for shard in iter_param_shards(chunks, model):
        if shard.partition_dim is None:
            continue
        group = ps.get_expert_tensor_parallel_group() if shard.is_expert else ps.get_tensor_model_parallel_group()
        got = gather_full(shard, group)
        if got is None:
            continue
        want = deterministic_full_tensor(shard.global_name, shard.full_shape, model, seed)
        if got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"{shard.global_name}: the exporter's gather differs from the full tensor")
        if dist.get_world_size(group) > 1:
            kinds.add((shard.partition_dim, bool(shard.sections)))
    if ps.get_tensor_model_parallel_world_size() > 1 and ps.get_tensor_model_parallel_rank() == 0:
        assert {(0, False), (0, True), (1, False)} <= kinds, kinds  # column, SwiGLU and row splits checked


def _equivalence(ctx, model: ModelConfig, parallel: ParallelConfig) -> None:  # noqa: ANN001
    ids = sample_batch(model)
    expected = reference_logits(ctx, model, ids)
    chunks = setup(model, parallel)
    _check_full_params(chunks, model)
    assert_close(forward_logits(chunks, ids, model.vocab_size), expected, LOGIT_TOL, f"logits under {parallel}")


# --- world size 1 ---------------------------------------------------------------------------


def families_match_hf(ctx) -> None:  # noqa: ANN001
    """Each family's Megatron model gives the logits of the transformers model with the same weights."""
    from megatron_rl.models.init import gather_full_params
    from megatron_rl.parallel import destroy_distributed

    from mrl_multiproc.hf_reference import hf_model, load_megatron_params

    cases = [
        tiny_model("qwen3_moe"),
        tiny_model("qwen3_moe", moe_router_norm_topk=False, moe_layer_freq=2, first_k_dense_layers=0),
        tiny_model("mixtral"),
        tiny_model("qwen3", tie_word_embeddings=True),
        tiny_model("qwen2"),
    ]
    for model in cases:
        chunks = setup(model, layout(), seed=3)
        ids = sample_batch(model, seed=1)
        logits = forward_logits(chunks, ids, model.vocab_size)
        hf = hf_model(model)
        load_megatron_params(hf, gather_full_params(chunks, model), model)
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
        assert_close(logits, expected, hf_tolerance(), f"{model.family} (norm_topk={model.moe_router_norm_topk}) vs HF")
        destroy_distributed(process_group=False)


def sigmoid_families_match_hf(ctx) -> None:  # noqa: ANN001
    """DeepSeek-V3 (MLA, yarn, grouped routing, shared experts) and GLM-4.5 (QKV biases, QK-norm, partial
    RoPE) loaded from a random transformers folder with a non-zero expert bias: the Megatron model's
    log-probs equal transformers' within 1e-5 (fp32; 5e-5 on a GPU), and the routing the bias decides matters (a zero
    bias changes the log-probs by far more)."""
    import transformers

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint
    from megatron_rl.parallel import destroy_distributed, init_distributed

    for family in SIGMOID_FAMILIES:
        folder = save_random_hf_model(ctx.shared_dir / f"hf-{family}", hf_config(family, "split"), seed=5)
        model = model_config_from_hf(read_hf_config(folder), params_dtype="fp32")
        init_distributed(layout(), model)
        chunks = build_model(model, layout())
        load_hf_weights(chunks, model, open_hf_checkpoint(str(folder), model))
        ids = sample_batch(model, seed=1)
        logp = forward_logits(chunks, ids, model.vocab_size).log_softmax(-1)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
        with torch.no_grad():
            expected = hf(input_ids=ids).logits.log_softmax(-1)
            assert_close(logp, expected, hf_tolerance(), f"{family}: Megatron vs transformers log-probs")
            for layer in hf.model.layers[model.first_k_dense_layers :]:
                layer.mlp.gate.e_score_correction_bias.zero_()
            unbiased = hf(input_ids=ids).logits.log_softmax(-1)
        gap = (unbiased - expected).abs().max().item()
        assert gap > 1e-2, f"{family}: the expert bias changes the log-probs by only {gap:.2e}"
        destroy_distributed(process_group=False)


def moe_layers_follow_pattern(ctx) -> None:  # noqa: ANN001
    """first_k_dense_layers and moe_layer_freq decide which layers have a router."""
    from megatron_rl.models.families import moe_layer_pattern

    model = tiny_model("qwen3_moe", num_layers=4, first_k_dense_layers=1, moe_layer_freq=2)
    assert moe_layer_pattern(model) == [0, 1, 0, 1], moe_layer_pattern(model)
    chunks = setup(model, layout())
    routed = [hasattr(layer.mlp, "router") for layer in chunks[0].decoder.layers]
    assert routed == [False, True, False, True], routed


def routing_replay_instances(ctx) -> None:  # noqa: ANN001
    """With routing replay every router registers one RouterReplay; a rebuild does not accumulate them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_rl.models.builder import build_model

    model, parallel = tiny_model("qwen3_moe"), layout()
    chunks = setup(model, parallel, enable_routing_replay=True)
    moe_layers = sum(hasattr(layer.mlp, "router") for layer in chunks[0].decoder.layers)
    assert moe_layers == 3 and len(RouterReplay.global_router_replay_instances) == 3
    assert chunks[0].config.moe_enable_routing_replay
    build_model(model, parallel, enable_routing_replay=True)
    assert len(RouterReplay.global_router_replay_instances) == 3
    build_model(model, parallel)
    assert len(RouterReplay.global_router_replay_instances) == 0


def recompute_same_gradients(ctx) -> None:  # noqa: ANN001
    """Full recompute changes neither the logits nor any gradient (the device mode is re-entered in backward)."""
    grads = []
    for recompute in (False, True):
        model = tiny_model("qwen3_moe", recompute=recompute)
        chunks = setup(model, layout())
        assert chunks[0].config.recompute_granularity == ("full" if recompute else None)
        ids = sample_batch(model).to(local_device())
        logits = chunks[0](ids, torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids), None)
        (logits[..., : model.vocab_size] ** 2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in chunks[0].named_parameters()})
        from megatron_rl.parallel import destroy_distributed

        destroy_distributed(process_group=False)
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad, 1e-6, f"grad of {name} with recompute")


def bf16_params(ctx) -> None:  # noqa: ANN001
    """params_dtype = bf16 builds every parameter (norms included) in bf16, close to the fp32 model."""
    model = tiny_model("qwen3_moe", params_dtype="bf16")
    chunks = setup(model, layout())
    dtypes = {p.dtype for p in chunks[0].parameters()}
    assert dtypes == {torch.bfloat16}, dtypes
    ids = sample_batch(model)
    logits = forward_logits(chunks, ids, model.vocab_size)
    expected = reference_logits(ctx, tiny_model("qwen3_moe"), ids)
    scale = expected.abs().mean().item()
    err = (logits - expected).abs().mean().item()
    assert err < 0.05 * scale, f"bf16 mean abs error {err:.3e} vs logit scale {scale:.3e}"


# --- world size 2 ---------------------------------------------------------------------------


def logits_tp2_sp(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe"), layout(tp=2, sp=True))


def logits_tp2_dense_qwen2(ctx) -> None:  # noqa: ANN001
    """Dense TP without SP, with the QKV bias split over TP."""
    _equivalence(ctx, tiny_model("qwen2"), layout(tp=2, sp=False))


def logits_ep2_alltoall(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe", moe_token_dispatcher="alltoall"), layout(ep=2))


def logits_ep2_allgather(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe", moe_token_dispatcher="allgather"), layout(ep=2))


def logits_pp2(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe"), layout(pp=2))


def logits_pp2_tied(ctx) -> None:  # noqa: ANN001
    """Tied embeddings across stages: the last stage's output layer holds the first stage's embedding."""
    _equivalence(ctx, tiny_model("qwen3", tie_word_embeddings=True), layout(pp=2))


def values_tp2_sp_pp2(ctx) -> None:  # noqa: ANN001
    """The critic's value model (deterministic backbone, seeded head) under TP 2 with sequence parallelism (the
    head's values gathered over TP) and under PP 2 (the head on the last stage) gives the one-rank values."""
    from megatron_rl.critic.value_model import build_value_model, value_initializer
    from megatron_rl.parallel import destroy_distributed, init_distributed

    model = tiny_model("qwen3_moe")
    ids = sample_batch(model)
    values = []
    for parallel in (layout(), layout(tp=2, sp=True), layout(pp=2)):
        init_distributed(parallel, model)
        chunks = build_value_model(model, parallel)
        value_initializer(model, seed=3)(chunks)
        values.append(forward_logits(chunks, ids, 1)[..., 0])
        destroy_distributed(process_group=False)
    assert values[0].shape == ids.shape and float(values[0].std()) > 1e-3, values[0]
    assert_close(values[1], values[0], LOGIT_TOL, "values under TP 2 with SP")
    assert_close(values[2], values[0], LOGIT_TOL, "values under PP 2")


def _sigmoid_equivalence(ctx, parallel: ParallelConfig, dispatchers: tuple[str, str] = ("alltoall",) * 2) -> None:  # noqa: ANN001
    """`_equivalence` for each sigmoid-router family (deterministic weights: a non-zero expert bias)."""
    from megatron_rl.parallel import destroy_distributed

    for family, dispatcher in zip(SIGMOID_FAMILIES, dispatchers, strict=True):
        _equivalence(ctx, tiny_sigmoid_model(family, moe_token_dispatcher=dispatcher), parallel)
        destroy_distributed(process_group=False)


def logits_sigmoid_tp2_sp(ctx) -> None:  # noqa: ANN001
    """MLA's column-parallel down projections (gathered, then scattered back under SP), GLM's split QKV biases."""
    _sigmoid_equivalence(ctx, layout(tp=2, sp=True))


def logits_sigmoid_ep2(ctx) -> None:  # noqa: ANN001
    """Grouped, biased routing with experts (and their groups) split over EP; both dispatchers."""
    _sigmoid_equivalence(ctx, layout(ep=2), ("alltoall", "allgather"))


def logits_sigmoid_pp2(ctx) -> None:  # noqa: ANN001
    _sigmoid_equivalence(ctx, layout(pp=2))


def bad_layouts_fail_before_build(ctx) -> None:  # noqa: ANN001
    """Impossible layouts raise ConfigError naming the keys, and leave no parallel state behind."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import init_distributed

    cases = [
        (
            layout(tp=4),
            tiny_model("qwen3_moe", num_attention_heads=8, num_query_groups=4),
            "world size 2 is not divisible by parallel.tensor_model_parallel_size (4)",
        ),
        (layout(ep=2, etp=2), tiny_model("qwen3_moe"), "parallel.expert_model_parallel_size (2)"),
        (layout(ep=3), tiny_model("qwen3_moe", num_experts=6), "world size 2 is not divisible"),
        (layout(ep=2), tiny_model("qwen3_moe", num_experts=3), "must divide model.num_experts (3)"),
        (
            layout(tp=2),
            tiny_model("qwen3_moe", num_attention_heads=3, num_query_groups=1),
            "must divide model.num_attention_heads (3)",
        ),
    ]
    for parallel, model, needle in cases:
        try:
            init_distributed(parallel, model)
        except ConfigError as err:
            assert needle in str(err), f"{needle!r} not in {err}"
        else:
            raise AssertionError(f"{parallel} was accepted")
        assert not ps.model_parallel_is_initialized()


# --- world size 4 ---------------------------------------------------------------------------


def logits_tp2_ep2(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe"), layout(tp=2, ep=2))


def logits_tp2_ep2_etp1(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe"), layout(tp=2, ep=2, etp=1))


def logits_sigmoid_tp2_ep2_etp1(ctx) -> None:  # noqa: ANN001
    _sigmoid_equivalence(ctx, layout(tp=2, ep=2, etp=1))


def logits_pp2_tp2(ctx) -> None:  # noqa: ANN001
    _equivalence(ctx, tiny_model("qwen3_moe"), layout(tp=2, pp=2))


def cpu_compat_semantics(ctx) -> None:  # noqa: ANN001
    """What the CPU patches promise, checked after init_distributed applied them (no CUDA here)."""
    import megatron.core.optimizer.optimizer as mcore_optimizer

    from megatron_rl.parallel import cpu_compat, init_distributed

    init_distributed(layout())
    assert cpu_compat.is_applied() and cpu_compat.apply_cpu_compat()  # idempotent
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.arange(3, device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    assert x.type() == "torch.FloatTensor"  # callers outside megatron.core.optimizer see the truth
    spoofed = {}
    exec("result = x.type()", vars(mcore_optimizer) | {"x": x}, spoofed)  # code whose module is the optimizer's
    assert spoofed["result"] == "torch.cuda.FloatTensor", spoofed
    assert (torch.cuda.Stream | None) is not None  # annotations in other libraries keep working
    stream = torch.cuda.Stream()
    assert torch.cuda.current_stream() == stream
    with torch.cuda.stream(stream):
        stream.record_event().synchronize()
    torch.cuda.manual_seed(7)
    first = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(3)), "the CUDA seed must seed the CPU generator"
    state = torch.cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
