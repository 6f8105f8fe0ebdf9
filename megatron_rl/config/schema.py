"""The configuration tree: one OmegaConf structured dataclass per section, `Config` their root.

Each field carries its documentation (`help`, with the unit) in the dataclass field metadata, and
optional numeric bounds (`ge`, `gt`, `le`, `lt`) that `megatron_rl.config.rules` checks and
`megatron_rl.config.reference` describes. Nothing here reads a file or checks a value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.critic import CriticConfig
from megatron_rl.config.data_schema import DataConfig, EvalConfig
from megatron_rl.config.distill import DistillConfig
from megatron_rl.config.fields import described as _f
from megatron_rl.config.model_extras import FusionConfig, LinearAttentionConfig, LoraConfig, linear_attention_section
from megatron_rl.config.parallel_schema import ParallelConfig
from megatron_rl.config.presets import PRESETS
from megatron_rl.losses.spec import AGGREGATION_MODES, BOUNDS, GATES, IS_LEVELS, IS_MODES, KL_ESTIMATORS, RATIO_LEVELS

Family = Literal["qwen3_moe", "qwen3", "qwen2", "mixtral", "deepseek_v3", "glm4_moe", "llama", "mistral", "minimax_m2",
                 "gpt_oss", "gemma2", "gemma3_text", "deepseek_v32", "glm_moe_dsa",
                 "qwen3_next", "qwen3_5_moe"]  # fmt: skip
# MLA families (DeepSeek's attention), and those of them with DeepSeek sparse attention (a lightning indexer).
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
SPARSE_ATTENTION_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
Dtype = Literal["fp32", "bf16", "fp16"]
TRACKERS = ("tensorboard", "wandb", "mlflow")  # logging.backends


@dataclass
class ModelConfig:
    family: Family = _f("qwen3_moe", "model family: sets the layer layout and the HF name mapping")
    hf_path: str | None = _f(None, "Hugging Face checkpoint folder to start from (converted in memory)")
    num_layers: int = _f(2, "transformer layers", ge=1)
    hidden_size: int = _f(128, "model width", ge=1)
    ffn_hidden_size: int = _f(256, "dense MLP width (dense layers and dense families)", ge=1)
    num_attention_heads: int = _f(4, "query heads", ge=1)
    num_query_groups: int = _f(2, "key/value heads (GQA groups)", ge=1)
    kv_channels: int | None = _f(None, "head dimension; null = hidden_size / num_attention_heads")
    vocab_size: int = _f(1024, "tokenizer vocabulary size (before Megatron's padding)", ge=1)
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this (times TP)", ge=1)
    max_position_embeddings: int = _f(4096, "longest sequence in tokens", ge=1)
    rope_theta: float = _f(1000000.0, "RoPE base", gt=0)
    norm_epsilon: float = _f(1e-6, "RMSNorm epsilon", gt=0)
    qk_layernorm: bool = _f(True, "RMSNorm on per-head queries and keys (Qwen3)")
    add_qkv_bias: bool = _f(False, "bias on the QKV projection (Qwen2)")
    tie_word_embeddings: bool = _f(False, "share the input embedding with the output layer")
    num_experts: int | None = _f(8, "routed experts per MoE layer; null = dense model", ge=1)
    moe_router_topk: int = _f(2, "experts per token", ge=1)
    moe_ffn_hidden_size: int = _f(128, "width of one expert", ge=1)
    moe_layer_freq: int = _f(1, "every n-th layer is MoE (1 = all)", ge=1)
    first_k_dense_layers: int = _f(0, "leading layers with a dense MLP", ge=0)
    moe_router_norm_topk: bool = _f(True, "renormalise the top-k routing weights to sum to 1")
    moe_aux_loss_coeff: float = _f(0.0, "load-balancing auxiliary loss weight", ge=0)
    moe_shared_expert_size: int | None = _f(
        None,
        "width of the shared expert of each MoE layer (n_shared_experts x moe_intermediate_size); null = none",
        ge=1,
    )
    moe_router_num_groups: int | None = _f(None, "expert groups of group-limited routing (n_group); null = none", ge=1)
    moe_router_group_topk: int | None = _f(None, "groups each token may use (topk_group); null = all", ge=1)
    moe_router_scaling_factor: float = _f(1.0, "routed experts' gate weights times this (routed_scaling_factor)", gt=0)
    freeze_expert_bias: bool = _f(
        True,
        "sigmoid-router families: keep the expert bias (e_score_correction_bias) fixed during RL; false = "
        "Megatron's load-balancing update after every optimizer step (synced to the engine either way)",
    )
    expert_bias_update_rate: float = _f(1e-3, "expert-bias update step when model.freeze_expert_bias = false", gt=0)
    q_lora_rank: int | None = _f(None, "MLA: rank of the query compression; null = a full q_proj", ge=1)
    kv_lora_rank: int = _f(512, "MLA: rank of the key/value compression", ge=1)
    qk_nope_head_dim: int = _f(128, "MLA: query/key head dimension without RoPE", ge=1)
    qk_rope_head_dim: int = _f(64, "MLA: query/key head dimension with RoPE", ge=1)
    v_head_dim: int = _f(128, "MLA: value head dimension", ge=1)
    dsa_index_n_heads: int | None = _f(None, "DeepSeek sparse attention: indexer heads (index_n_heads)", ge=1)
    dsa_index_head_dim: int | None = _f(None, "DeepSeek sparse attention: indexer head width (index_head_dim)", ge=1)
    dsa_index_topk: int | None = _f(None, "DeepSeek sparse attention: keys each query attends (index_topk)", ge=1)
    rotary_percent: float = _f(1.0, "share of each head's dimensions RoPE rotates (partial_rotary_factor)", gt=0, le=1)
    rope_scaling: Literal["none", "yarn", "llama3", "linear"] = _f(
        "none", "RoPE scaling (yarn: DeepSeek's, MLA families only; llama3: Llama 3.1's, llama only; linear: Gemma 3's)"
    )
    llama3_factor: float = _f(8.0, "llama3: factor (low/high frequency factors 1 and 4 over 8192 positions)", ge=1)
    rope_linear_factor: float = _f(1.0, "linear RoPE scaling: positions divided by this", ge=1)
    yarn_factor: float = _f(1.0, "yarn: context extension factor", ge=1)
    yarn_original_max_position_embeddings: int = _f(4096, "yarn: pre-training context length", ge=1)
    yarn_beta_fast: float = _f(32.0, "yarn: beta_fast", gt=0)
    yarn_beta_slow: float = _f(1.0, "yarn: beta_slow", gt=0)
    yarn_mscale: float = _f(1.0, "yarn: mscale of the cos/sin attention factor", ge=0)
    yarn_mscale_all_dim: float = _f(0.0, "yarn: mscale_all_dim (also scales MLA's softmax)", ge=0)
    yarn_truncate: bool = _f(True, "yarn: round the correction range to whole dimensions (false: gpt-oss's)")
    sliding_window: int | None = _f(None, "keys a sliding layer's query sees (its own too); null = none", ge=1)
    sliding_window_pattern: int = _f(2, "with sliding_window: layers n, 2n, ... full, the others slide", ge=2)
    rope_local_theta: float | None = _f(None, "RoPE base of the sliding layers (Gemma 3); null = rope_theta", gt=0)
    query_pre_attn_scalar: int | None = _f(None, "softmax scale = this ** -0.5 (Gemma); null = head dim ** -0.5", ge=1)
    attn_logit_softcapping: float | None = _f(None, "scores c * tanh(s / c) before the softmax (Gemma 2)", gt=0)
    final_logit_softcapping: float | None = _f(None, "output logits c * tanh(z / c) (Gemma); null = none", gt=0)
    swiglu_alpha: float = _f(1.0, "SwiGLU's gate g * sigmoid(alpha * g): 1 = SiLU; gpt_oss: 1.702", gt=0)
    swiglu_limit: float | None = _f(None, "gpt_oss: SwiGLU clamp, gate <= this, linear half within +-this", gt=0)
    moe_token_dispatcher: Literal["alltoall", "allgather"] = _f("alltoall", "MoE token dispatcher")
    moe_grouped_gemm: Literal["auto", True, False] = _f("auto", "experts as grouped GEMMs (auto: where the widths fit)")
    attention_backend: Literal["auto", "local", "sdpa"] = _f(
        "auto", "core attention of the local specs (auto: sdpa with CUDA, else local; local under CP)"
    )
    params_dtype: Dtype = _f("fp32", "training dtype of the policy (bf16 on GPUs)")
    recompute: Literal[False, True, "full", "selective"] = _f(
        False,
        "activation recompute in backward (saves activation memory): full (or true) = whole transformer layers; "
        "selective = the model.recompute_modules only; false = none",
    )
    recompute_modules: list = _f(
        ["core_attn"],
        "with model.recompute = selective, Megatron's submodules to recompute: core_attn, mlp (dense MLP layers), "
        "moe (whole MoE layers), shared_experts; with Transformer Engine also layernorm, mla_up_proj (MLA) and, "
        "with its grouped experts, moe_act (megatron_rl.models.recompute_choice)",
    )
    fusions: FusionConfig = field(default_factory=FusionConfig, metadata={"help": "fused kernels"})
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "low-rank adapters (LoRA)"})
    linear_attention: LinearAttentionConfig = linear_attention_section()


@dataclass
class RolloutConfig:
    engine: Literal["local", "sglang"] = _f("local", "local = the run starts its own engine; sglang_urls imply sglang")
    sglang_urls: list = _f([], "SGLang server or router addresses (http://host:port); empty = the local engine")
    api_key: str | None = _f(
        None,
        "API key sent to / required by the engines; null = a random key per run for the local engine "
        "(SGLang servers: none); written redacted into config.yaml",
    )
    admin_api_key: str | None = _f(
        None,
        "the key of the engines' control endpoints (weight updates, pause, memory, abort), which then accept no "
        "other: sent to SGLang servers started with --admin-api-key, given to the local engine the run starts; "
        "null = api_key; written redacted into config.yaml",
    )
    n_samples_per_prompt: int = _f(8, "responses per prompt (the group size G)", ge=1)
    temperature: float = _f(1.0, "sampling temperature; also applied to the trainer's log-probs", ge=0)
    top_p: float = _f(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = _f(-1, "top-k sampling; -1 = all tokens", ge=-1)
    max_new_tokens: int = _f(1024, "longest response in tokens (L_max)", ge=1)
    stop: list = _f(
        [],
        "stop strings (SGLang's stop): a response ends with the token that completes one, kept in the tokens "
        "trained on and scored; also in evaluation",
    )
    stop_token_ids: list = _f([], "token ids that end a response (kept in it) besides the tokenizer's end of text")
    max_concurrency: int = _f(64, "requests in flight per engine", ge=1)
    request_timeout_s: float = _f(600.0, "seconds before one request is abandoned", gt=0)
    max_retries: int = _f(3, "tries after a connection error or 503", ge=0)
    max_engine_restarts: int = _f(
        3,
        "local engine: times its process is restarted after it dies (then re-synced to the current weights, "
        "the unfinished requests resubmitted); one more death stops the run with its exit code and engine.log",
        ge=0,
    )
    stall_warning_s: float = _f(
        60.0, "warn, with the requests in flight, after each this many seconds without a reply; 0 = never", ge=0
    )
    max_logprob_gap: float | None = _f(
        None,
        "stop the run before its update when the mean absolute difference of the engine's and the trainer's "
        "log-probs (logprob_gap/abs_mean of the recompute right after a sync) exceeds this: the engine serves "
        "other weights; null = by model.params_dtype (fp32 0.05: CPU runs measure <= 2e-7; bf16 and fp16 0.5: "
        "bf16 engines are published at 0.005-0.34 against Megatron, MoE the highest); 0 = off",
        ge=0,
    )
    return_routed_experts: bool = _f(False, "ask the engine for routed experts (needed by R3)")
    weight_sync: Literal["disk", "distributed", "tensor"] = _f("disk", "how new weights reach the engine")
    lora_sync: Literal["auto", "adapter", "merged"] = _f(
        "auto",
        "with model.lora.rank > 0: adapter = only the adapters, through the engine's LoRA endpoints (weight_sync "
        "disk or tensor; not with fully_async); merged = the adapters merged into the base, full weights by "
        "weight_sync; auto = adapter, or merged where the local engine cannot serve the adapters (no peft; MLP "
        "targets on an MoE with dense layers), said in one info line",
    )
    sync_dir: str | None = _f(None, "shared folder for disk sync; null = RUN_DIR/weights")
    bucket_mb: int = _f(512, "largest weight bucket sent at once, in MiB", ge=1)
    colocate: bool = _f(False, "engine and trainer share devices (release/resume memory around phases)")
    colocate_offload: bool = _f(
        False, "colocated: the optimizer state waits in pinned host memory while the engine generates"
    )
    engine_gpus: int = _f(1, "GPUs per SGLang server", ge=1)
    host: str = _f("127.0.0.1", "address the local engine binds")
    port: int | None = _f(None, "port of the local engine; null = a free one", ge=1, le=65535)
    async_mode: Literal["sync", "one_step_off", "fully_async"] = _f(
        "sync",
        "sync = generate, then train; one_step_off = the next batch is generated (with the weights one "
        "update behind) while this one trains; fully_async = the engines generate all the time",
    )
    max_staleness: int = _f(
        1,
        "fully_async: samples with a token more than this many weight versions behind are dropped, and the "
        "producer stays at most this many versions ahead of the trainer (>= 1; 0 is refused: that is sync)",
        ge=0,
    )
    partial_rollout: bool = _f(
        True,
        "fully_async: requests in flight during a weight update continue with the new weights (per-token "
        "versions); false = they are aborted and resubmitted",
    )

    @property
    def uses_local_engine(self) -> bool:
        """The run starts the local engine: `engine = local`, or no `sglang_urls` to connect to."""
        return self.engine == "local" or not self.sglang_urls


@dataclass
class AlgorithmConfig:
    """The objective. Its loss fields (choices and bounds from `megatron_rl.losses.spec`) become the
    run's `LossSpec`; the rest drive advantages, sampling, old log-probs and routing replay."""

    name: Literal[tuple(PRESETS)] = _f("grpo", "objective; its preset sets the fields below unless overridden")
    ratio_level: Literal[RATIO_LEVELS] = _f(
        "token", "importance ratio: token, sequence (GSPO) or sequence_token (GSPO-token)"
    )
    gate: Literal[GATES] = _f("clip", "clip = PPO/GSPO clip; soft = SAPO sigmoid gate")
    clip_eps_low: float = _f(0.2, "lower clip range: ratio >= 1 - eps_low", **BOUNDS["clip_eps_low"])
    clip_eps_high: float = _f(0.2, "upper clip range: ratio <= 1 + eps_high", **BOUNDS["clip_eps_high"])
    dual_clip_c: float | None = _f(
        None, "dual-clip bound c (> 1) for negative advantages; null = off", **BOUNDS["dual_clip_c"]
    )
    sapo_tau_pos: float = _f(1.0, "SAPO gate temperature for A > 0", **BOUNDS["sapo_tau_pos"])
    sapo_tau_neg: float = _f(1.05, "SAPO gate temperature for A <= 0", **BOUNDS["sapo_tau_neg"])
    loss_agg_mode: Literal[AGGREGATION_MODES] = _f("seq-mean-token-mean", "how per-token losses become the batch loss")
    max_log_ratio: float = _f(
        20.0, "log-ratios are clamped to +-this before exp (numerical safety)", **BOUNDS["max_log_ratio"]
    )
    kl_coef: float = _f(
        0.0,
        "beta: weight of KL(pi || pi_ref) to the frozen reference policy, in the loss (or the reward with "
        "kl_in_reward); 0 = no reference model unless ref_kl_metrics",
        **BOUNDS["kl_coef"],
    )
    kl_estimator: Literal[KL_ESTIMATORS] = _f(
        "k3",
        "per-token KL estimator (Schulman): k1 = log pi - log pi_ref (only with kl_in_reward: in the loss its "
        "expected gradient is 0); k2 = its square / 2; k3 = verl's low_var_kl, clamped to 10 per token",
    )
    entropy_coef: float = _f(
        0.0,
        "entropy bonus (verl's entropy_coeff): loss -= coef x the entropy of the loss tokens aggregated as the "
        "policy loss (loss_agg_mode); 0 = off",
        **BOUNDS["entropy_coef"],
    )
    kl_in_reward: bool = _f(
        False,
        "PPO-style: subtract beta x (the response's summed per-token KL to the reference at pi_old) from its "
        "reward before group advantages, instead of adding beta x KL to the loss",
    )
    ref_path: str | None = _f(
        None,
        "the reference policy: a Hugging Face folder or a Megatron checkpoint; null = the start policy "
        "(model.hf_path, then checkpoint.load)",
    )
    ref_offload: bool = _f(
        False, "GPU: keep the reference's weights in pinned host memory between uses (one copy to the device per step)"
    )
    ref_kl_metrics: bool = _f(
        False, "build the reference also at kl_coef = 0 and report actor/kl_ref_* (one more forward per step)"
    )
    is_correction: Literal[IS_MODES] = _f(
        "none",
        "rollout/trainer mismatch weight pi_old/pi_rollout: truncate = min(w, C); mask = weight 0 outside "
        "[C_min, C_max] (still counted in the loss normaliser); reject = removed from the loss and its normaliser",
    )
    is_level: Literal[IS_LEVELS] = _f(
        "token",
        "level of the importance weight (verl's names): token; sequence = product of the token weights; "
        "geometric = their geometric mean",
    )
    is_threshold: float = _f(2.0, "C: truncation cap of the importance weight", **BOUNDS["is_threshold"])
    is_mask_min: float = _f(0.5, "C_min: lowest importance weight kept when masking", **BOUNDS["is_mask_min"])
    is_mask_max: float = _f(2.0, "C_max: highest importance weight kept when masking", **BOUNDS["is_mask_max"])
    advantage_estimator: Literal["grpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = _f(
        "grpo",
        "verl's adv_estimator: the advantage of each response or token (docs/training.md has the formulas); "
        "gae reads the critic's values and implies critic.enabled",
    )
    gamma: float = _f(
        1.0, "gae and reinforce_plus_plus: discount per trained token (verl's algorithm.gamma)", ge=0, le=1
    )
    lam: float = _f(1.0, "gae: lambda, the GAE trace decay per trained token (verl's algorithm.lam)", ge=0, le=1)
    adv_norm_std: bool = _f(True, "divide group advantages by the group std (False = mean-only, Dr. GRPO)")
    adv_eps: float = _f(1e-6, "epsilon added to the group std", ge=0)
    dynamic_sampling: bool = _f(False, "drop groups with zero reward spread and keep sampling")
    dynamic_sampling_filter: str | None = _f(
        None,
        "module:function or file.py:function deciding which groups dynamic sampling keeps, in place of the reward "
        "spread: fn(group) -> bool (docs/training.md); implies dynamic_sampling",
    )
    max_gen_rounds: int = _f(10, "generation rounds per step before the batch is used as it is", ge=1)
    oversample_factor: float = _f(1.0, "prompts per generation round = factor x train.prompts_per_step", ge=1)
    soft_overlong_punishment: bool = _f(False, "DAPO soft length penalty inside the last L_cache tokens")
    overlong_buffer_len: int = _f(256, "L_cache in tokens (L_max = rollout.max_new_tokens)", ge=1)
    overlong_penalty_factor: float = _f(1.0, "scale of the soft overlong penalty", ge=0)
    overlong_filter: bool = _f(False, "mask truncated responses out of the loss")
    old_logprob_source: Literal["recompute", "rollout"] = _f(
        "recompute", "recompute = actor forward before the update; rollout = the engine's log-probs"
    )
    routing_replay: Literal["none", "r2", "r3"] = _f("none", "MoE routing replay: r2 = old-policy, r3 = engine routing")
    turn_credit: Literal["outcome", "per_turn"] = _f(
        "outcome",
        "multi-turn credit: outcome = one advantage per trajectory; per_turn = each turn's tokens get the return "
        "from that turn on (turn rewards + final reward), normalised among the group's returns of the same turn",
    )
    turn_discount: float = _f(1.0, "per_turn: gamma, the discount of later turns' rewards", ge=0, le=1)


