"""The Slurm planner's resource checks (slurm/jobcheck.py): memory per GPU of the trainer and of the
rollout engines, and the tokenizer against the model's vocabulary; every figure worked out by hand
in the comments (parameter counts: `megatron_rl.models.families.parameter_counts`)."""

from __future__ import annotations

import json
from pathlib import Path

import jobcheck
import presets
import pytest

from megatron_rl.models.hf_config import model_config_from_hf

import jobplan
import tiny_tokenizer
from mrl_configs import QWEN3_30B_A3B, write_plan_config

GIB = 2**30
QWEN_PARAMS = 1_541_093_376 + 28_991_029_248  # Qwen3-30B-A3B: dense + routed experts
DSV3_PARAMS = 671_026_419_200  # DeepSeek-V3: 17,117,648,384 dense + 653,908,770,816 experts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-30B-A3B (TP 4, EP 8), the same with a vocabulary of 16, 56 and 57, DeepSeek-V3's config,
    and tiny_math's tokenizer of 28 tokens."""
    root = tmp_path_factory.mktemp("jobcheck")
    write_plan_config(root, "qwen", QWEN3_30B_A3B, "qwen.yaml")
    write_plan_config(root, "vocab16", {**QWEN3_30B_A3B, "vocab_size": 16}, "vocab16.yaml")
    write_plan_config(root, "vocab56", {**QWEN3_30B_A3B, "vocab_size": 56}, "vocab56.yaml")
    write_plan_config(root, "vocab57", {**QWEN3_30B_A3B, "vocab_size": 57}, "vocab57.yaml")
    (root / "dsv3").mkdir()
    (root / "dsv3" / "config.json").write_text(json.dumps(presets.DEEPSEEK_V3_671B))
    config = {"model": {"hf_path": str(root / "dsv3")}, "data": {"train_path": "t.jsonl"}, "logging": {"run_dir": "r"}}
    (root / "dsv3.yaml").write_text(json.dumps(config))
    tiny_tokenizer.build_tokenizer(root / "tokenizer")
    return root


def _plan(
    root: Path, name: str, *overrides: str, nodes: int = 4, mode: str = "disaggregated", **kwargs
) -> jobplan.JobPlan:
    names = [f"n{i}" for i in range(nodes)]
    return jobplan.make_plan(mode, str(root / f"{name}.yaml"), list(overrides), names, names, 8, "5", **kwargs)


@pytest.mark.parametrize(
    ("gpu_gib", "tp", "mla", "expected"),
    [
        # H100 80 GiB (81,920 MiB), TP 4, GQA: chunked prefill 8192, decode graphs up to 512 (TP >= 4), 58 prefill
        # graph sizes up to 8192 (8 + 14 + 8 + 8 + 12 + 8) x 8 MiB: 512 + 12,288 + 512 + 1024 + 464 = 14,800 MiB
        (80, 4, False, round((81920 - 14800) / 81920, 3)),  # 0.819
        # TP 8, MLA: 512 + 12,288 + 1024 + 1024 + 1536 = 16,384 MiB
        (80, 8, True, 0.8),
        # A100 40 GiB, TP 1: chunked prefill 4096, decode graphs up to 32, 50 prefill sizes up to 4096:
        # 512 + 6144 + 128 + 64 + 400 = 7248 MiB, no 10 GiB floor at or under 60 GiB
        (40, 1, False, round((40960 - 7248) / 40960, 3)),  # 0.823
        # H200 141 GiB (144,384 MiB), TP 8, MLA: 16,384 MiB as on the H100
        (141, 8, True, round((144384 - 16384) / 144384, 3)),  # 0.887
        # 16 GiB, TP 1: chunk 2048, decode up to 8, 42 prefill sizes up to 2048: 512 + 3072 + 128 + 16 + 336
        (16, 1, False, round((16384 - 4064) / 16384, 3)),  # 0.752
    ],
)
def test_sglang_default_mem_fraction_follows_sglangs_rule(gpu_gib: float, tp: int, mla: bool, expected: float) -> None:
    assert jobcheck.sglang_default_mem_fraction(gpu_gib, tp, mla) == expected


