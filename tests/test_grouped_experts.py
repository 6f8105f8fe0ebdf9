"""The local grouped experts (`models.grouped_experts`, `model.moe_grouped_gemm`) against Megatron's
`SequentialMLP`, in this process (a world of one): the tiny MoE policy of the multi-process scenarios
built both ways on the same weights, one MoE layer's experts given the same sorted tokens (one expert
without any), the outputs and every gradient compared, with and without expert LoRA (a rank padded to
torch's 16-byte rows). Then `torch._grouped_mm`'s rules as the module relies on them (fp32 and bf16, empty
groups), the hooks on the expert linears, and the key: its values, `auto`'s choice and the refusal of
widths torch's grouped GEMM cannot take. The same comparison through whole training steps, at world
size 1, EP 2 and expert-TP 2: tests/test_actor_distributed.py (`grouped_experts` scenarios)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.config import ConfigError, LoraConfig, ModelConfig, load_config
from megatron_rl.models.experts_choice import check_grouped_experts, use_grouped_experts

from mrl_configs import launch_of_one, layout, tiny_model

TOKENS_PER_EXPERT = [5, 0, 9, 3]  # the tiny policy's 4 experts; expert 1 gets no token
TOL = 1e-6  # relative to the largest value compared (at least 1)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _build(model: ModelConfig, grouped: bool, seed: int = 0) -> list[torch.nn.Module]:
    """The tiny policy's chunks built with `grouped`, weights from `seed`."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.init import init_deterministic

    model = dataclasses.replace(model, moe_grouped_gemm=grouped)
    chunks = build_model(model, layout())
    init_deterministic(chunks, model, seed)
    return chunks


@pytest.fixture(scope="module")
def built() -> Iterator[dict[str, object]]:
    """Per variant (sequential, grouped, and both with rank-3 LoRA): the model chunks, in one world of one."""
    from megatron_rl.models.lora import attach_lora, gather_adapters, load_adapters
    from megatron_rl.parallel import init_distributed

    model = tiny_model("qwen3_moe")
    with launch_of_one():
        init_distributed(layout(), model)
        out: dict[str, object] = {"model": model}
        for name, grouped in (("sequential", False), ("grouped", True)):
            out[name] = _build(model, grouped)
            lora_model = dataclasses.replace(model, lora=LoraConfig(rank=3, alpha=6.0))
            chunks = _build(lora_model, grouped)
            state = attach_lora(chunks, lora_model, seed=7)
            gen = torch.Generator().manual_seed(2)  # B away from PEFT's 0, the same on both variants
            load_adapters(
                state, {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in gather_adapters(state).items()}
            )
            out[f"{name}_lora"] = (chunks, state)
        yield out


