"""The tiny_math example: seeded generator, correct answers, disjoint splits, SFT mix, tokenizer, model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from megatron_rl.config import DataConfig, load_config
from megatron_rl.data import load_prompt_dataset
from megatron_rl.rewards import dapo_rule

import prepare
import tiny_model
import tiny_task

Problem = tiny_task.Problem


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's folder as prepare.py writes it (fewer SFT rows to stay fast)."""
    out = tmp_path_factory.mktemp("tiny_math")
    assert prepare.main(["--out", str(out), "--sft-rows", "2000"]) == 0
    return out


def test_responses_by_hand() -> None:
    p = Problem(2, 4, 5, "sum_first")
    assert (p.prompt, p.answer) == ("2+4*5=", 22)
    assert p.correct_response() == "4*5=20\n2+20=22\nAnswer: 22"
    assert p.corrupted_response() == "2+4=6\n6*5=30\nAnswer: 30"
    q = Problem(2, 4, 5, "product_first")
    assert (q.prompt, q.answer) == ("4*5+2=", 22)
    assert q.correct_response() == "4*5=20\n20+2=22\nAnswer: 22"
    assert q.corrupted_response() == "5+2=7\n4*7=28\nAnswer: 28"


def test_every_answer_and_step_is_right_and_the_corrupted_answer_always_wrong() -> None:
    problems = tiny_task.all_problems()
    assert len(problems) == 49 * 8 * 8 * 2 == len({p.prompt for p in problems})
    for p in problems:
        assert eval(p.prompt[:-1]) == p.answer  # Python's precedence is the task's
        for response in (p.correct_response(), p.corrupted_response()):
            *steps, last = response.split("\n")
            for step in steps:  # every intermediate line is true arithmetic
                lhs, rhs = step.split("=")
                assert eval(lhs) == int(rhs)
            assert last == f"Answer: {steps[-1].split('=')[1]}"
        assert dapo_rule(p.correct_response(), str(p.answer)).correct
        assert not dapo_rule(p.corrupted_response(), str(p.answer)).correct


def test_splits_are_seeded_sized_and_disjoint() -> None:
    train, heldout = tiny_task.split_problems(seed=0)
    again_train, again_heldout = tiny_task.split_problems(seed=0)
    assert (train, heldout) == (again_train, again_heldout)
    assert (len(train), len(heldout)) == (5772, 500)
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}
    assert {p.prompt for p in train + heldout} == {p.prompt for p in tiny_task.all_problems()}
    assert tiny_task.split_problems(seed=1)[1] != heldout


def test_sft_rows_mix_the_two_procedures_over_whole_passes() -> None:
    train, _ = tiny_task.split_problems(seed=0)
    rows = tiny_task.sft_rows(train, 2 * len(train), correct_fraction=0.45, seed=0)
    assert rows == tiny_task.sft_rows(train, 2 * len(train), correct_fraction=0.45, seed=0)
    by_prompt = {p.prompt: p for p in train}
    for pass_rows in (rows[: len(train)], rows[len(train) :]):  # each pass covers every train problem once
        assert Counter(r["prompt"][0]["content"] for r in pass_rows) == Counter(list(by_prompt))
    procedures = Counter()
    for row in rows:
        problem = by_prompt[row["prompt"][0]["content"]]
        procedure = row["extra_info"]["procedure"]
        expected = problem.correct_response() if procedure == "correct" else problem.corrupted_response()
        assert row["response"] == expected and row["reward_model"]["ground_truth"] == str(problem.answer)
        procedures[procedure] += 1
    assert abs(procedures["correct"] / len(rows) - 0.45) < 0.015  # 11,544 draws: 3 standard deviations
    all_correct = tiny_task.sft_rows(train, 100, correct_fraction=1.0, seed=0)
    assert {r["extra_info"]["procedure"] for r in all_correct} == {"correct"}


def test_prepared_files_load_as_dapo_rows_with_short_prompts(assets: Path) -> None:
    from megatron_rl.data import load_tokenizer

    tokenizer = load_tokenizer(assets / "model")
    train = load_prompt_dataset(assets / "data" / "train.jsonl", tokenizer, DataConfig())
    heldout = load_prompt_dataset(assets / "data" / "heldout.jsonl", tokenizer, DataConfig())
    assert (len(train), len(heldout), train.report.skipped, heldout.report.skipped) == (5772, 500, [], [])
    assert max(len(p.input_ids) for p in train) <= 10  # <|user|> + at most 8 characters + <|assistant|>
    expected = {p.prompt: str(p.answer) for p in tiny_task.split_problems(seed=0)[1]}
    assert {p.raw["prompt"][0]["content"]: p.answer for p in heldout} == expected
    sft = [json.loads(line) for line in (assets / "data" / "sft.jsonl").read_text().splitlines()]
    assert len(sft) == 2000 and all("response" in r for r in sft)


