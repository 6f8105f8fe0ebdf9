"""Configuration: presets, YAML + overrides, and one clear error per bad input."""

import dataclasses
import subprocess
import sys
import textwrap
import typing

import pytest

from megatron_rl.config import PRESETS, AlgorithmConfig, ConfigError, load_config, loss_spec, preset, reference_rows
from megatron_rl.losses.spec import BOUNDS, CHOICES, LossSpec


def test_presets_carry_published_defaults():
    dapo = preset("dapo")
    assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.dynamic_sampling and dapo.soft_overlong_punishment and dapo.kl_coef == 0.0
    gspo = preset("gspo")
    assert (gspo.ratio_level, gspo.clip_eps_low, gspo.clip_eps_high) == ("sequence", 3e-4, 4e-4)
    assert preset("gspo_token").ratio_level == "sequence_token"
    sapo = preset("sapo")
    assert (sapo.gate, sapo.sapo_tau_pos, sapo.sapo_tau_neg) == ("soft", 1.0, 1.05)
    grpo = preset("grpo")
    assert (grpo.clip_eps_low, grpo.clip_eps_high, grpo.kl_estimator) == (0.2, 0.2, "k3")
    opd = preset("opd")  # on-policy distillation: the token-level clipped surrogate, token-mean
    assert (opd.ratio_level, opd.loss_agg_mode, opd.kl_coef) == ("token", "token-mean", 0.0)
    ppo = preset("ppo")  # verl 0.9.1's ppo_trainer.yaml: the token-level clip, GAE with gamma = lambda = 1, no KL
    assert (ppo.ratio_level, ppo.clip_eps_low, ppo.clip_eps_high, ppo.loss_agg_mode) == (
        "token",
        0.2,
        0.2,
        "token-mean",
    )
    assert (ppo.advantage_estimator, ppo.gamma, ppo.lam, ppo.kl_coef, ppo.dual_clip_c) == ("gae", 1.0, 1.0, 0.0, None)
    assert sorted(PRESETS) == ["dapo", "grpo", "gspo", "gspo_token", "opd", "ppo", "sapo"]


def test_yaml_then_overrides_win_over_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent("""
        algorithm:
          name: dapo
          clip_eps_high: 0.3
        train:
          lr: 2.0e-6
    """)
    )
    cfg = load_config(path, ["train.lr=5e-6", "algorithm.kl_coef=0.01"])
    assert cfg.algorithm.name == "dapo"
    assert cfg.algorithm.clip_eps_high == 0.3  # YAML over preset
    assert cfg.algorithm.clip_eps_low == 0.2  # preset over class default
    assert cfg.algorithm.loss_agg_mode == "token-mean"
    assert cfg.train.lr == 5e-6 and cfg.algorithm.kl_coef == 0.01  # overrides over YAML


