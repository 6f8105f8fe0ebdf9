"""The configuration's own rules, `check_rules`: what a `Config` must hold whatever the command, before any file
beyond the YAML is read. In order: every numeric field's range and finiteness, the `algorithm` section (its loss
spec and the combinations it cannot run), the model's shape and its parallel layout (unless the architecture still
comes from a checkpoint's config.json), the secrets, the implied keys, then rollout, the asynchronous modes, reward,
train, the critic, the step count, env and logging. Each failure raises one `ConfigError` naming the key path and
what is allowed.

`check_rules` is step 3 of the one validation every entry point runs, `megatron_rl.validation.validate_run`;
`load_config` runs it on what it loaded, and the model and layout checks on the sections they build.

Implied keys: a key that reads another's value only for one choice of it implies that choice:
`reward.custom_function` is read only with `reward.type = custom`, `rollout.sglang_urls` only with
`rollout.engine = sglang`, `critic.hf_path` only with `critic.enabled = true`,
`algorithm.dynamic_sampling_filter` only with `algorithm.dynamic_sampling = true`, `algorithm.advantage_estimator = gae`
(the critic's values) only with `critic.enabled = true`, and `train.epochs` only with `train.steps = null` (the steps are derived from the data: `megatron_rl.config.epochs`). `imply` sets the implied
key while loading when no layer (YAML file, overrides) gives it; `check_implied` refuses the two together with
another choice, naming both keys, so that a setting is never silently ignored (also in a `Config` built in code,
where nothing is implied).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megatron_rl.config.data_files import files_of_config
from megatron_rl.config.derived import loss_spec, optimizer_steps, pipeline_stage_layers, uses_reference
from megatron_rl.config.distill import check_distill
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.reference import describe_type
from megatron_rl.config.schema import (
    REDACTED,
    SECRET_KEYS,
    TRACKERS,
    AlgorithmConfig,
    Config,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    TrainConfig,
)


def check_rules(cfg: Config, *, model_shape: bool = True) -> None:
    """Ranges of every numeric field, then combinations that cannot run (the order of the module doc).

    `model_shape=False` leaves out the checks of the model's shape against itself and the parallel
    layout: for a config whose architecture still comes from a checkpoint's config.json
    (`model.hf_path`, `checkpoint.load`), which is validated whole once read.
    """
    for fld in dataclasses.fields(cfg):
        _check_bounds(getattr(cfg, fld.name), fld.name)
    _validate_algorithm(cfg.algorithm)
    if model_shape:
        _validate_model(cfg.model)
        _validate_parallel(cfg)
    _check_stops(cfg, vocab_size=cfg.model.vocab_size if model_shape else None)
    _validate_secrets(cfg)
    check_implied(cfg)
    _validate_rollout(cfg)
    _validate_async(cfg)
    _validate_reward(cfg.reward)
    _validate_train(cfg.train)
    _validate_data(cfg)
    _validate_critic(cfg)
    check_step_rules(cfg)
    _validate_env(cfg)
    _validate_logging(cfg.logging)
    check_distill(cfg)


@dataclass(frozen=True)
class Implied:
    """`key`, when set (not null, not empty; with `when`: set to that choice), implies `target = value`."""

    key: str
    target: str
    value: str | bool | None
    when: str | None = None

    def applies(self, value: Any) -> bool:
        return bool(value) and (self.when is None or value == self.when)


IMPLIED = (
    Implied("reward.custom_function", "reward.type", "custom"),
    Implied("rollout.sglang_urls", "rollout.engine", "sglang"),
    Implied("critic.hf_path", "critic.enabled", True),
    Implied("algorithm.dynamic_sampling_filter", "algorithm.dynamic_sampling", True),
    Implied("algorithm.advantage_estimator", "critic.enabled", True, when="gae"),
    Implied("train.epochs", "train.steps", None),
)
_ABSENT = object()


def imply(merged: DictConfig, layers: Sequence[DictConfig]) -> None:
    """Set in `merged` each implied key that none of the `layers` gives, when its implying key is set."""
    for rule in IMPLIED:
        given = any(OmegaConf.select(layer, rule.target, default=_ABSENT) is not _ABSENT for layer in layers)
        if rule.applies(OmegaConf.select(merged, rule.key)) and not given:
            OmegaConf.update(merged, rule.target, rule.value)


def check_implied(cfg: Config) -> None:
    """ConfigError naming both keys when an implying key is set but its target holds another choice."""
    for rule in IMPLIED:
        value, target = _value(cfg, rule.key), _value(cfg, rule.target)
        if rule.applies(value) and target != rule.value:
            want, have = _shown(rule.value), _shown(target)
            if rule.when is None:
                raise ConfigError(
                    f"{rule.key} = {value!r} is read only with {rule.target} = {want}, but {rule.target} = "
                    f"{have}: set {rule.target} = {want} (or leave it out: {rule.key} implies it), or remove {rule.key}"
                )
            raise ConfigError(
                f"{rule.key} = {value!r} needs {rule.target} = {want}, but {rule.target} = {have}: set "
                f"{rule.target} = {want} (or leave it out: {rule.key} = {value!r} implies it), or another {rule.key}"
            )


def _shown(value: Any) -> str:
    """A value as the YAML file writes it (true/false, null), or its repr."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _value(cfg: Any, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _validate_secrets(cfg: Config) -> None:
    for key in SECRET_KEYS:
        section, name = key.split(".")
        _require(
            getattr(getattr(cfg, section), name) != REDACTED,
            f"{key} = {REDACTED!r} is what config.yaml writes in place of a key: give the key itself",
        )