@dataclass
class RewardConfig:
    type: Literal["dapo", "boxed", "math_verify", "custom", "remote"] = _f(
        "dapo", "reward rule; remote = POST batches to the reward server at reward.url"
    )
    custom_function: str | None = _f(None, "module:function for type=custom (implied when reward.type is not given)")
    correct_reward: float = _f(1.0, "reward of a correct answer")
    incorrect_reward: float = _f(-1.0, "reward of a wrong or missing answer")
    failure_reward: float = _f(
        -1.0,
        "what a response the reward function or server failed on counts for in reward/mean and the "
        "evaluation; never trained on (its group is left out)",
    )
    max_failure_frac: float = _f(
        0.05,
        "stop the run when more than this fraction of a step's responses (or an evaluation's) fail to be "
        "scored; below it a failed response's group is left out of the step (reward/failures, groups/reward_failed)",
        ge=0,
        le=1,
    )
    workers: int = _f(
        1, "processes scoring the local rules (dapo, boxed, math_verify, custom); started at the first batch", ge=1
    )
    item_timeout_s: float = _f(
        30.0,
        "seconds one response's scoring by a local rule may take; past it the response is a failure "
        "(reward/failures, reward/timeouts)",
        gt=0,
    )
    url: str | None = _f(None, "type=remote: the endpoint batches are POSTed to, e.g. http://host:8000/score")
    api_key: str | None = _f(
        None, "type=remote: sent as 'Authorization: Bearer KEY'; null = $MEGATRON_RL_REWARD_API_KEY"
    )
    batch_size: int = _f(64, "type=remote: responses per request", ge=1)
    max_concurrency: int = _f(8, "type=remote: requests in flight at once", ge=1)
    timeout_s: float = _f(60.0, "type=remote: seconds to wait for a reply before the request is retried", gt=0)
    max_retries: int = _f(3, "type=remote: tries after a timeout, a connection error or HTTP 429/5xx", ge=0)
    retry_backoff_s: float = _f(1.0, "type=remote: seconds before the first retry, doubled for each next", ge=0)