def test_override_can_switch_preset_of_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  name: dapo\n")
    cfg = load_config(path, ["algorithm.name=gspo"])
    assert (cfg.algorithm.ratio_level, cfg.algorithm.clip_eps_high, cfg.algorithm.dynamic_sampling) == (
        "sequence",
        4e-4,
        False,
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algorithm.clip_eps_high=-0.1"], r"algorithm\.clip_eps_high = -0\.1 is out of range; allowed: float >= 0"),
        (["algorithm.clip_eps_low=1.0"], r"algorithm\.clip_eps_low .*allowed: float >= 0, < 1"),
        (["algorithm.colour=1"], r"algorithm\.colour: .*allowed: keys of algorithm are \[.*'clip_eps_high'"),
        (["trian.lr=1"], r"trian: .*allowed: keys of the root are \[.*'train'"),
        (["train.lr=fast"], r"train\.lr: .*'fast'.*allowed: float >= 0"),
        (["algorithm.loss_agg_mode=mean"], r"algorithm\.loss_agg_mode: .*allowed: \['token-mean'"),
        (["algorithm.name=trpo"], r"algorithm\.name: unknown objective 'trpo'; allowed: \['dapo', 'grpo'"),
        (
            ["algorithm.name=gspo", "algorithm.loss_agg_mode=token-mean"],
            r"algorithm\.loss_agg_mode = 'token-mean' is not supported with algorithm\.ratio_level = 'sequence'; "
            r"allowed: \['seq-mean-token-mean'\]",
        ),
        (["algorithm.name=sapo", "algorithm.ratio_level=sequence"], r"algorithm\.gate = 'soft'"),
        (["algorithm.dual_clip_c=0.5"], r"algorithm\.dual_clip_c = 0\.5 is out of range; allowed: float > 1"),
        (["algorithm.routing_replay=r3"], r"rollout\.return_routed_experts"),
        (["algorithm.routing_replay=r3", "algorithm.old_logprob_source=rollout"], r"rollout\.return_routed_experts"),
        (["algorithm.kl_in_reward=true"], r"algorithm\.kl_in_reward = true needs algorithm\.kl_coef > 0"),
        (["algorithm.ref_path=/x"], r"algorithm\.ref_path = '/x' but no reference model is built"),
        (
            ["parallel.expert_model_parallel_size=3"],
            r"parallel\.expert_model_parallel_size \(3\) must divide model\.num_experts \(8\)",
        ),
        (
            ["parallel.tensor_model_parallel_size=3"],
            r"parallel\.tensor_model_parallel_size \(3\) must divide model\.num_attention_heads \(4\)",
        ),
        (
            ["model.num_layers=3", "parallel.pipeline_model_parallel_size=2"],
            r"parallel\.pipeline_model_parallel_size \(2\) must divide model\.num_layers \(3\)",
        ),
        (["model.num_attention_heads=6", "model.num_query_groups=4"], r"model\.num_attention_heads \(6\)"),
        (["rollout.engine=sglang"], r"rollout\.sglang_urls"),
        (["rollout.weight_sync=tensor"], r"rollout\.colocate"),
        (["rollout.top_p=0"], r"rollout\.top_p = 0\.0 is out of range; allowed: float > 0, <= 1"),
        (["train.lr"], r"override 'train\.lr': expected key=value"),
    ],
)
def test_bad_config_names_key_and_allowed_values(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_missing_and_malformed_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"(?s)bad\.yaml: not valid YAML: .*line 3"):
        load_config(bad)
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text("train:\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"train\.steps: .*\(from .*wrong\.yaml\)"):
        load_config(wrong_type)


def test_algorithm_choices_and_bounds_are_those_of_the_loss_spec():
    hints = typing.get_type_hints(AlgorithmConfig)
    for name, choices in CHOICES.items():
        assert typing.get_args(hints[name]) == choices, name
    fields = {fld.name: fld for fld in dataclasses.fields(AlgorithmConfig)}
    for name, bounds in BOUNDS.items():
        assert {k: v for k, v in fields[name].metadata.items() if k != "help"} == bounds, name
    assert typing.get_args(hints["name"]) == tuple(PRESETS)
    assert all(isinstance(loss_spec(preset(name)), LossSpec) for name in PRESETS)  # every preset can run
    with pytest.raises(ConfigError, match=r"algorithm\.is_mask_min \(3\.0\) must be below algorithm\.is_mask_max"):
        load_config(None, ["algorithm.is_mask_min=3.0"])


def test_every_field_is_documented():
    rows = reference_rows()
    assert len({key for key, *_ in rows}) == len(rows) > 100
    assert all(help_text.strip() for *_, help_text in rows)


def test_cli_prints_resolved_config_and_errors():
    ok = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "config", "algorithm.name=sapo", "--check", "none"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "sapo_tau_neg: 1.05" in ok.stdout and "gate: soft" in ok.stdout
    assert ok.stdout.endswith("# checked: types, ranges and combinations only (--check none)\n")
    bad = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "config", "train.steps=-1"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "train.steps = -1 is out of range" in bad.stderr


def test_docs_reference_is_current():
    """docs/configuration.md's key table is `megatron-rl config --reference`, row for row (no key missing, none
    removed, same order); regenerate it when a field changes."""
    from pathlib import Path

    page = Path(__file__).parents[1] / "docs" / "configuration.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    header = "| key | type | default | meaning |"
    assert header in lines, f"{page}: no config reference table ({header})"
    table = []
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    expected = [
        f"| `{key}` | {kind} | `{default}` | {help_text} |" for key, kind, default, help_text in reference_rows()
    ]
    missing = [row for row in expected if row not in table]
    extra = [row for row in table if row not in expected]
    assert not missing and not extra, (
        f"{page.name}'s config reference is stale (missing or changed: {missing}; not a current key: {extra}): "
        "paste `megatron-rl config --reference`"
    )
    assert table == expected, f"{page.name}'s config reference is out of order: paste `megatron-rl config --reference`"


def test_model_shape_checks_wait_for_the_checkpoints_config():
    """With model.hf_path the architecture comes from config.json: the YAML's model section is not held against TP."""
    overrides = ["parallel.tensor_model_parallel_size=4"]
    with pytest.raises(ConfigError, match=r"must divide model\.num_attention_heads \(4\)|num_query_groups \(2\)"):
        load_config(None, overrides)
    cfg = load_config(None, [*overrides, "model.hf_path=/models/qwen3-30b-a3b"])
    assert cfg.parallel.tensor_model_parallel_size == 4


@pytest.mark.parametrize(
    "override",
    ["reward.incorrect_reward=nan", "reward.incorrect_reward=-inf", "algorithm.kl_coef=inf", "train.lr=inf"],
)
def test_a_non_finite_number_is_refused_naming_the_key(override: str) -> None:
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key} = {value} is not a finite number"):
        load_config(None, [override])