def _check_bounds(section: Any, prefix: str) -> None:
    for fld in dataclasses.fields(section):
        value = getattr(section, fld.name)
        key = f"{prefix}.{fld.name}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, key)
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {value} is not a finite number; every numeric key must be finite")
        meta = fld.metadata
        in_range = (
            ("ge" not in meta or value >= meta["ge"])
            and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"])
            and ("lt" not in meta or value < meta["lt"])
        )
        if not in_range:
            raise ConfigError(f"{key} = {value} is out of range; allowed: {describe_type(type(value), dict(meta))}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_algorithm(alg: AlgorithmConfig) -> None:
    loss_spec(alg)
    _require(
        not (alg.turn_credit == "per_turn" and alg.ratio_level == "sequence"),
        "algorithm.turn_credit = 'per_turn' gives each turn's tokens its own advantage, but "
        "algorithm.ratio_level = 'sequence' (GSPO) has one ratio and one advantage per sequence; use "
        "algorithm.name = gspo_token (ratio_level = 'sequence_token'), or turn_credit = 'outcome'",
    )
    _require(
        not (alg.turn_credit == "per_turn" and alg.kl_in_reward),
        "algorithm.kl_in_reward = true penalises each trajectory's reward once, which algorithm.turn_credit = "
        "'per_turn' does not take; use the KL in the loss (kl_in_reward = false) or turn_credit = 'outcome'",
    )
    _validate_estimator(alg)
    _require(
        not (alg.kl_estimator == "k1" and alg.kl_coef > 0 and not alg.kl_in_reward),
        "algorithm.kl_estimator = 'k1' in the loss (algorithm.kl_coef > 0, kl_in_reward = false): the gradient "
        "of k1 = log pi - log pi_ref is that of log pi, whose expectation is 0, so the term only adds noise; "
        "use kl_estimator = 'k3' (or 'k2'), or put k1 in the reward (algorithm.kl_in_reward = true)",
    )
    _require(
        not (alg.kl_in_reward and alg.kl_coef == 0),
        "algorithm.kl_in_reward = true needs algorithm.kl_coef > 0 (the beta of the KL penalty in the reward)",
    )
    if not uses_reference(alg):
        for key in ("ref_path", "ref_offload"):
            _require(
                not getattr(alg, key),
                f"algorithm.{key} = {getattr(alg, key)!r} but no reference model is built "
                "(algorithm.kl_coef = 0 and algorithm.ref_kl_metrics = false)",
            )


def _validate_estimator(alg: AlgorithmConfig) -> None:
    """The combinations of `algorithm.advantage_estimator` that cannot run, and its keys read by one estimator."""
    estimator = alg.advantage_estimator
    _require(
        not (alg.turn_credit == "per_turn" and estimator != "grpo"),
        f"algorithm.turn_credit = 'per_turn' normalises each turn's return within its group (GRPO's form), which "
        f"algorithm.advantage_estimator = '{estimator}' does not take; use advantage_estimator = 'grpo' or "
        "turn_credit = 'outcome'",
    )
    _require(
        not (estimator == "reinforce_plus_plus" and alg.kl_in_reward),
        "algorithm.kl_in_reward = true subtracts each response's summed KL from its outcome reward, but "
        "algorithm.advantage_estimator = 'reinforce_plus_plus' discounts token-level rewards (verl's per-token KL "
        "penalty, not built here); put the KL in the loss (kl_in_reward = false) or use "
        "reinforce_plus_plus_baseline, rloo or grpo",
    )
    _require(
        not (estimator in ("reinforce_plus_plus", "gae") and alg.ratio_level == "sequence"),
        f"algorithm.advantage_estimator = '{estimator}' gives each token its own advantage, but "
        "algorithm.ratio_level = 'sequence' (GSPO) has one ratio and one advantage per sequence; use "
        "ratio_level = 'sequence_token' (gspo_token) or another estimator",
    )
    _require(
        alg.gamma == 1.0 or estimator in ("reinforce_plus_plus", "gae"),
        f"algorithm.gamma = {alg.gamma} is read only by algorithm.advantage_estimator = 'gae' or "
        f"'reinforce_plus_plus', not by '{estimator}' (per-turn discounting is algorithm.turn_discount)",
    )
    _require(
        alg.lam == 1.0 or estimator == "gae",
        f"algorithm.lam = {alg.lam} is read only by algorithm.advantage_estimator = 'gae', not by '{estimator}'",
    )
    _require(
        alg.adv_norm_std or estimator == "grpo",
        f"algorithm.adv_norm_std = false is read only by algorithm.advantage_estimator = 'grpo', not by "
        f"'{estimator}' (rloo never divides by a std; reinforce_plus_plus(_baseline) whiten over the batch)",
    )


def _validate_model(model: ModelConfig) -> None:
    _require(
        model.num_attention_heads % model.num_query_groups == 0,
        f"model.num_attention_heads ({model.num_attention_heads}) must be a multiple of "
        f"model.num_query_groups ({model.num_query_groups})",
    )
    if model.num_experts is not None:
        _require(
            model.moe_router_topk <= model.num_experts,
            f"model.moe_router_topk ({model.moe_router_topk}) exceeds model.num_experts ({model.num_experts})",
        )
        _require(
            model.first_k_dense_layers < model.num_layers,
            f"model.first_k_dense_layers ({model.first_k_dense_layers}) leaves no MoE layer "
            f"in model.num_layers ({model.num_layers})",
        )


def _validate_parallel(cfg: Config) -> None:
    par, model = cfg.parallel, cfg.model
    tp, ep = par.tensor_model_parallel_size, par.expert_model_parallel_size
    _require(
        model.num_attention_heads % tp == 0,
        f"parallel.tensor_model_parallel_size ({tp}) must divide model.num_attention_heads "
        f"({model.num_attention_heads})",
    )
    _require(
        model.num_query_groups % tp == 0,
        f"parallel.tensor_model_parallel_size ({tp}) must divide model.num_query_groups ({model.num_query_groups})",
    )
    pipeline_stage_layers(model, par)
    if model.family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):  # MLA: column-parallel down projections
        latent = {"model.kv_lora_rank + model.qk_rope_head_dim": model.kv_lora_rank + model.qk_rope_head_dim}
        if model.q_lora_rank is not None:
            latent["model.q_lora_rank"] = model.q_lora_rank
        for key, width in latent.items():
            _require(width % tp == 0, f"parallel.tensor_model_parallel_size ({tp}) must divide {key} ({width})")
    if model.num_experts is None:
        _require(ep == 1, f"parallel.expert_model_parallel_size ({ep}) needs an MoE model (model.num_experts)")
    else:
        _require(
            model.num_experts % ep == 0,
            f"parallel.expert_model_parallel_size ({ep}) must divide model.num_experts ({model.num_experts})",
        )
    cp = par.context_parallel_size
    if cp > 1:
        _require(
            cfg.train.micro_batch_tokens == 0 or par.cp_comm_type == "p2p",
            f"parallel.cp_comm_type = {par.cp_comm_type!r} with train.micro_batch_tokens > 0: Transformer Engine's "
            "context parallelism takes packed (THD) sequences with p2p only",
        )
        _require(
            par.cp_comm_type != "a2a" or model.num_query_groups % (tp * cp) == 0,
            f"parallel.cp_comm_type = 'a2a' needs parallel.tensor_model_parallel_size ({tp}) x "
            f"parallel.context_parallel_size ({cp}) to divide model.num_query_groups ({model.num_query_groups})",
        )
    if par.optimizer_cpu_offload:
        _require(
            model.params_dtype != "fp32",
            "parallel.optimizer_cpu_offload = true with model.params_dtype = 'fp32': Megatron-Core 0.16.1's "
            "HybridDeviceOptimizer takes the fp32 master shards of bf16/fp16 parameters only (fp32 ones are views "
            "it cannot optimize); use bf16 or fp16",
        )
        _require(
            par.use_distributed_optimizer,
            "parallel.optimizer_cpu_offload = true needs parallel.use_distributed_optimizer = true",
        )
    _require(
        par.overlap_param_gather is not True or par.use_distributed_optimizer,
        "parallel.overlap_param_gather = true needs parallel.use_distributed_optimizer = true (it gathers its shards)",
    )
    if par.sequence_parallel is False and tp > 1 and model.num_experts is not None:
        raise ConfigError(
            "parallel.sequence_parallel = false with parallel.tensor_model_parallel_size > 1 on an MoE "
            "model: Megatron requires sequence parallel for MoE with TP (set it to true or null)"
        )


