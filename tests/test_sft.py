"""`megatron-rl sft`: examples and loss by hand, config errors, and one 2-rank (EP=2) run of the CLI.

The run is the example's warm start, shortened, that test_example_learns trains from (tests/mrl_runs.py
`tiny_math_warm_start`), checked against `transformers`: the first step's loss is the token-mean NLL of
the starting HF model on that step's rows (same rows, prompt masked, EOS included, normalised over both
ranks).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.cli import main as cli_main
from megatron_rl.config import ConfigError, DataConfig, ModelConfig, load_config
from megatron_rl.data import PromptSampler
from megatron_rl.losses import Normalizer
from megatron_rl.sft import cross_entropy_loss, load_sft_examples, sft_batch

import tiny_model
import tiny_tokenizer
from mrl_runs import EXAMPLE, ROOT, SFT_EVAL_PROMPTS, SFT_EVAL_SAMPLES, SFT_ROWS, SFT_STEPS, WarmStart


def test_cross_entropy_by_hand_and_split_invariant() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -3.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    norm = Normalizer(num_tokens=3.0, num_sequences=2.0, token_norm=32.0)
    loss, metrics = cross_entropy_loss(logprobs, {}, mask, norm)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    assert metrics["tokens"].item() == 3 and metrics["loss"].item() == pytest.approx(3.5 / 3)
    halves = [cross_entropy_loss(logprobs[i : i + 1], {}, mask[i : i + 1], norm)[0] for i in range(2)]
    assert (halves[0] + halves[1]).item() == pytest.approx(loss.item())  # micro-batch shares add up
    grad = torch.zeros_like(logprobs, requires_grad=True)
    cross_entropy_loss(grad, {}, mask, norm)[0].backward()
    assert torch.equal(grad.grad, -mask.float() / 3)  # d loss / d logp = -1/N on loss tokens only


def test_examples_from_rows(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer.build_tokenizer()
    good = {"prompt": [{"role": "user", "content": "2+4*5="}], "reward_model": {"ground_truth": "22"}}
    lines = [
        json.dumps({**good, "response": "4*5=20\nAnswer: 22"}),
        json.dumps(good),  # no response
        json.dumps({**good, "response": " "}),  # blank response
        "{not json",
        json.dumps({**good, "prompt": "3+2*2=", "response": "7"}),  # a plain-string prompt is a user message
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(lines) + "\n")
    examples, report = load_sft_examples(path, tokenizer, DataConfig())
    user, assistant, eos = 4, 5, 1
    ids = tokenizer.get_vocab()
    chars = lambda text: tuple(ids[c] for c in text)  # noqa: E731
    assert [(e.prompt_ids, e.response_ids) for e in examples] == [
        ((user, *chars("2+4*5="), assistant), (*chars("4*5=20\nAnswer: 22"), eos)),
        ((user, *chars("3+2*2="), assistant), (*chars("7"), eos)),
    ]
    assert report.counts == {"invalid_json": 1, "missing_key": 1, "empty_answer": 1}
    assert [s.location.number for s in report.skipped] == [2, 3, 4]
    batch = sft_batch(load_sft_examples(path, tokenizer, DataConfig())[0])
    assert batch.prompt_lengths == [8, 8]
    assert batch.tokens[1].tolist() == [user, *chars("3+2*2="), assistant, *chars("7"), eos]
    assert [batch.response_length(i) for i in range(2)] == [18, 2]
    with pytest.raises(ValueError, match="no examples"):
        sft_batch([])


def test_response_key_is_configurable(tmp_path: Path) -> None:
    row = {"prompt": "2+4*5=", "target": {"text": "22"}}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    tokenizer = tiny_tokenizer.build_tokenizer()
    examples, _ = load_sft_examples(tmp_path / "rows.jsonl", tokenizer, DataConfig(response_key="target.text"))
    assert examples[0].response_ids == (8, 8, 1)


def test_config_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(EXAMPLE / "sft.yaml")
    assert cli_main(["sft", config, "data.train_path=null"]) == 2
    assert "data.train_path" in capsys.readouterr().err
    assert cli_main(["sft", config, "model.hf_path=null"]) == 2
    assert "model.hf_path or checkpoint.load" in capsys.readouterr().err
    assert cli_main(["sft", config, "train.stepz=3"]) == 2
    assert "train.stepz" in capsys.readouterr().err


def test_model_section_is_checked_against_the_hf_folder(tmp_path: Path) -> None:
    from megatron_rl.actor.actor import hf_initializer

    tiny_model.build_model(tmp_path / "model")
    model = ModelConfig(**tiny_model.MEGATRON_MODEL, hf_path=str(tmp_path / "model"))
    hf_initializer(model)  # matches: no error, nothing read yet
    with pytest.raises(ConfigError, match=r"model\.rope_theta = 1000000\.0, but .*config\.json.* describes 10000\.0"):
        hf_initializer(ModelConfig(**{**tiny_model.MEGATRON_MODEL, "rope_theta": 1e6}, hf_path=str(tmp_path / "model")))
    with pytest.raises(ConfigError, match=r"model\.num_experts = 4"):
        hf_initializer(ModelConfig(**{**tiny_model.MEGATRON_MODEL, "num_experts": 4}, hf_path=str(tmp_path / "model")))


def _nll_of_first_step(model_dir: Path, assets: Path, cfg_overrides: list[str]) -> float:
    """Token-mean NLL of the response tokens of step 1's rows under the HF model in `model_dir`."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(EXAMPLE / "sft.yaml", cfg_overrides)
    tokenizer = tiny_tokenizer.build_tokenizer()
    examples, _ = load_sft_examples(assets / "data" / "sft.jsonl", tokenizer, cfg.data)
    rows = PromptSampler.from_config(examples, cfg.data).next(SFT_ROWS)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.prompt_ids + row.response_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            targets = ids[0, 1:]
            picked = logp.gather(-1, targets[:, None])[:, 0][len(row.prompt_ids) - 1 :]
            total -= float(picked.sum())
            count += len(row.response_ids)
    return total / count