def test_kv_cache_bytes_per_token() -> None:
    qwen = model_config_from_hf(QWEN3_30B_A3B, source="qwen")
    # 48 layers x (key + value) x heads per GPU x 128 x 2 bytes: 4 KV heads, at least one per GPU
    assert jobcheck.kv_bytes_per_token(qwen, 1) == 48 * 2 * 4 * 128 * 2 == 98_304
    assert jobcheck.kv_bytes_per_token(qwen, 4) == jobcheck.kv_bytes_per_token(qwen, 8) == 24_576
    dsv3 = model_config_from_hf(presets.DEEPSEEK_V3_671B, source="dsv3")
    # MLA: 61 layers x (512 latent + 64 rotary) x 2 bytes on every TP rank
    assert jobcheck.kv_bytes_per_token(dsv3, 32) == 61 * 576 * 2 == 70_272


def test_the_engines_dtype_sizes_its_weights_and_kv_cache(models: Path) -> None:
    """SGLang's --dtype (auto: config.json's, float16 for float32 or none, bfloat16 for Gemma) and its
    --kv-cache-dtype (auto: the weights', fp8 for a checkpoint quantized with an FP8 KV cache)."""
    bf16 = {"torch_dtype": "bfloat16"}
    assert jobcheck.engine_dtype(bf16, []) == jobcheck.engine_dtype(bf16, ["--dtype", "auto"]) == ("bf16", 2)
    assert jobcheck.engine_dtype({"torch_dtype": "float32"}, []) == jobcheck.engine_dtype({}, []) == ("fp16", 2)
    assert jobcheck.engine_dtype({"model_type": "gemma2", "torch_dtype": "float32"}, []) == ("bf16", 2)
    assert jobcheck.engine_dtype(bf16, ["--dtype", "float32"]) == jobcheck.engine_dtype(bf16, ["--dtype=float"])
    assert jobcheck.engine_dtype(bf16, ["--dtype=float"]) == ("fp32", 4)
    assert jobcheck.engine_dtype(bf16, ["--dtype", "half"]) == ("fp16", 2)
    with pytest.raises(jobcheck.DoesNotFit, match=r"^SGLANG_ARGS: --dtype 'int8'; SGLang takes auto, half, float16"):
        jobcheck.engine_dtype(bf16, ["--dtype", "int8"])
    assert jobcheck.kv_cache_dtype(bf16, [], ("fp32", 4)) == ("fp32", 4)
    assert jobcheck.kv_cache_dtype(bf16, ["--kv-cache-dtype", "fp8_e5m2"], ("bf16", 2)) == ("fp8_e5m2", 1.0)
    fp8_kv = {"quantization_config": {"kv_cache_quant_algo": "FP8"}}
    assert jobcheck.kv_cache_dtype(fp8_kv, [], ("bf16", 2)) == ("fp8_e4m3", 1.0)
    with pytest.raises(jobcheck.DoesNotFit, match=r"--kv-cache-dtype 'int4'; SGLang takes auto, bf16"):
        jobcheck.kv_cache_dtype(bf16, ["--kv-cache-dtype", "int4"], ("bf16", 2))
    # fp32 weights and an fp8 KV cache on 4 GPUs: 30.5 B x 4 bytes / 4 = 28.4 GiB in 0.819 x 80 = 65.5 GiB,
    # 37.1 GiB of KV cache at 48 layers x 2 x 1 head x 128 x 1 byte = 12,288 bytes a token
    p = _plan(models, "qwen", "rollout.engine_gpus=4", engine_args=["--dtype", "float32", "--kv-cache-dtype=fp8_e5m2"])
    kv = 0.819 * 80 - QWEN_PARAMS * 4 / 4 / GIB
    assert p.memory[1].startswith(
        f"engine (4 GPUs): 28.4 GiB fp32 weights (30.5 B parameters) + {kv:.1f} GiB KV cache "
        f"({int(kv * GIB // 12_288):,} fp8_e5m2 tokens at 12,288 bytes"
    )
    # fp32 on one GPU: 113.7 GiB, over SGLang's 0.83 x 80 for TP 1 (512 + 12,288 + 128 + 512 + 464 MiB
    # reserved); 2 GPUs: 56.9 GiB in 0.829 x 80 = 66.3 GiB leave 9.4 GiB of fp32 KV cache, 102,798 tokens
    assert jobcheck.sglang_default_mem_fraction(80, 1, False) == round((81920 - 13904) / 81920, 3) == 0.83
    with pytest.raises(jobplan.PlanError) as err:
        _plan(models, "qwen", "rollout.engine_gpus=1", engine_args=["--dtype", "float32"])
    assert str(err.value) == (
        "a rollout engine needs 113.7 GiB per GPU of fp32 weights (114 GiB for 30.5 B parameters / "
        "rollout.engine_gpus=1), more than its static share of 66.4 GiB per GPU (--mem-fraction-static 0.83: "
        "SGLang's default for 80 GiB and TP 1; GPU_MEM_GIB=80); rollout.engine_gpus=2 would fit"
    )