def _validate_rollout(cfg: Config) -> None:
    ro = cfg.rollout
    for i, url in enumerate(ro.sglang_urls):
        _require(
            isinstance(url, str) and url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0,
            f"rollout.sglang_urls[{i}] = {url!r} is not an http:// or https:// address (http://host:port)",
        )
    _require(
        ro.engine != "sglang" or bool(ro.sglang_urls),
        "rollout.engine = 'sglang' needs rollout.sglang_urls (the servers' or router's http://host:port)",
    )
    _require(
        not (ro.weight_sync == "tensor" and not ro.colocate),
        "rollout.weight_sync = 'tensor' passes tensors by handle and needs rollout.colocate = true",
    )
    _require(
        not (ro.colocate_offload and not ro.colocate),
        "rollout.colocate_offload = true frees GPU memory for a colocated engine and needs rollout.colocate = true",
    )
    _require(
        not (cfg.algorithm.routing_replay == "r3" and not ro.return_routed_experts),
        "algorithm.routing_replay = 'r3' needs rollout.return_routed_experts = true",
    )
    _require(
        not (cfg.algorithm.routing_replay != "none" and cfg.model.num_experts is None),
        f"algorithm.routing_replay = {cfg.algorithm.routing_replay!r} needs an MoE model (model.num_experts)",
    )