@dataclass
class EnvConfig:
    type: str = _f(
        "single_turn",
        "the episode's environment: single_turn, calculator, http_tool, agent (a black-box agent through the "
        "OpenAI-compatible gateway: env.agent or env.agent_command), or module:Class (a megatron_rl.envs.Environment)",
    )
    max_turns: int = _f(1, "model turns per episode at most (single_turn uses one)", ge=1)
    max_total_tokens: int | None = _f(
        None,
        "prompt + every turn and observation of a trajectory, in tokens, at most; null = the model's "
        "max_position_embeddings (a larger value is refused)",
        ge=2,
    )
    tool_timeout_s: float = _f(
        10.0, "seconds one tool call may run before it is abandoned (an error observation)", gt=0
    )
    step_timeout_s: float = _f(
        300.0,
        "seconds one Environment.step may run; past it the episode ends (env/step_timeout); a warning "
        "every rollout.stall_warning_s while it runs",
        gt=0,
    )
    max_tool_calls: int = _f(
        16, "tool calls run per model turn; the ones after get an error response (env/too_many_tool_calls)", ge=1
    )
    max_concurrent_steps: int = _f(
        64,
        "Environment.step calls run at once: the episodes' steps run side by side, at most this many",
        ge=1,
    )
    tool_url: str | None = _f(None, "http_tool: the tool server's endpoint, POSTed {name, arguments}")
    max_tool_reply_bytes: int = _f(
        1 << 20, "http_tool: the longest reply read from the tool server; a longer one is a tool error", ge=1
    )
    tool_api_key: str | None = _f(None, "http_tool: sent as 'Authorization: Bearer KEY'")
    agent: str | None = _f(
        None,
        "agent: module:function or file.py:function, an async agent(base_url, api_key, row) -> reward or None, one "
        "call per episode",
    )
    agent_command: str | None = _f(
        None,
        "agent: a command run per episode (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL in its environment, the "
        'row as JSON on stdin; a last stdout line {"reward": x} is its reward)',
    )
    agent_reward: bool = _f(
        False,
        "agent: score each episode by the reward its agent returns (or prints) instead of reward.*; an episode "
        "without one is a failed reward (reward.failure_reward, its group left out)",
    )
    agent_timeout_s: float = _f(
        600.0, "agent: seconds one episode's agent may run; past it the episode fails (env/agent_errors)", gt=0
    )
    max_failure_frac: float = _f(
        0.05, "stop the run when more than this fraction of a step's episodes fail (env or agent errors)", ge=0, le=1
    )


