"""The local specs' SDPA core attention (`models.sdpa_attention`, `model.attention_backend`) against
Megatron's local attention, on one rank in this process, fp32.

Per policy, the tiny Qwen3-MoE (grouped-query attention: 4 heads, 2 groups) and the tiny DeepSeek-V3
(multi-latent attention: query/key heads wider than the values, yarn's softmax scale), each built
with `local` and with `sdpa` on the same weights (`train.seed`): log-probs and entropy of right-padded
and of packed micro-batches, then one GRPO update replaying the recorded routing (loss, gradient norm,
every parameter after it) must agree within 1e-6. Then the key: its values, `auto`'s choice and the
refused combinations, each one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.actor.micro_batches import TokenBudget
from megatron_rl.config import Config, ConfigError, ModelConfig, RolloutConfig, TrainConfig, load_config, preset
from megatron_rl.models.attention_choice import check_attention_backend, use_sdpa

from mrl_configs import actor_of_one, layout, seeded_batch, tiny_model, tiny_sigmoid_model

LENGTHS = (22, 7, 15, 11, 19, 9, 13, 17)
PROMPTS = (5, 3, 6, 2, 4, 3, 5, 6)
PADDED, PACKED = TokenBudget(48), TokenBudget(40, packed=True)
TOL = 1e-6  # relative to the largest value compared (at least 1)


def _config(model: ModelConfig, backend: str) -> Config:
    return Config(
        model=dataclasses.replace(model, attention_backend=backend),
        parallel=layout(),
        rollout=RolloutConfig(temperature=0.7, max_new_tokens=24),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2", entropy_coef=0.01),
        train=TrainConfig(  # Adam eps 1e-3 keeps fp32 rounding of near-zero gradients from being amplified
            updates_per_step=1,
            max_tokens_per_micro_batch=48,
            logprob_chunk_tokens=16,
            lr=3e-3,
            adam_eps=1e-3,
            grad_clip=0.5,
            seed=11,
        ),
    )


def _log_probs(actor, batch, budget: TokenBudget, mode: str | None = None):  # noqa: ANN001, ANN202
    from megatron_rl.actor.forward import compute_log_probs

    cfg = actor.cfg
    return compute_log_probs(
        actor.state.model,
        batch,
        temperature=cfg.rollout.temperature,
        vocab_size=cfg.model.vocab_size,
        budget=budget,
        chunk_tokens=cfg.train.logprob_chunk_tokens,
        routing=actor.routing,
        routing_mode=mode,
    )


def _run(model: ModelConfig, backend: str) -> dict[str, object]:
    """Padded and packed log-probs and entropy (R2 recorded routing replayed for the packed ones), then one
    update replaying it: its metrics and the parameters after it."""
    from megatron_rl.models.sdpa_attention import SDPAttention

    with actor_of_one(_config(model, backend)) as actor:
        core = actor.chunks[0].decoder.layers[0].self_attention.core_attention
        assert (type(core) is SDPAttention) == (backend == "sdpa"), type(core)
        batch = seeded_batch(model.vocab_size, LENGTHS, PROMPTS)
        padded = _log_probs(actor, batch, PADDED, "record")
        packed = _log_probs(actor, batch.with_fields(routed_experts=padded.routed_experts), PACKED, "replay")
        gen = torch.Generator().manual_seed(3)
        train = batch.with_fields(
            old_log_probs=[lp + 0.2 * torch.randn(lp.shape, generator=gen) for lp in padded.log_probs],
            routed_experts=padded.routed_experts,
        )
        history = actor.train(train)
        return {
            "padded": padded.log_probs + padded.entropy,
            "packed": packed.log_probs + packed.entropy,
            "history": history,
            "params": actor.full_params(),
        }


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(
        float((x.double() - y.double()).abs().max()) / max(1.0, float(y.abs().max())) for x, y in zip(a, b, strict=True)
    )


MODELS = {
    "gqa": lambda: tiny_model("qwen3_moe"),
    "mla": lambda: tiny_sigmoid_model("deepseek_v3", "split"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request: pytest.FixtureRequest) -> Iterator[tuple[dict, dict]]:
    model = MODELS[request.param]()
    yield _run(model, "local"), _run(model, "sdpa")


@pytest.mark.parametrize("layout_name", ["padded", "packed"])
def test_sdpa_log_probs_equal_local(runs: tuple[dict, dict], layout_name: str) -> None:
    local, sdpa = runs
    assert _worst(sdpa[layout_name], local[layout_name]) <= TOL


def test_sdpa_update_equals_local(runs: tuple[dict, dict]) -> None:
    """One GRPO update: loss, gradient norm (clipped at 0.5, so its scale reaches the weights) and parameters."""
    local, sdpa = runs
    (want,), (got,) = local["history"], sdpa["history"]
    assert want["grad_norm"] > 1e-3
    for key in ("loss", "grad_norm"):
        assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (key, got[key], want[key])
    names = set(local["params"])
    assert names == set(sdpa["params"])
    worst = max((float((sdpa["params"][k] - local["params"][k]).abs().max()), k) for k in names)
    assert worst[0] <= TOL, worst


def test_the_backend_key_and_autos_choice() -> None:
    assert load_config(overrides=[]).model.attention_backend == "auto"
    assert load_config(overrides=["model.attention_backend=local"]).model.attention_backend == "local"
    with pytest.raises(ConfigError, match=r"model.attention_backend.*allowed: \['auto', 'local', 'sdpa'\]"):
        load_config(overrides=["model.attention_backend=flash"])
    model = tiny_model("qwen3_moe")
    assert use_sdpa(model, layout(), cuda=True) and not use_sdpa(model, layout(), cuda=False)  # varlen: below
    assert not use_sdpa(model, layout(cp=2), cuda=True)  # context parallelism gathers the keys in the local attention
    for cuda in (True, False):  # either forced on any device
        assert use_sdpa(dataclasses.replace(model, attention_backend="sdpa"), layout(), cuda=cuda)
        assert not use_sdpa(dataclasses.replace(model, attention_backend="local"), layout(), cuda=cuda)


@pytest.mark.parametrize(
    ("backend", "cp", "te", "culprit"),
    [
        ("sdpa", 2, False, "model.attention_backend = sdpa does not run under context parallelism"),
        ("sdpa", 1, True, "model.attention_backend = sdpa chooses the local specs' attention"),
        ("local", 1, True, "model.attention_backend = local chooses the local specs' attention"),
    ],
)
def test_refused_backends_are_one_line(backend: str, cp: int, te: bool, culprit: str) -> None:
    model = dataclasses.replace(tiny_model("qwen3_moe"), attention_backend=backend)
    with pytest.raises(ConfigError, match=culprit) as err:
        check_attention_backend(model, layout(cp=cp), transformer_engine=te)
    assert "\n" not in str(err.value)
    check_attention_backend(dataclasses.replace(model, attention_backend="auto"), layout(cp=cp), transformer_engine=te)


def test_packs_take_varlen_attention_on_cuda_only() -> None:
    from megatron_rl.models.sdpa_attention import varlen_available

    assert varlen_available(torch.device("cuda", 0), torch.bfloat16)
    assert varlen_available(torch.device("cuda", 0), torch.float16)
    assert not varlen_available(torch.device("cuda", 0), torch.float32)  # its flash kernel has no fp32
    assert not varlen_available(torch.device("cpu"), torch.bfloat16)


def _reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, window_size, scale, enable_gqa=False):  # noqa: ANN001, ANN202
    """torch 2.13's varlen_attn signature, computed per sequence on the CPU; its flash kernel's one head width."""
    assert window_size == (-1, 0) and cu_q is cu_k and max_q == max_k == 6
    assert query.shape[-1] == key.shape[-1] == value.shape[-1]
    parts = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        parts.append(out.transpose(0, 1))
    return torch.cat(parts)


@pytest.mark.parametrize(("heads", "groups", "qk", "v"), [(4, 2, 8, 8), (4, 4, 12, 7)], ids=["gqa", "mla"])
def test_the_varlen_path_computes_what_local_does(
    monkeypatch: pytest.MonkeyPatch, heads: int, groups: int, qk: int, v: int
) -> None:
    """The pack through the varlen branch (the call as torch 2.13 takes it, run per sequence here: flash has
    no CPU kernel), MLA's values padded to the keys' width and sliced back, against Megatron's local attention
    on the same pack."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models import sdpa_attention
    from megatron_rl.models.mla_attention import MLADotProductAttention
    from megatron_rl.parallel import init_distributed

    from mrl_configs import launch_of_one

    calls: list[dict] = []
    _, parameters = sdpa_attention._varlen_kernel()  # the installed torch's signature
    stand_in = lambda *a, **kw: calls.append(kw) or _reference_varlen(*a, **kw)  # noqa: E731
    monkeypatch.setattr(sdpa_attention, "_varlen_kernel", lambda: (stand_in, parameters))
    monkeypatch.setattr(sdpa_attention, "varlen_available", lambda device, dtype: True)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * qk,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=qk,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
    )
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    gen = torch.Generator().manual_seed(0)
    q, k, val = (torch.randn(12, n, d, generator=gen) for n, d in ((heads, qk), (groups, qk), (groups, v)))
    with launch_of_one():
        init_distributed(layout())
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        args = (config, 1, AttnMaskType.causal, "self")
        kwargs = dict(k_channels=qk, v_channels=v, softmax_scale=0.3, pg_collection=pgs)
        got = sdpa_attention.SDPAttention(*args, **kwargs)(q, k, val, None, packed_seq_params=pack)
        want = MLADotProductAttention(*args, **kwargs)(q, k, val, None, packed_seq_params=pack)
    assert [c["scale"] for c in calls] == [0.3] and [c.get("enable_gqa", False) for c in calls] == [heads != groups]
    assert got.shape == want.shape == (12, 1, heads * v)
    assert float((got - want).abs().max()) <= TOL