MAX_STOP_STRINGS = 32  # SGLang's limit on a request's stop strings


def _check_stops(cfg: Config, vocab_size: int | None) -> None:
    """rollout.stop and rollout.stop_token_ids; the ids against the vocabulary once the model's is known."""
    stops, ids = list(cfg.rollout.stop), list(cfg.rollout.stop_token_ids)
    _require(
        len(stops) <= MAX_STOP_STRINGS, f"rollout.stop: {len(stops)} stop strings; SGLang takes {MAX_STOP_STRINGS}"
    )
    for i, stop in enumerate(stops):
        _require(isinstance(stop, str) and stop != "", f"rollout.stop[{i}] = {stop!r} is not a non-empty string")
    for i, token in enumerate(ids):
        _require(
            isinstance(token, int) and not isinstance(token, bool) and 0 <= token < (vocab_size or token + 1),
            f"rollout.stop_token_ids[{i}] = {token!r} is not a token id in [0, model.vocab_size = {vocab_size})",
        )


def _validate_async(cfg: Config) -> None:
    ro = cfg.rollout
    if ro.async_mode == "sync":
        return
    _require(
        not ro.colocate,
        f"rollout.async_mode = {ro.async_mode!r} overlaps generation with training, which colocated engines "
        "cannot (rollout.colocate = true: the engine's memory is released while the trainer runs); use "
        "rollout.async_mode = 'sync' or rollout.colocate = false",
    )
    _require(
        not (ro.async_mode == "fully_async" and ro.max_staleness == 0),
        "rollout.async_mode = 'fully_async' with rollout.max_staleness = 0 could only train on samples of the "
        "current weights: the producer would wait for every update, the sync loop in disguise; use "
        "rollout.async_mode = 'sync', or rollout.max_staleness >= 1",
    )


def _validate_train(train: TrainConfig) -> None:
    _require(
        not (train.lr_warmup_steps and train.lr_warmup_ratio),
        f"train.lr_warmup_steps ({train.lr_warmup_steps}) and train.lr_warmup_ratio ({train.lr_warmup_ratio}) both "
        "set the warm-up: set one of them",
    )
    _require(train.min_lr <= train.lr, f"train.min_lr ({train.min_lr}) exceeds train.lr ({train.lr})")