def test_a_non_finite_number_in_a_yaml_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("reward:\n  correct_reward: .nan\n")
    with pytest.raises(ConfigError, match=r"^reward\.correct_reward = nan is not a finite number"):
        load_config(path)


@pytest.mark.parametrize("value", ["2", "0", "'true'", "1.0"])
def test_a_bool_key_refuses_a_value_that_is_not_a_bool(value: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.partial_rollout = .* \(from the command line\) is not a bool"):
        load_config(None, [f"rollout.partial_rollout={value}"])
    path = tmp_path / "run.yaml"
    path.write_text(f"parallel:\n  sequence_parallel: {value}\n")
    with pytest.raises(ConfigError, match=rf"^parallel\.sequence_parallel = .* \(from {path}\) is not a bool"):
        load_config(path)
    assert load_config(None, ["rollout.partial_rollout=false"]).rollout.partial_rollout is False
    assert load_config(None, ["parallel.sequence_parallel=null"]).parallel.sequence_parallel is None


@pytest.mark.parametrize("url", ["ftp://x", "http://", "localhost:30000", "3"])
def test_an_sglang_url_that_is_not_http_is_refused_naming_its_index(url: str) -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.sglang_urls\[1\] = .* is not an http:// or https:// address"):
        load_config(None, [f"rollout.sglang_urls=[http://a:1,{url}]", "rollout.engine=sglang"])
    assert load_config(None, ["rollout.sglang_urls=[https://b]"]).rollout.sglang_urls == ["https://b"]


def test_the_logprob_gap_bound_follows_the_training_dtype_unless_set():
    """bf16 engines differ from the trainer by far more than fp32 ones (published 0.005-0.34 per token),
    so the default bound is the dtype's; a set value wins and 0 turns the check off."""
    from megatron_rl.config import LOGPROB_GAP_BY_DTYPE, logprob_gap_limit

    def limit(*overrides: str) -> float | None:
        return logprob_gap_limit(load_config(None, list(overrides)))

    assert limit() == LOGPROB_GAP_BY_DTYPE["fp32"] == 0.05
    assert limit("model.params_dtype=bf16") == LOGPROB_GAP_BY_DTYPE["bf16"] == 0.5
    assert limit("model.params_dtype=bf16", "rollout.max_logprob_gap=0.2") == 0.2
    assert limit("rollout.max_logprob_gap=0") is None
    with pytest.raises(ConfigError, match=r"rollout\.max_logprob_gap"):
        load_config(None, ["rollout.max_logprob_gap=-1"])


@pytest.mark.parametrize(
    ("given", "key", "value"),
    [("reward.custom_function=my_rewards:score", "type", "custom"), ("rollout.sglang_urls=[http://a:1]", "engine", "sglang")],
)  # fmt: skip
def test_a_key_read_only_for_one_choice_implies_it_and_refuses_another(tmp_path, given: str, key: str, value: str):
    """reward.custom_function and rollout.sglang_urls were silently ignored under the default reward.type
    and rollout.engine: a run scored by the wrong rule, or trained on its own local engine."""
    section = given.split(".")[0]
    assert getattr(getattr(load_config(None, [given]), section), key) == value  # from the command line
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {given.split('.', 1)[1].replace('=', ': ', 1)}\n")
    assert getattr(getattr(load_config(path), section), key) == value  # from the YAML file
    other = "dapo" if section == "reward" else "local"
    for layers in ((path, [f"{section}.{key}={other}"]), (None, [given, f"{section}.{key}={other}"])):
        with pytest.raises(ConfigError) as err:
            load_config(*layers)
        message = str(err.value)
        assert message.startswith(given.split("=")[0]) and f"{section}.{key} = '{other}'" in message, message
        assert "\n" not in message
    explicit = load_config(path, [f"{section}.{key}={value}"])  # the same choice given: nothing to refuse
    assert getattr(getattr(explicit, section), key) == value
    assert getattr(getattr(load_config(None, []), section), key) == other  # nothing set: the default holds


def test_rollout_stops_reach_the_engines_request_and_bad_ones_are_refused():
    from megatron_rl.rollout.types import SamplingParams

    cfg = load_config(None, ["rollout.stop=[</answer>,'Q:']", "rollout.stop_token_ids=[7,1000]"])
    params = SamplingParams.from_config(cfg.rollout, temperature=0.5).to_sglang()
    assert params["stop"] == ["</answer>", "Q:"] and params["stop_token_ids"] == [7, 1000]
    assert "stop" not in SamplingParams.from_config(load_config(None, []).rollout).to_sglang()
    for override, message in (
        ("rollout.stop=['']", r"rollout.stop\[0\] = '' is not a non-empty string"),
        ("rollout.stop_token_ids=[3,-1]", r"rollout.stop_token_ids\[1\] = -1 is not a token id"),
        ("rollout.stop_token_ids=[1024]", r"rollout.stop_token_ids\[0\] = 1024 .*model.vocab_size = 1024"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])


def test_train_epochs_implies_null_steps_and_both_set_are_refused_naming_both(tmp_path):
    from megatron_rl.config import Config, TrainConfig, check_rules, to_yaml

    assert (load_config(None, ["train.epochs=3"]).train.steps, load_config(None, []).train.steps) == (None, 100)
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 40\n")  # a YAML that gives the steps, then the epochs on the command line
    for layers in ((path, ["train.epochs=3"]), (None, ["train.epochs=3", "train.steps=40"])):
        with pytest.raises(ConfigError) as err:
            load_config(*layers)
        message = str(err.value)
        assert message.startswith("train.epochs = 3 ") and "train.steps = 40" in message and "\n" not in message
        assert "set train.steps = null" in message
    assert load_config(path, ["train.epochs=3", "train.steps=null"]).train.steps is None
    with pytest.raises(ConfigError, match=r"^train\.epochs = 2 is read only with train\.steps = null"):
        check_rules(Config(train=TrainConfig(epochs=2)))  # in code: the default steps are a choice too
    check_rules(Config(train=TrainConfig(epochs=2, steps=None)))
    # the rules on the step count wait for it: a warm-up longer than any run the data could give passes here
    check_rules(Config(train=TrainConfig(epochs=2, steps=None, lr_warmup_steps=10**6, lr_decay_style="cosine")))
    assert "  steps: null\n  epochs: 2\n" in to_yaml(Config(train=TrainConfig(epochs=2, steps=None)))


def test_the_steps_of_train_epochs_by_hand(tmp_path):
    from megatron_rl.config import epoch_steps, optimizer_steps, prompts_per_round, to_yaml, with_epoch_steps

    assert epoch_steps(3, 10, 4) == 8  # 30 prompts drawn in steps of 4: 7.5 steps, rounded up
    assert (epoch_steps(1, 8, 4), epoch_steps(2, 1, 32), epoch_steps(5, 64, 32)) == (2, 1, 10)
    cfg = load_config(None, ["train.epochs=3", "train.prompts_per_step=4", "train.updates_per_step=2"])
    resolved, line = with_epoch_steps(cfg, 10, prompts_per_round(cfg))
    assert (resolved.train.steps, resolved.train.epochs, optimizer_steps(resolved.train)) == (8, 0, 16)
    assert line == "train.epochs = 3: 8 steps (ceil(3 x 10 usable prompts / 4 per step))"
    assert with_epoch_steps(load_config(None, ["train.steps=7"]), 10, 4) == (load_config(None, ["train.steps=7"]), "")
    path = tmp_path / "config.yaml"  # RUN_DIR/config.yaml of the resolved run loads and runs as it ran
    path.write_text(to_yaml(resolved))
    assert load_config(path).train == resolved.train
    # dynamic sampling: a step's first round draws ceil(4 x 1.5) = 6 prompts, so 30 / 6 = 5 steps
    dapo = load_config(None, ["algorithm.name=dapo", "algorithm.oversample_factor=1.5", "train.epochs=3"])
    dapo = dataclasses.replace(dapo, train=dataclasses.replace(dapo.train, prompts_per_step=4))
    assert prompts_per_round(dapo) == 6 and with_epoch_steps(dapo, 10, prompts_per_round(dapo))[0].train.steps == 5
    # the rules on the step count, checked on the derived one, name it
    warm = load_config(None, ["train.epochs=1", "train.lr_warmup_steps=3", "train.lr_decay_style=linear"])
    with pytest.raises(ConfigError) as err:
        with_epoch_steps(warm, 10, 4)
    message = str(err.value)
    assert "train.lr_warmup_steps (3) must be below the number of optimizer steps" in message and "\n" not in message
    assert message.endswith("(3) for lr_decay_style 'linear' (train.steps = 3 from train.epochs = 1)")