def test_a_passing_plan_prints_the_trainer_and_engine_memory(models: Path) -> None:
    p = _plan(models, "qwen", "rollout.engine_gpus=4", train_nodes=2)
    trainer_line, engine_line = p.memory
    # trainer, 16 ranks: TP 4, EP 8 -> DP 4, expert DP 2; per GPU 1,541,093,376 / 4 dense and
    # 28,991,029,248 / 8 expert parameters; bf16 weights, fp32 gradients, 12 bytes of optimizer state
    dense, experts = 1_541_093_376 / 4, 28_991_029_248 / 8
    weights, grads = (dense + experts) * 2 / GIB, (dense + experts) * 4 / GIB
    optimizer = (dense * 12 / 4 + experts * 12 / 2) / GIB
    assert f"trainer {weights + grads + optimizer:.1f} GiB static" in trainer_line
    assert f"(weights {weights:.1f} + gradients {grads:.1f} + optimizer {optimizer:.1f})" in trainer_line
    assert "within 90% (72.0 GiB)" in trainer_line
    # engine of 4 GPUs: 30.5 B x 2 bytes / 4 = 14.2 GiB; SGLang's default 0.819 of 80 GiB = 65.5 GiB, the rest
    # 51.3 GiB of KV cache at 24,576 bytes a token: 2,241,434 tokens, 1,094 sequences of 1024 + 1024 tokens
    kv = 0.819 * 80 - QWEN_PARAMS * 2 / 4 / GIB
    tokens = int(kv * GIB // 24_576)
    assert engine_line == (
        f"engine (4 GPUs): {QWEN_PARAMS * 2 / 4 / GIB:.1f} GiB bf16 weights (30.5 B parameters) + {kv:.1f} GiB KV "
        f"cache ({tokens:,} bf16 tokens at 24,576 bytes: {tokens // 2048:,} sequences of 2,048) = 65.5 GiB: "
        "--mem-fraction-static 0.819 (SGLang's default for 80 GiB and TP 4)"
    )
    assert tokens // 2048 == 1094 and not [w for w in p.warnings if "max_concurrency" in w]  # 64 in flight fit
    assert engine_line.startswith("engine (4 GPUs): 14.2 GiB bf16 weights") and "51.3 GiB KV cache" in engine_line
    assert "memory per GPU of 80 GiB" in jobplan.describe(p)


def test_deepseek_v3_on_one_node_of_engines_is_refused_with_its_figures(models: Path) -> None:
    """1.34 TB of bf16 weights on 8 x 80 GiB: 671,026,419,200 x 2 bytes / 8 = 156.2 GiB per GPU against
    0.8 x 80 = 64.0 GiB (SGLang's default for TP 8 with MLA); 24 GPUs would fit: 52.1 GiB of weights in
    0.775 x 80 = 62.0 GiB leave 9.9 GiB, about 151,600 tokens (16 GPUs: 78.1 GiB of weights, over 0.787 x 80)."""
    assert DSV3_PARAMS * 2 / 8 / GIB == pytest.approx(156.2, abs=0.05)
    expected = (
        "a rollout engine needs 156.2 GiB per GPU of bf16 weights (1250 GiB for 671.0 B parameters / "
        "rollout.engine_gpus=8), more than its static share of 64.0 GiB per GPU (--mem-fraction-static 0.8: "
        "SGLang's default for 80 GiB and TP 8; GPU_MEM_GIB=80); rollout.engine_gpus=24 would fit"
    )
    with pytest.raises(jobplan.PlanError) as err:
        _plan(models, "dsv3", "rollout.engine_gpus=8", nodes=29, train_nodes=28, preset="deepseek-v3-671b")
    assert str(err.value) == expected
    # the preset's servers of 32 GPUs: 39.1 GiB of weights in 0.762 x 80 = 61.0 GiB, 21.9 GiB of KV cache
    p = _plan(models, "dsv3", nodes=32, train_nodes=28, preset="deepseek-v3-671b")
    kv = 0.762 * 80 - DSV3_PARAMS * 2 / 32 / GIB
    assert f"engine (32 GPUs): 39.1 GiB bf16 weights (671.0 B parameters) + {kv:.1f} GiB KV cache" in p.memory[1]
    tokens = int(kv * GIB // 70_272)
    assert f"({tokens:,} bf16 tokens at 70,272 bytes: {tokens // 2048:,} sequences of 2,048) = 61.0 GiB" in p.memory[1]


# DeepSeek-V3 per layer (h 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128): attention
# q 1536 x (7168 + 1 + 128 x 192) = 48,760,320, kv 7168 x 576 + 512 + 512 x 128 x 256 = 20,906,496, out
# 128 x 128 x 7168 = 117,440,512, two norms 14,336: 187,121,664; an MoE layer adds the router 256 x 7169 =
# 1,835,264 and the shared expert 3 x 7168 x 2048 = 44,040,192 (dense) and 256 x 3 x 7168 x 2048 =
# 11,274,289,152 routed-expert parameters. The preset's stages (PP 7, first and last 8): 8, 9, 9, 9, 9, 9, 8
# layers; the first holds the 3 dense layers (3 x 7168 x 18432 each) and the embedding (129,280 x 7168), so
# the largest is a stage of 9 MoE layers: 9 x 232,997,120 dense and 9 x 11,274,289,152 expert parameters.
DSV3_STAGE_DENSE = 9 * (187_121_664 + 1_835_264 + 44_040_192) // 8  # / TP 8: 262,121,760
DSV3_STAGE_EXPERTS = 9 * 11_274_289_152 // 32  # / EP 32: 3,170,893,824
# 28 nodes = 224 ranks: DP 224 / (8 x 7) = 4, expert DP 224 / (32 x 7) = 1
DSV3_STAGE_SHARD = DSV3_STAGE_DENSE / 4 + DSV3_STAGE_EXPERTS  # 3,236,424,264 parameters of optimizer state


def _dsv3_preset(models: Path, *overrides: str):  # noqa: ANN202
    from megatron_rl.config import load_config

    return load_config(str(models / "dsv3.yaml"), [*presets.preset_overrides("deepseek-v3-671b"), *overrides])


def test_trainer_memory_is_the_largest_pipeline_stages(models: Path) -> None:
    from megatron_rl.config.derived import pipeline_stage_layers
    from megatron_rl.models.families import parameter_counts, stage_parameter_counts

    cfg = _dsv3_preset(models)
    stages = pipeline_stage_layers(cfg.model, cfg.parallel)
    assert [len(s) for s in stages] == [8, 9, 9, 9, 9, 9, 8]
    counts = [stage_parameter_counts(cfg.model, s, i == 0, i == 6) for i, s in enumerate(stages)]
    assert counts[1] == (9 * 232_997_120, 9 * 11_274_289_152)
    # the first: 8 attention blocks, 3 dense MLPs, 5 MoE extras and the embedding; the last adds the output
    # layer and the final norm to 8 MoE layers
    assert counts[0][0] == 8 * 187_121_664 + 3 * 396_361_728 + 5 * 45_875_456 + 926_679_040
    assert counts[6][0] == 8 * 232_997_120 + 926_679_040 + 7168
    assert (
        tuple(map(sum, zip(*counts, strict=True))) == parameter_counts(cfg.model) == (17_117_648_384, 653_908_770_816)
    )
    mem = jobcheck.trainer_memory(cfg, 224)
    assert (mem.stage, mem.stage_layers, mem.stages) == (1, 9, 7)
    assert mem.dense_params * 1e9 == pytest.approx(DSV3_STAGE_DENSE)
    assert mem.expert_params * 1e9 == pytest.approx(DSV3_STAGE_EXPERTS)
    # bf16 weights 6,866,031,168 B = 6.39 GiB, fp32 gradients 12.79 GiB, 12 bytes x the shard = 36.17 GiB
    assert mem.weights == pytest.approx(6_866_031_168 / GIB) and mem.grads == pytest.approx(13_732_062_336 / GIB)
    assert mem.optimizer == pytest.approx(12 * DSV3_STAGE_SHARD / GIB) == pytest.approx(36.170, abs=1e-3)
    assert mem.total == pytest.approx(55.353, abs=1e-3) and mem.host == 0
    # dividing the whole model by PP would say 17.1 B / 56 dense and 653.9 B / 224 expert parameters: 48.8 GiB
    assert mem.expert_params == pytest.approx(3.1709, abs=1e-4) != pytest.approx(653.9 / 224, abs=1e-2)
    # tied embeddings: the last stage holds a copy of the embedding, the whole model one
    tied = _dsv3_preset(models, "model.tie_word_embeddings=true").model
    assert stage_parameter_counts(tied, stages[6], False, True) == counts[6]
    assert stage_parameter_counts(tied, range(61), True, True)[0] == 17_117_648_384 - 926_679_040


def test_a_critic_is_a_second_model_and_optimizer_on_the_trainer_gpus(models: Path) -> None:
    """critic.enabled (PPO): the value model in the policy's layout on the same GPUs, with its own gradients and
    optimizer state; its last stage holds a [1, H] head and its bias instead of the vocabulary's output layer."""
    from megatron_rl.config.derived import pipeline_stage_layers
    from megatron_rl.models.families import stage_parameter_counts

    cfg = _dsv3_preset(models, "algorithm.name=ppo")
    assert cfg.critic.enabled
    stages = pipeline_stage_layers(cfg.model, cfg.parallel)
    policy_last = stage_parameter_counts(cfg.model, stages[6], False, True)
    assert stage_parameter_counts(cfg.model, stages[6], False, True, value_head=True) == (
        policy_last[0] - 926_679_040 + 7168 + 1,  # the output layer (vocab x H) -> the head (H weights, a bias)
        policy_last[1],
    )
    mem = jobcheck.trainer_memory(cfg, 224)
    # the largest stage is still 2 of 7, where the critic holds what the policy holds (55.353 GiB, above)
    assert (mem.stage, mem.critic) == (1, pytest.approx(55.353, abs=1e-3))
    assert mem.total == pytest.approx(2 * 55.353, abs=2e-3) and mem.weights == pytest.approx(2 * 6_866_031_168 / GIB)
    assert mem.dense_params * 1e9 == pytest.approx(2 * DSV3_STAGE_DENSE)
    with pytest.raises(jobcheck.DoesNotFit, match=r"about 111 GiB per GPU .*, the critic's 55 GiB among them"):
        jobcheck.check_trainer_memory(cfg, 224, 80.0)
    lines = jobcheck.memory_lines(mem, None, None, 141.0, 1024)
    assert "optimizer 72.3, the critic's 55.4 GiB among them)" in lines[0]
    # colocated with rollout.colocate_offload: the actor's optimizer state leaves the GPU, the critic's stays
    assert jobcheck.resident_while_generating(mem, offload=True) == pytest.approx(
        2 * (6.394 + 12.789) + 36.170, abs=3e-3
    )


def test_optimizer_offload_puts_the_moments_of_its_share_on_the_host(models: Path) -> None:
    # a quarter offloaded: on the GPU the fp32 master (4 bytes) and 3/4 of Adam's moments (6 bytes) of the
    # shard, 10 x 3,236,424,264 B = 30.14 GiB; on the host the quarter's fp32 copy, gradient and moments
    # (16 bytes): 4 x 3,236,424,264 B = 12.06 GiB
    cfg = _dsv3_preset(models, "parallel.optimizer_cpu_offload=true", "parallel.optimizer_offload_fraction=0.25")
    mem = jobcheck.trainer_memory(cfg, 224)
    assert mem.optimizer == pytest.approx(10 * DSV3_STAGE_SHARD / GIB) == pytest.approx(30.142, abs=1e-3)
    assert mem.host == pytest.approx(4 * DSV3_STAGE_SHARD / GIB) == pytest.approx(12.057, abs=1e-3)
    assert mem.total == pytest.approx(6.394 + 12.789 + 30.142, abs=2e-3)
    p = _plan(models, "dsv3", "parallel.optimizer_cpu_offload=true", "parallel.optimizer_offload_fraction=0.25",
              nodes=32, train_nodes=28, preset="deepseek-v3-671b")  # fmt: skip
    assert p.memory[0] == (
        "memory per GPU of 80 GiB (arithmetic): trainer 49.3 GiB static (weights 6.4 + gradients 12.8 + optimizer "
        "30.1) on its largest pipeline stage, 2 of 7 with 9 layers, within 90% (72.0 GiB); 12.1 GiB of optimizer "
        "state on the host"
    )


def test_an_engine_without_room_for_one_sequence_is_refused(models: Path) -> None:
    # one GPU, SGLANG_ARGS 0.72: 0.72 x 80 = 57.6 GiB - 56.87 GiB of weights = 0.73 GiB = 7967 tokens of
    # 98,304 bytes, under one sequence of 1024 + 16,384; 2 GPUs: 28.4 GiB of weights leave 29.2 GiB
    assert int((0.72 * 80 - QWEN_PARAMS * 2 / GIB) * GIB // 98_304) == 7967
    args = ["--mem-fraction-static", "0.72"]
    with pytest.raises(jobplan.PlanError) as err:
        _plan(models, "qwen", "rollout.engine_gpus=1", "rollout.max_new_tokens=16384", engine_args=args)
    assert str(err.value) == (
        "a rollout engine's 56.9 GiB per GPU of bf16 weights (57 GiB for 30.5 B parameters / rollout.engine_gpus=1) "
        "leave 0.7 GiB of its static share of 57.6 GiB per GPU (--mem-fraction-static 0.72: SGLANG_ARGS; "
        "GPU_MEM_GIB=80) for the KV cache: 7967 tokens, fewer than one sequence of 17408 (data.max_prompt_tokens "
        "+ rollout.max_new_tokens); rollout.engine_gpus=2 would fit"
    )
    # 2048 tokens fit, 64 of them in flight do not: a warning, as SGLang runs (fewer at once); 2 GPUs: the
    # 28.4 GiB of weights leave 29.2 GiB at 49,152 bytes a token (2 KV heads per GPU), 637,113 tokens
    assert int((0.72 * 80 - QWEN_PARAMS * 2 / 2 / GIB) * GIB // 49_152) == 637_113 >= 64 * 2048
    (warning,) = [w for w in _plan(models, "qwen", "rollout.engine_gpus=1", engine_args=args).warnings if "KV" in w]
    assert warning == (
        "a rollout engine's KV cache holds 7,967 tokens: 3 whole sequences of 2,048 (data.max_prompt_tokens + "
        "rollout.max_new_tokens) at once, fewer than rollout.max_concurrency=64 (131,072 tokens): SGLang runs fewer "
        "requests at once and retracts some as responses grow; rollout.engine_gpus=2 would hold them"
    )
    few = _plan(models, "qwen", "rollout.engine_gpus=1", "rollout.max_concurrency=3", engine_args=args)
    assert (
        not [w for w in few.warnings if "KV" in w] and "7,967 bf16 tokens at 98,304 bytes: 3 sequences" in few.memory[1]
    )
    # a multi-turn episode's context is its whole budget, env.max_total_tokens
    turns = ("env.type=calculator", "env.max_turns=4", "env.max_total_tokens=8000")
    with pytest.raises(
        jobplan.PlanError,
        match=r"7967 tokens, fewer than one sequence of 8000 \(env.max_total_tokens, 4 turns\); rollout.engine_gpus=2 would fit$",
    ):
        _plan(models, "qwen", "rollout.engine_gpus=1", *turns, engine_args=args)
    with pytest.raises(jobplan.PlanError, match="--mem-fraction-static 'most' is not a number"):
        _plan(models, "qwen", "rollout.engine_gpus=4", engine_args=["--mem-fraction-static=most"])


def test_colocated_trainer_and_engines_share_each_gpu(models: Path) -> None:
    """One node of 8 ranks: DP 2, expert DP 1. While the engines generate, the trainer keeps 7.5 GiB of bf16
    weights + 14.9 GiB of gradients + 42.7 GiB of optimizer state = 65.1 GiB, over the 40 GiB the
    colocated default (0.5) leaves of 80 GiB; with rollout.colocate_offload (0.7) 22.4 GiB within 24 GiB."""
    dense, experts = 1_541_093_376 / 4, 28_991_029_248 / 8
    kept = (dense + experts) * 6 / GIB + (dense * 12 / 2 + experts * 12) / GIB
    assert kept == pytest.approx(65.1, abs=0.05)
    with pytest.raises(jobplan.PlanError) as err:
        _plan(models, "qwen", "rollout.engine_gpus=8", nodes=1, mode="colocated")
    assert str(err.value).startswith(
        f"colocated: while the engines generate, the trainer keeps {kept:.1f} GiB per GPU (weights, gradients and "
        "optimizer state), more than the 40.0 GiB their static share leaves (--mem-fraction-static 0.5 of "
        "GPU_MEM_GIB=80): set rollout.colocate_offload=true"
    )
    offload = _plan(models, "qwen", "rollout.engine_gpus=8", "rollout.colocate_offload=true", nodes=1, mode="colocated")
    weights_and_grads = (dense + experts) * 6 / GIB
    assert weights_and_grads == pytest.approx(22.4, abs=0.05)
    assert offload.memory[2] == f"colocated: the trainer keeps {weights_and_grads:.1f} GiB while the engines generate"
    assert "--mem-fraction-static 0.7 (the colocated default)" in offload.memory[1]


def test_the_tokenizer_against_the_models_vocabulary(models: Path) -> None:
    """More tokens than embedding rows: refused (the trainer refuses it too); under half the vocabulary
    (28 of 151,936, or of 57): refused with both sizes, another model's tokenizer, more than padding
    explains; half or more (28 of 56: a padded vocabulary): fine; no tokenizer in model.hf_path
    (planning from config.json alone): a warning."""
    tokenizer = f"data.tokenizer_path={models / 'tokenizer'}"
    with pytest.raises(jobplan.PlanError, match=r"the tokenizer has 28 tokens, more than the model's vocabulary"):
        _plan(models, "vocab16", tokenizer, "rollout.engine_gpus=4")
    with pytest.raises(jobplan.PlanError) as err:
        _plan(models, "qwen", tokenizer, "rollout.engine_gpus=4")
    assert str(err.value) == (
        f"data.tokenizer_path = {models / 'tokenizer'}: the tokenizer has 28 tokens for a model vocabulary of "
        "151,936 (config.json's vocab_size): under 50% of it, more than padding explains, so another model's "
        "tokenizer; set data.tokenizer_path to this model's"
    )
    with pytest.raises(jobplan.PlanError, match=r"has 28 tokens for a model vocabulary of 57 "):
        _plan(models, "vocab57", tokenizer, "rollout.engine_gpus=4")  # 28 < 57 / 2
    assert _plan(models, "vocab56", tokenizer, "rollout.engine_gpus=4").warnings == []  # 28 = 56 / 2
    (models / "no_tokenizer").mkdir(exist_ok=True)
    with pytest.raises(
        jobplan.PlanError,
        match=r"^data.tokenizer_path = .*no_tokenizer: no tokenizer files \(tokenizer.json, tokenizer.model",
    ):
        _plan(models, "qwen", f"data.tokenizer_path={models / 'no_tokenizer'}", "rollout.engine_gpus=4")
    p = _plan(models, "qwen", "rollout.engine_gpus=4")
    (warning,) = p.warnings
    assert warning.startswith(f"model.hf_path = {models / 'qwen'}: no tokenizer files (tokenizer.json")
    assert jobplan.describe(p).splitlines()[-1] == f"warning: {warning}"