def check_step_rules(cfg: Config) -> None:
    """The rules on the run's step count; with `train.epochs` (steps null until the data is read) they run
    once the steps are derived (`megatron_rl.config.epochs.with_epoch_steps`)."""
    train, critic = cfg.train, cfg.critic
    if train.steps is None:
        return
    total = optimizer_steps(train)  # a ratio below 1 always leaves a step after the warm-up
    _require(
        train.lr_warmup_steps < max(total, 2) or train.lr_decay_style == "constant",
        f"train.lr_warmup_steps ({train.lr_warmup_steps}) must be below the number of optimizer steps "
        f"train.steps x train.updates_per_step x train.ppo_epochs ({total}) for lr_decay_style "
        f"{train.lr_decay_style!r}",
    )
    _require(
        not critic.enabled or critic.warmup_steps < train.steps,
        f"critic.warmup_steps ({critic.warmup_steps}) must be below train.steps ({train.steps}): "
        "the policy would never be updated",
    )


def _validate_data(cfg: Config) -> None:
    """Several train or eval files, their weights and names (`megatron_rl.data.files` reads them); the
    sampled evaluation's n_samples and pass@k."""
    files_of_config(cfg.data)
    ev = cfg.eval
    _require(
        ev.n_samples == 1 or ev.temperature > 0,
        f"eval.n_samples = {ev.n_samples} with eval.temperature = 0: greedy responses to one prompt are all the "
        "same; set eval.temperature > 0 (e.g. 0.6, or rollout.temperature) or eval.n_samples = 1",
    )
    for i, k in enumerate(ev.pass_k):
        _require(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k < ev.n_samples,
            f"eval.pass_k[{i}] = {k!r}: a k in [1, eval.n_samples = {ev.n_samples}) (pass@N is always reported)",
        )


def _validate_critic(cfg: Config) -> None:
    critic = cfg.critic
    _require(
        critic.enabled or critic.warmup_steps == 0,
        f"critic.warmup_steps = {critic.warmup_steps} trains the critic alone first, but critic.enabled = false: "
        "set critic.enabled = true, or critic.warmup_steps = 0",
    )
    estimator = cfg.algorithm.advantage_estimator
    _require(
        not critic.enabled or estimator == "gae",
        f"critic.enabled = true trains a value model whose values only algorithm.advantage_estimator = 'gae' reads, "
        f"but algorithm.advantage_estimator = '{estimator}': set algorithm.advantage_estimator = gae "
        "(algorithm.name = ppo), or critic.enabled = false",
    )


def _validate_logging(logging: LoggingConfig) -> None:
    backends = list(logging.backends)
    unknown = [b for b in backends if b not in TRACKERS]
    _require(not unknown, f"logging.backends: unknown {unknown}; allowed: any of {list(TRACKERS)}")
    _require(len(set(backends)) == len(backends), f"logging.backends = {backends} names a backend twice")


def _validate_reward(reward: RewardConfig) -> None:
    if reward.type != "remote":
        return
    _require(
        bool(reward.url),
        "reward.type = 'remote' needs reward.url, the reward server's endpoint "
        "(e.g. http://host:8000/score from `megatron-rl reward-server`)",
    )
    _require(
        str(reward.url).startswith(("http://", "https://")),
        f"reward.url = {reward.url!r} must start with http:// or https://",
    )


def _validate_env(cfg: Config) -> None:
    env = cfg.env
    # a budget of the model's positions (the default a training stage fills in) is never too small: what
    # cannot fit there cannot be served at all
    _require(
        env.max_total_tokens is None
        or env.max_total_tokens > cfg.data.max_prompt_tokens
        or env.max_total_tokens >= cfg.model.max_position_embeddings,
        f"env.max_total_tokens ({env.max_total_tokens}) must exceed data.max_prompt_tokens "
        f"({cfg.data.max_prompt_tokens}): a prompt must leave room for the model's first turn",
    )
    _require(
        env.type != "http_tool" or bool(env.tool_url),
        "env.type = 'http_tool' needs env.tool_url, the tool server's endpoint (http://host:port/path)",
    )
    agents = [key for key in ("agent", "agent_command") if getattr(env, key)]
    _require(
        env.type != "agent" or len(agents) == 1,
        "env.type = 'agent' needs exactly one of env.agent (module:function) and env.agent_command (a command), "
        f"got {'both' if agents else 'neither'}",
    )
    stray = [*agents, *(["agent_reward"] if env.agent_reward else [])]
    _require(
        env.type == "agent" or not stray,
        f"env.{stray[0] if stray else 'agent'} is set but env.type = {env.type!r}: it is read only with env.type=agent",
    )
    _require(
        env.tool_url is None or str(env.tool_url).startswith(("http://", "https://")),
        f"env.tool_url = {env.tool_url!r} must start with http:// or https://",
    )