@dataclass
class TrainConfig:
    steps: int | None = _f(100, "RL steps (rollout + updates); null with train.epochs, which implies it", ge=1)
    epochs: int = _f(
        0,
        "passes over the training prompts: the steps are then ceil(epochs x usable prompts / prompts drawn per step), "
        "derived once the data is read and printed at start-up; 0 = train.steps",
        ge=0,
    )
    prompts_per_step: int = _f(32, "prompt groups trained on per step", ge=1)
    updates_per_step: int = _f(1, "mini-batches (optimizer steps) per pass over a step's batch", ge=1)
    ppo_epochs: int = _f(
        1,
        "passes over each step's batch, each one train.updates_per_step mini-batches; the old log-probs stay those "
        "from before the first pass",
        ge=1,
    )
    max_tokens_per_micro_batch: int = _f(8192, "token budget of one micro-batch (prompt + response, padded)", ge=1)
    micro_batch_tokens: int = _f(
        0,
        "packed micro-batches: the samples end to end, at most this many tokens each (a longer sample alone), "
        "balanced over DP ranks; 0 = right-padded micro-batches of train.max_tokens_per_micro_batch",
        ge=0,
    )
    logprob_chunk_tokens: int = _f(512, "tokens per chunk of the vocab-parallel log-prob/entropy path", ge=1)
    lr: float = _f(1e-6, "peak learning rate (0 = a frozen policy, for diagnostics)", ge=0)
    min_lr: float = _f(0.0, "final learning rate of the decay", ge=0)
    lr_warmup_steps: int = _f(0, "linear warm-up in optimizer steps", ge=0)
    lr_warmup_ratio: float = _f(
        0.0, "linear warm-up as a fraction of all optimizer steps (floored; not with lr_warmup_steps)", ge=0, lt=1
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = _f("constant", "learning-rate schedule after warm-up")
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = _f(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = _f(0.999, "Adam beta2", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "Adam epsilon", gt=0)
    grad_clip: float = _f(1.0, "global gradient-norm clip; 0 = off", ge=0)
    seed: int = _f(1234, "model init and sampling seed")


@dataclass
class CheckpointConfig:
    dir: str | None = _f(None, "checkpoint folder; null = RUN_DIR/checkpoints")
    every: int = _f(0, "save every n steps; 0 = only at the end", ge=0)
    load: str | None = _f(None, "Megatron checkpoint to start from (a converted one: also the model and tokenizer)")
    keep_last: int = _f(2, "checkpoints kept on disk", ge=1)
    export_hf: bool = _f(True, "export the final policy as a Hugging Face folder")
    preempt_timeout_s: float = _f(
        15.0, "after SIGTERM/SIGUSR1, seconds the step's episodes may still run; then they are aborted", ge=0
    )


@dataclass
class LoggingConfig:
    run_dir: str = _f("runs/default", "folder of metrics.jsonl, checkpoints and logs")
    backends: list = _f(
        ["tensorboard"],
        "experiment trackers beside metrics.jsonl, any of tensorboard (RUN_DIR/tensorboard; a warning when not "
        "installed), wandb, mlflow (pip install wandb / mlflow: refused at start-up when missing)",
    )
    run_name: str | None = _f(None, "the trackers' run name; null = the run folder's name")
    wandb_project: str = _f("megatron-rl", "W&B project")
    wandb_entity: str | None = _f(None, "W&B entity (team or user); null = the account's default")
    wandb_offline: bool = _f(False, "W&B offline: files in RUN_DIR/wandb, uploaded later with `wandb sync`")
    mlflow_tracking_uri: str | None = _f(None, "MLflow tracking server; null = MLflow's own ($MLFLOW_TRACKING_URI)")
    mlflow_experiment: str = _f("megatron-rl", "MLflow experiment of the run")
    progress: bool = _f(True, "console progress: a bar on a terminal, else a line per logging.every steps")
    every: int = _f(1, "where stderr is not a terminal: a console line every n steps (and at the last)", ge=1)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


# Keys that hold secrets: what to_yaml writes (RUN_DIR/config.yaml, `megatron-rl config`) has
# REDACTED in their place, and a config that still says REDACTED is refused.
SECRET_KEYS = ("rollout.api_key", "rollout.admin_api_key", "reward.api_key", "env.tool_api_key", "distill.api_key")
REDACTED = "<redacted>"