def _layer_experts(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    """Layer 1's experts (the first MoE layer)."""
    return chunks[0].decoder.layers[1].mlp.experts


def _expert_adapter_grads(state: object) -> dict[str, torch.Tensor | None]:
    """The gradients of layer 1's expert adapters, by PEFT module and A/B."""
    return {
        f"{a.spec.peft_module}.{name}": getattr(a, name).grad
        for a in state.adapters()  # type: ignore[attr-defined]
        if a.spec.peft_module.startswith("model.layers.1.mlp.experts.")
        for name in ("A", "B")
    }


def _inputs(hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(TOKENS_PER_EXPERT)
    x = torch.randn(tokens, hidden, generator=gen)
    probs = torch.rand(tokens, generator=gen)
    return x, torch.tensor(TOKENS_PER_EXPERT), probs


def _run(experts: torch.nn.Module, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients (input, probs, every trainable parameter) of a sum of the outputs x a fixed weight."""
    x, counts, probs = _inputs(experts.config.hidden_size, seed)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out, bias = experts(x, counts, probs)
    assert bias is None
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weight).sum().backward()
    grads = {"input": x.grad, "probs": probs.grad}
    grads.update({n: p.grad for n, p in experts.named_parameters() if p.requires_grad})
    return out.detach(), grads


def _assert_same(a: tuple, b: tuple, what: str) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert _diff(out_a, out_b) <= TOL, f"{what}: outputs"
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert grads_a[name] is not None and grads_b[name] is not None, f"{what}: no gradient for {name}"
        assert _diff(grads_a[name], grads_b[name]) <= TOL, f"{what}: gradient of {name}"


def test_grouped_experts_keep_the_parameters_and_compute_what_sequential_does(built: dict) -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl.models.grouped_experts import GroupedExperts

    sequential, grouped = _layer_experts(built["sequential"]), _layer_experts(built["grouped"])
    assert type(sequential) is SequentialMLP and type(grouped) is GroupedExperts
    names = [(n, tuple(p.shape)) for n, p in built["sequential"][0].named_parameters()]
    assert names == [(n, tuple(p.shape)) for n, p in built["grouped"][0].named_parameters()]
    assert built["sequential"][0].state_dict().keys() == built["grouped"][0].state_dict().keys()
    result = _run(grouped)
    _assert_same(_run(sequential), result, "grouped vs sequential")
    empty = result[1]["local_experts.1.linear_fc1.weight"]
    assert empty is not None and not empty.any(), "the expert without tokens gets a zero gradient"


def test_grouped_experts_apply_expert_lora_as_the_hooks_do(built: dict) -> None:
    from megatron_rl.models.lora import adapters_disabled

    (seq_chunks, seq_state), (grp_chunks, grp_state) = built["sequential_lora"], built["grouped_lora"]
    sequential, grouped = _layer_experts(seq_chunks), _layer_experts(grp_chunks)
    for state in (seq_state, grp_state):
        for adapter in state.adapters():
            adapter.zero_grad(set_to_none=True)
    with_lora = _run(grouped)
    _assert_same(_run(sequential), with_lora, "rank-3 LoRA, grouped vs sequential")
    want, got = _expert_adapter_grads(seq_state), _expert_adapter_grads(grp_state)
    assert len(got) == 4 * 3 * 2 and got.keys() == want.keys()  # 4 experts x gate/up/down x A/B
    for name, grad in got.items():
        assert grad is not None and _diff(grad, want[name]) <= TOL, f"gradient of {name}"
        assert grad.any() == (".experts.1." not in name), f"{name}: only the expert without tokens gets 0"
    with adapters_disabled(grp_state), adapters_disabled(seq_state):
        base = _run(grouped)[0]
        assert _diff(base, _run(sequential)[0]) <= TOL
    assert float((base - with_lora[0]).abs().max()) > 1e-3, "the adapters change the output"


def test_expert_linear_hooks_run_or_are_refused(built: dict) -> None:
    grouped = _layer_experts(built["grouped"])
    linear = grouped.local_experts[2].linear_fc2
    calls = []
    handle = linear.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    try:
        _run(grouped)
    finally:
        handle.remove()
    assert calls == [(sum(TOKENS_PER_EXPERT), grouped.config.moe_ffn_hidden_size)]
    handle = linear.register_forward_hook(lambda module, args, output: None)
    try:
        with pytest.raises(RuntimeError, match="forward hooks .* would not run under grouped GEMMs"):
            _run(grouped)
    finally:
        handle.remove()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_grouped_linear_matches_one_matmul_per_group(dtype: torch.dtype, tol: float) -> None:
    """Empty groups (first, middle and last) give empty rows and zero weight gradients; fp32 and bf16."""
    from megatron_rl.models.grouped_experts import grouped_linear

    gen = torch.Generator().manual_seed(0)
    counts = [0, 6, 0, 3, 0]
    x = torch.randn(sum(counts), 16, generator=gen).to(dtype).requires_grad_(True)
    weights = [torch.randn(8, 16, generator=gen).to(dtype).requires_grad_(True) for _ in counts]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_linear(x, offsets, weights)
    out.float().square().sum().backward()
    got = [x.grad, *(w.grad for w in weights)]
    for t in (x, *weights):
        t.grad = None
    want = torch.cat([part @ w.t() for part, w in zip(x.split(counts), weights, strict=True)])
    want.float().square().sum().backward()
    assert out.dtype == dtype and float((out - want).abs().max()) <= tol
    for g, w in zip(got, [x.grad, *(w.grad for w in weights)], strict=True):
        assert float((g.float() - w.float()).abs().max()) <= tol * max(1.0, float(w.float().abs().max()))
    assert not any(weights[i].grad.any() for i in (0, 2, 4))


def test_the_key_takes_auto_true_false_and_names_the_allowed_values() -> None:
    assert load_config(overrides=[]).model.moe_grouped_gemm == "auto"
    assert load_config(overrides=["model.moe_grouped_gemm=true"]).model.moe_grouped_gemm is True
    assert load_config(overrides=["model.moe_grouped_gemm=false"]).model.moe_grouped_gemm is False
    with pytest.raises(ConfigError, match=r"model.moe_grouped_gemm.*allowed: \['auto', True, False\]"):
        load_config(overrides=["model.moe_grouped_gemm=sometimes"])


def test_auto_picks_grouped_where_torch_takes_the_widths() -> None:
    aligned, odd = ModelConfig(hidden_size=64, moe_ffn_hidden_size=32), ModelConfig(hidden_size=66)
    assert use_grouped_experts(aligned, layout(), transformer_engine=False)
    assert not use_grouped_experts(odd, layout(), transformer_engine=False)  # the loop instead
    assert use_grouped_experts(odd, layout(), transformer_engine=True)  # Transformer Engine's take any width
    assert not use_grouped_experts(
        dataclasses.replace(aligned, moe_grouped_gemm=False), layout(), transformer_engine=True
    )
    dense = ModelConfig(family="qwen3", num_experts=None, moe_grouped_gemm=True)
    assert not use_grouped_experts(dense, layout(), transformer_engine=False)


@pytest.mark.parametrize(
    ("fields", "etp", "culprit"),
    [
        (dict(hidden_size=66), 1, "in fp32 model.hidden_size (66) are not"),
        (dict(hidden_size=68, params_dtype="bf16"), 1, "in bf16 model.hidden_size (68) are not"),
        (dict(moe_ffn_hidden_size=24), 4, "model.moe_ffn_hidden_size / expert-TP (6) are not"),
    ],
)
def test_true_is_refused_for_widths_torch_cannot_take(fields: dict, etp: int, culprit: str) -> None:
    model = ModelConfig(moe_grouped_gemm=True, **fields)
    with pytest.raises(ConfigError, match="model.moe_grouped_gemm = true: torch._grouped_mm needs rows") as err:
        check_grouped_experts(model, layout(tp=etp), transformer_engine=False)
    assert culprit in str(err.value) and "set it to auto or false" in str(err.value)
    check_grouped_experts(model, layout(tp=etp), transformer_engine=True)  # Transformer Engine's grouped GEMM
    check_grouped_experts(dataclasses.replace(model, moe_grouped_gemm="auto"), layout(tp=etp), transformer_engine=False)


def test_the_validation_refuses_true_for_such_widths_before_anything_is_built() -> None:
    from megatron_rl.validation import validate_run

    odd = ["model.moe_grouped_gemm=true", "model.hidden_size=66", "model.num_attention_heads=6"]
    with pytest.raises(ConfigError, match=r"model.moe_grouped_gemm = true: .* model.hidden_size \(66\)"):
        validate_run(load_config(overrides=odd), "convert", world_size=1, cuda_available=False)
    validate_run(load_config(overrides=odd[1:]), "convert", world_size=1, cuda_available=False)  # auto: the loop


def test_experts_reduce_over_the_expert_data_parallel_group_where_megatron_marks_them_dense(built: dict) -> None:
    """Megatron-Core 0.16 marks the experts' parameters for the expert groups (`allreduce = False`) only
    under EP > 1; with EP 1 and expert-TP != TP the builder marks them too, and nothing else (the router,
    attention, the dense layer). The gradients this fixes: tests/mrl_multiproc/scenarios_layouts.py."""
    from megatron_rl.models.builder import reduce_experts_over_expert_data_parallel

    (chunk,) = _build(built["model"], grouped=True)  # type: ignore[arg-type]

    def marked() -> set[str]:
        return {name for name, p in chunk.named_parameters() if not getattr(p, "allreduce", True)}

    experts = {name for name, _ in chunk.named_parameters() if ".mlp.experts." in name}
    assert experts and marked() == set(), "at EP 1 Megatron marks the experts dense"
    for same_groups in (layout(ep=2), layout(tp=2, sp=True), layout(tp=2, sp=True, ep=2, etp=1)):
        reduce_experts_over_expert_data_parallel(chunk, same_groups)
        assert marked() == set(), same_groups
    reduce_experts_over_expert_data_parallel(chunk, layout(etp=2))
    assert marked() == experts
    (chunk,) = _build(built["model"], grouped=True)  # type: ignore[arg-type]
    reduce_experts_over_expert_data_parallel(chunk, layout(tp=2, sp=True, etp=1))
    assert marked() == experts