def test_tokenizer_round_trips_every_example(assets: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets / "model"), local_files_only=True)
    assert len(tokenizer) == 28 and (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.bos_token_id is None
    problems = tiny_task.all_problems()
    texts = [t for p in problems for t in (p.prompt, p.correct_response(), p.corrupted_response())]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, encoded, strict=True):
        assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    assert max(len(ids) for ids in encoded) + 1 <= 32  # response + <|eos|> fits max_new_tokens = 32
    chat = [{"role": "user", "content": "2+4*5="}, {"role": "assistant", "content": "4*5=20\n2+20=22\nAnswer: 22"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == "<|user|>2+4*5=<|assistant|>4*5=20\n2+20=22\nAnswer: 22<|eos|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 4 and ids[7] == 5 and ids[-1] == 1 and tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "2+4*5=4*5=20\n2+20=22\nAnswer: 22"


def test_model_folder_is_seeded_and_matches_the_megatron_settings(assets: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(assets / "model"))
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.vocab_size) == (
        "qwen3_moe",
        8,
        2,
        28,
    )
    assert config.tie_word_embeddings is False and config.mlp_only_layers == []
    raw = json.loads((assets / "model" / "config.json").read_text())
    assert (raw["num_experts"], raw["rope_theta"]) == (8, 10000.0)  # keys older readers expect
    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    assert sum(p.numel() for p in model.parameters()) == 1_782_144
    logits = model(torch.tensor([[4, 8, 16, 10, 17, 11, 18, 5]])).logits
    assert logits.shape == (1, 8, 28) and torch.isfinite(logits).all()

    first = load_file(str(assets / "model" / "model.safetensors"))
    tiny_model.build_model(tmp_path / "same", seed=0)
    tiny_model.build_model(tmp_path / "other", seed=1)
    same = load_file(str(tmp_path / "same" / "model.safetensors"))
    other = load_file(str(tmp_path / "other" / "model.safetensors"))
    assert first.keys() == same.keys() and all(torch.equal(first[k], same[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])

    cfg = load_config(overrides=[f"model.{k}={v}" for k, v in tiny_model.MEGATRON_MODEL.items()])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (
        config.hidden_size,
        config.num_hidden_layers,
        config.vocab_size,
    )
    assert (cfg.model.num_query_groups, cfg.model.kv_channels, cfg.model.moe_ffn_hidden_size) == (
        config.num_key_value_heads,
        config.head_dim,
        config.moe_intermediate_size,
    )


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa"])
def test_family_models_are_seeded_and_convert(tmp_path: Path, family: str) -> None:
    """`--family` builds the DeepSeek-V3- / GLM-4.5- / DeepSeek-V3.2- / GLM-5-shaped policy: its config.json maps to
    the family (no key left unhandled), the same seed gives the same weights, and the expert bias is non-zero."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    tiny_model.build_model(tmp_path / "a", seed=0, family=family)
    tiny_model.build_model(tmp_path / "b", seed=0, family=family)
    model = model_config_from_hf(read_hf_config(tmp_path / "a"))
    assert (model.family, model.num_experts, model.moe_router_topk, model.first_k_dense_layers) == (family, 8, 2, 1)
    assert model.moe_shared_expert_size == 96 and model.moe_router_scaling_factor == 2.5
    assert (model.rope_scaling == "yarn") == (family in ("deepseek_v3", "deepseek_v32"))
    sparse = family in ("deepseek_v32", "glm_moe_dsa")
    assert (model.dsa_index_n_heads, model.dsa_index_topk) == ((32, 24) if sparse else (None, None))
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    with pytest.raises(ValueError, match="family 'llama'"):
        tiny_model.build_model(tmp_path / "c", family="llama")


@pytest.mark.parametrize(("family", "projection"), [("qwen3_next", "in_proj_qkvz"), ("qwen3_5_moe", "in_proj_qkv")])
def test_qwen3_next_model_is_seeded_and_converts(tmp_path: Path, family: str, projection: str) -> None:
    """`--family qwen3_next` / `qwen3_5_moe` builds the Qwen3-Next- / Qwen3.5-shaped policy: 3 DeltaNet layers and a
    full one, every layer MoE with a shared expert, the family's own DeltaNet projections; its config.json maps to
    the family; the same seed, the same weights."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    tiny_model.build_model(tmp_path / "a", seed=0, family=family)
    tiny_model.build_model(tmp_path / "b", seed=0, family=family)
    model = model_config_from_hf(read_hf_config(tmp_path / "a"))
    linear = model.linear_attention
    assert (model.family, model.num_experts, model.moe_shared_expert_size, model.rotary_percent) == (
        family, 8, 96, 0.25
    )  # fmt: skip
    assert (linear.full_attention_interval, linear.num_key_heads, linear.num_value_heads) == (4, 2, 4)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert f"model.layers.0.linear_attn.{projection}.weight" in a and "model.layers.3.self_attn.q_proj.weight" in a


def test_minimax_m2_model_is_seeded_and_converts(tmp_path: Path) -> None:
    """`--family minimax_m2` builds the MiniMax-M2-shaped policy: its config.json maps to the family (half of each
    head rotated, sigmoid top-2 of 8 experts with a non-zero expert bias); the same seed, the same weights."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    tiny_model.build_model(tmp_path / "a", seed=0, family="minimax_m2")
    tiny_model.build_model(tmp_path / "b", seed=0, family="minimax_m2")
    model = model_config_from_hf(read_hf_config(tmp_path / "a"))
    assert (model.family, model.num_experts, model.moe_router_topk, model.rotary_percent) == ("minimax_m2", 8, 2, 0.5)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.block_sparse_moe.e_score_correction_bias"].abs().min() > 0


def test_gpt_oss_model_is_seeded_and_converts(tmp_path: Path) -> None:
    """`--family gpt_oss` builds the gpt-oss-shaped policy: its config.json (the legacy rope_theta and torch_dtype
    keys added) maps to the family with its sliding window, yarn RoPE and clamp; the same seed, the same weights."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    tiny_model.build_model(tmp_path / "a", seed=0, family="gpt_oss")
    tiny_model.build_model(tmp_path / "b", seed=0, family="gpt_oss")
    model = model_config_from_hf(read_hf_config(tmp_path / "a"))
    assert (model.family, model.num_experts, model.moe_router_topk, model.sliding_window) == ("gpt_oss", 8, 2, 16)
    assert (model.rope_scaling, model.yarn_truncate, model.swiglu_limit, model.swiglu_alpha) == (
        "yarn",
        False,
        7,
        1.702,
    )
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 128, 192)