@pytest.mark.e2e
def test_sft_run_outputs(warm_start: WarmStart) -> None:
    """The example's SFT stage on 2 ranks (EP=2), as the shared warm start runs it (tests/mrl_runs.py)."""
    from megatron_rl.metrics import read_metrics

    records = read_metrics(warm_start.run_dir)
    steps, warmup, peak = SFT_STEPS, SFT_STEPS // 20, 2e-3
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["step"] for r in records if "eval/greedy_accuracy" in r] == [steps]  # eval.every = 0: the end only
    final = records[-1]
    assert final["eval/prompts"] == SFT_EVAL_PROMPTS
    assert 0 <= final["eval/greedy_accuracy"] <= final[f"eval/pass@{SFT_EVAL_SAMPLES}"] <= 1
    # a linear warm-up reaching the peak at update `warmup`, then cosine towards min_lr = 0 after the last update
    assert records[0]["sft/lr"] == pytest.approx(peak / warmup)
    assert records[warmup - 1]["sft/lr"] == pytest.approx(peak)
    decayed = (steps - warmup) / (steps - warmup + 1)
    assert records[-1]["sft/lr"] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * decayed)))
    assert all(r["sft/tokens"] > SFT_ROWS and r["sft/updates"] == 1 for r in records)
    assert (warm_start.run_dir / "checkpoints" / f"step_{steps:06d}").is_dir()
    assert load_config(warm_start.run_dir / "config.yaml").train.steps == steps
    # The first step's loss is the HF model's token-mean NLL on the same rows (both ranks' tokens).
    nll = _nll_of_first_step(warm_start.assets / "model", warm_start.assets, list(warm_start.overrides))
    assert records[0]["sft/loss"] == pytest.approx(nll, abs=1e-5)


@pytest.mark.e2e
def test_sft_exports_a_loadable_trained_folder(warm_start: WarmStart) -> None:
    from safetensors.torch import load_file

    hf = warm_start.policy
    assert (hf / "tokenizer.json").is_file() and (hf / "config.json").is_file()
    before = load_file(str(warm_start.assets / "model" / "model.safetensors"))
    after: dict[str, torch.Tensor] = {}
    for file in hf.glob("*.safetensors"):
        after.update(load_file(str(file)))
    assert set(after) == set(before)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed


def one_process_sft_command(assets: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`megatron-rl sft` of the example's sft.yaml on `assets` into `run_dir` as a world of one
    (EP=1), 8 rows a step, no evaluation, no progress bar or TensorBoard, then `overrides`."""
    settings = [
        f"model.hf_path={assets / 'model'}",
        f"data.train_path={assets / 'data' / 'sft.jsonl'}",
        "data.eval_path=null",
        "parallel.expert_model_parallel_size=1",
        f"logging.run_dir={run_dir}",
        "train.prompts_per_step=8",
        "logging.progress=false",
        "logging.backends=[]",
    ]
    return [sys.executable, "-m", "megatron_rl.cli", "sft", str(EXAMPLE / "sft.yaml"), *settings, *overrides]


def _sft_one_process(assets: Path, run_dir: Path, *extra: str) -> str:
    """`megatron-rl sft --resume-if-any` as a world of one, 3 steps, a checkpoint after every step (all
    kept); returns its console output."""
    steps = ["train.steps=3", "train.lr_warmup_steps=1", "checkpoint.every=1", "checkpoint.keep_last=3"]
    cmd = [*one_process_sft_command(assets, run_dir, *steps, *extra), "--resume-if-any"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


@pytest.mark.e2e
def test_sft_resume_skips_a_truncated_shard_and_matches_an_uninterrupted_run(assets: Path, tmp_path: Path) -> None:
    from megatron_rl.checkpoints import ACTOR_DIR, checkpoint_dir, resume_point
    from megatron_rl.metrics import read_metrics

    straight = tmp_path / "straight"
    assert "resuming from scratch: no checkpoint" in _sft_one_process(assets, straight)
    # the run as if killed while writing step 3's checkpoint, after a disk fault cut step 2's first
    # Megatron shard in half: the resume skips step 2 (its manifest names the shard's size) for step 1
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    root = resumed / "checkpoints"
    shutil.rmtree(checkpoint_dir(root, 3))
    shards = sorted((checkpoint_dir(root, 2) / ACTOR_DIR).glob("*.distcp"))
    assert shards, sorted(p.name for p in (checkpoint_dir(root, 2) / ACTOR_DIR).iterdir())
    os.truncate(shards[0], shards[0].stat().st_size // 2)
    out = _sft_one_process(assets, resumed)
    assert f"{shards[0]} holds" in out and "truncated" in out
    assert f"resuming from {checkpoint_dir(root, 1)} (step 1)" in out

    def sft_metrics(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k == "step" or k.startswith("sft/")} for r in read_metrics(run_dir)]

    assert [r["step"] for r in sft_metrics(resumed)] == [1, 2, 3]
    assert sft_metrics(resumed) == sft_metrics(straight)
    assert resume_point(root)[1].step == 3  # type: ignore[index]
    assert not list(root.glob("*.tmp"))
