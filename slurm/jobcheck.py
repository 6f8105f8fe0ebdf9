"""What the Slurm planner (slurm/jobplan.py) checks of a job's resources besides its layout: memory per
GPU, trainer and rollout engines, and the tokenizer against the model's vocabulary.

The memory figures are arithmetic, not measurements:

- trainer: on its largest pipeline stage (the first also holds the embedding, the last the output
  layer), bf16 (params_dtype) weights and fp32 gradients of the ranks' share, the fp32 master copy and
  Adam's moments sharded over the data-parallel (experts: expert-data-parallel) ranks, the moments of
  `parallel.optimizer_offload_fraction` on the host with `parallel.optimizer_cpu_offload`; with
  `critic.enabled` (PPO) the same again for the critic, a second model of the policy's backbone in the
  same layout on the same GPUs with its own optimizer (its output layer a [1, H] head instead of the
  vocabulary's); within `STATIC_MEMORY_SHARE` of a GPU (the rest: activations, buffers);
- an SGLang engine: the model's parameters in the engine's dtype (SGLang's `--dtype`: SGLANG_ARGS', else
  its `auto`, config.json's dtype and float16 for float32: two bytes unless asked for float32) over its
  `rollout.engine_gpus` GPUs, and the KV cache (`--kv-cache-dtype`, by default the engine's dtype) in
  what is left of its static share of each GPU (`--mem-fraction-static`: SGLANG_ARGS', a colocated
  job's, else SGLang's own default for the GPU). The KV cache must hold one whole sequence (the
  configured context: `data.max_prompt_tokens + rollout.max_new_tokens`, or `env.max_total_tokens`
  for multi-turn episodes), as a longer request cannot be served: refused; holding fewer than
  `rollout.max_concurrency` of them (the requests in flight per engine), SGLang runs fewer at once and
  retracts some as responses grow: a warning;
- colocated: while the engines generate, the trainer keeps its weights, gradients and (without
  `rollout.colocate_offload`) optimizer state in the share the engines leave.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

GPU_MEMORY_GIB = 80.0  # per GPU, unless GPU_MEM_GIB / --gpu-mem-gib says otherwise
STATIC_MEMORY_SHARE = 0.9  # of a GPU for weights, gradients and optimizer state; the rest: activations, buffers
SMALL_TOKENIZER_SHARE = 0.5  # a tokenizer under this share of the vocabulary is another model's: refused
MEM_FRACTION_FLAG = "--mem-fraction-static"
DTYPE_FLAG, KV_DTYPE_FLAG = "--dtype", "--kv-cache-dtype"
# SGLang 0.5.23's --dtype names (sglang/srt/configs/model_config.py) and --kv-cache-dtype choices besides
# auto (sglang/srt/mem_cache/kv_cache_dtype.py; fp8 and fp4 scales not counted), with their bytes
ENGINE_DTYPES = {"half": ("fp16", 2), "float16": ("fp16", 2), "bfloat16": ("bf16", 2), "float": ("fp32", 4)}
ENGINE_DTYPES["float32"] = ENGINE_DTYPES["float"]
KV_CACHE_DTYPES = {"bf16": 2.0, "bfloat16": 2.0, "fp8_e5m2": 1.0, "fp8_e4m3": 1.0, "mxfp8": 1.0}
KV_CACHE_DTYPES |= {"nvfp4": 0.5, "fp4_mx_block16": 0.5}
GIB = 2**30


class DoesNotFit(ValueError):
    """A job whose memory or tokenizer cannot work; the message names the setting to change."""


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in command-line words (`--flag V` or `--flag=V`), the last one winning."""
    found = None
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            found = args[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


@dataclass(frozen=True)
class TrainerMemory:
    """Per GPU of the trainer's static state on its largest pipeline stage, in GiB."""

    dense_params: float  # billions on one GPU: the stage's dense parameters / TP (the critic's included)
    expert_params: float  # billions on one GPU: the stage's experts / (EP x ETP) (the critic's included)
    weights: float
    grads: float
    optimizer: float  # on the GPU: fp32 master shard (unless fp32 weights), Adam's moments unless offloaded
    host: float = 0.0  # optimizer_cpu_offload: the offloaded share's fp32 copy, gradient and moments, on the host
    stage: int = 0  # the largest pipeline stage (0-based)
    stage_layers: int = 0  # its transformer layers
    stages: int = 1  # PP
    critic: float = 0.0  # of `total`, the critic's weights, gradients and optimizer state (critic.enabled)
    critic_optimizer: float = 0.0  # of `optimizer`, the critic's (rollout.colocate_offload leaves it on the GPU)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def trainer_memory(cfg: Any, world: int) -> TrainerMemory:
    """Per-GPU weights (params_dtype), fp32 gradients and optimizer state of `cfg`'s model under its layout
    on `world` ranks, on the pipeline stage that holds the most (its layers from `pipeline_stage_layers`; the
    first stage also holds the embedding, the last the output layer); the distributed optimizer shards the
    state over the data-parallel ranks (the experts' over the expert-data-parallel ones). With
    `parallel.optimizer_cpu_offload`, Megatron's HybridDeviceOptimizer keeps `optimizer_offload_fraction` of
    each shard's Adam moments on the host, with a pinned fp32 copy of those parameters and their gradients
    (16 bytes a parameter there); the fp32 master shard stays on the GPU. With `critic.enabled`, each stage
    also holds the critic's share of the value model (`stage_parameter_counts(..., value_head=True)`), in
    the same layout and with the same optimizer settings."""
    from megatron_rl.config.derived import pipeline_stage_layers
    from megatron_rl.models.families import stage_parameter_counts
    from megatron_rl.parallel.layout import resolve_expert_tensor_parallel

    par = cfg.parallel
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    etp = resolve_expert_tensor_parallel(par)
    dp = world // (tp * pp * par.context_parallel_size)
    expert_dp = world // (ep * etp * pp)
    width = {"fp32": 4, "bf16": 2, "fp16": 2}[cfg.model.params_dtype]
    master = 0 if width == 4 else 4  # the fp32 master weights of bf16/fp16 parameters
    offloaded = par.optimizer_offload_fraction if par.optimizer_cpu_offload else 0.0
    gpu_state, host_state = master + 8 * (1 - offloaded), 16 * offloaded  # host: fp32 copy, gradient, moments
    shard = (dp, expert_dp) if par.use_distributed_optimizer else (1, 1)
    stages = pipeline_stage_layers(cfg.model, par)
    models = (False, True) if cfg.critic.enabled else (False,)
    candidates = []
    for i, layers in enumerate(stages):
        counts = [
            stage_parameter_counts(cfg.model, layers, first=i == 0, last=i == pp - 1, value_head=critic)
            for critic in models
        ]
        local = [(dense / tp, experts / (ep * etp)) for dense, experts in counts]
        per_model = [  # GiB of weights, gradients, GPU optimizer state, host optimizer state
            (
                (d + e) * width / GIB,
                (d + e) * 4 / GIB,
                (d / shard[0] + e / shard[1]) * gpu_state / GIB,
                (d / shard[0] + e / shard[1]) * host_state / GIB,
            )
            for d, e in local
        ]
        weights, grads, optimizer, host = (sum(part) for part in zip(*per_model, strict=True))
        candidates.append(
            TrainerMemory(
                dense_params=sum(d for d, _ in local) / 1e9,
                expert_params=sum(e for _, e in local) / 1e9,
                weights=weights,
                grads=grads,
                optimizer=optimizer,
                host=host,
                stage=i,
                stage_layers=len(layers),
                stages=pp,
                critic=sum(per_model[1][:3]) if cfg.critic.enabled else 0.0,
                critic_optimizer=per_model[1][2] if cfg.critic.enabled else 0.0,
            )
        )
    return max(candidates, key=lambda mem: mem.total)


def stage_text(mem: TrainerMemory) -> str:
    """Which pipeline stage the trainer's figures are of ("" without pipeline parallelism)."""
    if mem.stages == 1:
        return ""
    return f" on its largest pipeline stage, {mem.stage + 1} of {mem.stages} with {mem.stage_layers} layers,"


def check_trainer_memory(cfg: Any, world: int, gpu_mem_gib: float) -> TrainerMemory:
    """DoesNotFit naming the layout keys when the trainer's static state exceeds STATIC_MEMORY_SHARE of a GPU."""
    mem = trainer_memory(cfg, world)
    limit = STATIC_MEMORY_SHARE * gpu_mem_gib
    if mem.total > limit:
        offload = "" if cfg.parallel.optimizer_cpu_offload else ", set parallel.optimizer_cpu_offload=true"
        critic = f", the critic's {mem.critic:.0f} GiB among them (critic.enabled)" if mem.critic else ""
        raise DoesNotFit(
            f"the trainer needs about {mem.total:.0f} GiB per GPU for weights, gradients and optimizer state"
            f"{critic}{stage_text(mem).rstrip(',')} ({mem.dense_params:.2f} B dense + {mem.expert_params:.2f} B expert parameters per "
            f"GPU: {mem.weights:.0f} + {mem.grads:.0f} + {mem.optimizer:.0f} GiB) on {world} ranks, over "
            f"{STATIC_MEMORY_SHARE:.0%} of GPU_MEM_GIB={gpu_mem_gib:g}: raise parallel.expert_model_parallel_size, "
            f"parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size{offload}, or train on "
            "more nodes"
        )
    return mem


def _prefill_graph_sizes(max_tokens: int) -> int:
    """How many prefill batch sizes SGLang 0.5.23 captures up to `max_tokens` (cuda_graph_hook.py)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64)]
    sizes += [*range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return sum(size <= max_tokens for size in sizes)


def sglang_default_mem_fraction(gpu_mem_gib: float, engine_gpus: int, mla: bool) -> float:
    """SGLang 0.5.23's default `--mem-fraction-static` on a CUDA GPU (sglang/srt/arg_groups/memory_hook.py,
    `handle_gpu_memory_settings`) with its default chunked prefill and CUDA graphs, one pipeline stage, no
    DP attention or DeepEP: (memory - reserve) / memory, rounded to 3 places; the reserve in MiB is
    512 + 1.5 x max(chunked prefill, 2048) + TP / 8 x 1024 + 2 x the decode graphs' largest batch + the
    prefill graphs' (MLA 1536, else 8 per captured size), at least 10 GiB on GPUs of more than 60 GiB."""
    mem = gpu_mem_gib * 1024
    # (below this many GiB: chunked prefill tokens, decode graph batch with TP < 4, with TP >= 4)
    tiers = ((20, 2048, 8, 8), (35, 4096, 48, 160), (60, 4096, 32, 160), (160, 8192, 256, 512))
    chunk, small_tp_bs, large_tp_bs = next((t[1:] for t in tiers if mem < t[0] * 1024), (16384, 512, 512))
    decode_bs = small_tp_bs if engine_gpus < 4 else large_tp_bs
    prefill_graphs = 1536 if mla else 8 * _prefill_graph_sizes(chunk)
    reserve = 512 + 1.5 * max(chunk, 2048) + engine_gpus / 8 * 1024 + 2 * decode_bs + prefill_graphs
    if mem > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return round((mem - reserve) / mem, 3)


def kv_bytes_per_token(model: Any, engine_gpus: int, width: float = 2.0) -> int:
    """Bytes of KV cache one token takes on each GPU of an SGLang engine, `width` bytes an element (bf16 by
    default): MLA keeps the compressed latent and the rotary key on every TP rank; other attention splits
    its key/value heads over TP (at least one head per GPU)."""
    from megatron_rl.models.families import check_family

    if check_family(model).multi_latent_attention:
        return int(model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * width)
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    heads = max(1, model.num_query_groups // engine_gpus)
    return int(model.num_layers * 2 * heads * head_dim * width)


def engine_dtype(hf_config: dict[str, Any], engine_args: Sequence[str]) -> tuple[str, int]:
    """(name, bytes) of the dtype an SGLang engine holds its weights in: `--dtype` in `engine_args`, else
    SGLang's `auto` (`_get_and_verify_dtype`): config.json's dtype, float16 for float32 or none (bfloat16
    for Gemma)."""
    given = flag_value(engine_args, DTYPE_FLAG)
    if given is not None and given.lower() != "auto":
        if given.lower() not in ENGINE_DTYPES:
            raise DoesNotFit(f"SGLANG_ARGS: {DTYPE_FLAG} {given!r}; SGLang takes auto, {', '.join(ENGINE_DTYPES)}")
        return ENGINE_DTYPES[given.lower()]
    declared = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    if declared in ("bfloat16", "float16"):  # config.json's names, as torch spells them
        return ENGINE_DTYPES[declared]
    return ENGINE_DTYPES["bfloat16" if str(hf_config.get("model_type", "")).startswith("gemma") else "float16"]


def kv_cache_dtype(
    hf_config: dict[str, Any], engine_args: Sequence[str], weights: tuple[str, int]
) -> tuple[str, float]:
    """(name, bytes) of an SGLang engine's KV cache elements: `--kv-cache-dtype` in `engine_args`, else
    `auto`: fp8 for a checkpoint quantized with an FP8 KV cache, else the weights' dtype."""
    given = flag_value(engine_args, KV_DTYPE_FLAG)
    if given is not None and given != "auto":
        if given not in KV_CACHE_DTYPES:
            raise DoesNotFit(f"SGLANG_ARGS: {KV_DTYPE_FLAG} {given!r}; SGLang takes auto, {', '.join(KV_CACHE_DTYPES)}")
        return given, KV_CACHE_DTYPES[given]
    quantization = hf_config.get("quantization_config") or {}
    if str(quantization.get("kv_cache_quant_algo") or "").upper() == "FP8":
        return "fp8_e4m3", 1.0
    return weights


class EngineRole(NamedTuple):
    """Whose engine a memory check sizes, in its messages: the servers' name, the setting of their GPUs, and
    the variable of their extra arguments."""

    name: str
    gpus_key: str
    args_name: str


ROLLOUT_ENGINE = EngineRole("a rollout engine", "rollout.engine_gpus", "SGLANG_ARGS")


@dataclass(frozen=True)
class EngineMemory:
    """Per GPU of one SGLang engine, in GiB: its weights and the KV cache its static share leaves."""

    params: float  # billions: the whole model
    engine_gpus: int
    gpu_mem_gib: float
    fraction: float
    fraction_source: str
    dtype: str  # the weights'
    dtype_bytes: int
    kv_dtype: str
    kv_token_bytes: int

    @property
    def weights(self) -> float:
        return self.params * 1e9 * self.dtype_bytes / self.engine_gpus / GIB

    @property
    def static(self) -> float:
        return self.fraction * self.gpu_mem_gib

    @property
    def kv_cache(self) -> float:
        return self.static - self.weights

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache * GIB // self.kv_token_bytes))


def engine_memory(
    cfg: Any,
    hf_config: dict[str, Any],
    engine_gpus: int,
    gpu_mem_gib: float,
    engine_args: Sequence[str],
    job_fraction: str | None,
    args_name: str = ROLLOUT_ENGINE.args_name,
) -> EngineMemory:
    """An engine of `engine_gpus` GPUs: the fraction from `engine_args` (SGLANG_ARGS, or the variable
    `args_name`), else the job's (`job_fraction`: a colocated job's default), else SGLang's own default; the
    dtypes from `engine_args`, else SGLang's defaults for the checkpoint's config.json (`hf_config`)."""
    from megatron_rl.models.families import check_family, parameter_counts

    given = flag_value(engine_args, MEM_FRACTION_FLAG)
    if given is not None:
        try:
            fraction, source = float(given), args_name
        except ValueError:
            raise DoesNotFit(f"{args_name}: {MEM_FRACTION_FLAG} {given!r} is not a number") from None
    elif job_fraction is not None:
        fraction, source = float(job_fraction), "the colocated default"
    else:
        mla = check_family(cfg.model).multi_latent_attention
        fraction = sglang_default_mem_fraction(gpu_mem_gib, engine_gpus, mla)
        source = f"SGLang's default for {gpu_mem_gib:g} GiB and TP {engine_gpus}"
    params = sum(parameter_counts(cfg.model)) / 1e9
    dtype, width = engine_dtype(hf_config, engine_args)
    kv_dtype, kv_width = kv_cache_dtype(hf_config, engine_args, (dtype, width))
    kv_token_bytes = kv_bytes_per_token(cfg.model, engine_gpus, kv_width)
    return EngineMemory(params, engine_gpus, gpu_mem_gib, fraction, source, dtype, width, kv_dtype, kv_token_bytes)


def sequence_tokens(cfg: Any) -> tuple[int, str]:
    """The configured context: the longest sequence one request to an engine holds, and the keys that set
    it: the prompt and the response, or a multi-turn episode's whole budget (`env.max_total_tokens`, which
    `validate_run` fills in with the model's positions when null)."""
    single = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if cfg.env.type == "single_turn" or cfg.env.max_turns == 1:
        return single, "data.max_prompt_tokens + rollout.max_new_tokens"
    budget = cfg.env.max_total_tokens or cfg.model.max_position_embeddings
    return budget, f"env.max_total_tokens, {cfg.env.max_turns} turns"


def _smallest_engine(
    cfg: Any, hf_config: dict[str, Any], gpus_per_node: int, gpu_mem_gib: float, engine_args: Sequence[str],
    job_fraction: str | None, kv_tokens: int, args_name: str,
) -> int | None:  # fmt: skip
    """The fewest GPUs above `rollout.engine_gpus` (dividing a node, or whole nodes, up to 128) whose
    engine holds `kv_tokens` tokens of KV cache; None if none does."""
    gpus = cfg.rollout.engine_gpus
    sizes = [d for d in range(gpus + 1, gpus_per_node + 1) if gpus_per_node % d == 0]
    sizes += [gpus_per_node * n for n in range(2, 129) if gpus_per_node * n > gpus]
    memories = (engine_memory(cfg, hf_config, g, gpu_mem_gib, engine_args, job_fraction, args_name) for g in sizes)
    return next((m.engine_gpus for m in memories if m.kv_tokens >= kv_tokens), None)


def check_engine_memory(
    cfg: Any,
    gpus_per_node: int,
    gpu_mem_gib: float,
    engine_args: Sequence[str],
    job_fraction: str | None,
    role: EngineRole = ROLLOUT_ENGINE,
) -> tuple[EngineMemory, str | None]:
    """(the engine's memory, a warning or None) of an engine of `cfg.model` on `rollout.engine_gpus` GPUs
    (`role`: whose, in the messages). DoesNotFit, with the figures and the smallest engine that would fit,
    when an engine's weights leave its static share no KV cache for one whole sequence; the warning when the
    KV cache holds fewer than `rollout.max_concurrency` of them."""
    gpus = cfg.rollout.engine_gpus
    hf_config = json.loads(Path(cfg.model.hf_path, "config.json").read_text())
    mem = engine_memory(cfg, hf_config, gpus, gpu_mem_gib, engine_args, job_fraction, role.args_name)
    tokens, context = sequence_tokens(cfg)

    def smallest(kv_tokens: int) -> int | None:
        return _smallest_engine(
            cfg, hf_config, gpus_per_node, gpu_mem_gib, engine_args, job_fraction, kv_tokens, role.args_name
        )

    if mem.kv_tokens >= tokens:
        wanted = cfg.rollout.max_concurrency * tokens
        if mem.kv_tokens >= wanted:
            return mem, None
        fitting = smallest(wanted)
        hint = f"{role.gpus_key}={fitting} would hold them" if fitting else "no engine of up to 128 nodes would"
        return mem, (
            f"{role.name}'s KV cache holds {mem.kv_tokens:,} tokens: {mem.kv_tokens // tokens} whole sequences "
            f"of {tokens:,} ({context}) at once, fewer than rollout.max_concurrency={cfg.rollout.max_concurrency} "
            f"({wanted:,} tokens): SGLang runs fewer requests at once and retracts some as responses grow; {hint}"
        )
    fitting = smallest(tokens)
    hint = f"{role.gpus_key}={fitting} would fit" if fitting else "no engine of up to 128 nodes fits"
    share = (
        f"its static share of {mem.static:.1f} GiB per GPU ({MEM_FRACTION_FLAG} {mem.fraction:g}: "
        f"{mem.fraction_source}; GPU_MEM_GIB={gpu_mem_gib:g})"
    )
    weights = (
        f"{mem.weights:.1f} GiB per GPU of {mem.dtype} weights ({mem.weights * gpus:.0f} GiB for {mem.params:.1f} B "
        f"parameters / {role.gpus_key}={gpus})"
    )
    if mem.kv_cache <= 0:
        raise DoesNotFit(f"{role.name} needs {weights}, more than {share}; {hint}")
    raise DoesNotFit(
        f"{role.name}'s {weights} leave {mem.kv_cache:.1f} GiB of {share} for the KV cache: {mem.kv_tokens} "
        f"tokens, fewer than one sequence of {tokens} ({context}); {hint}"
    )


def resident_while_generating(trainer: TrainerMemory, offload: bool) -> float:
    """What a colocated trainer keeps on each GPU while the engines generate: its weights and gradients,
    and its optimizer state unless rollout.colocate_offload moves the actor's to host memory (the critic's
    stays)."""
    return trainer.weights + trainer.grads + (trainer.critic_optimizer if offload else trainer.optimizer)


def check_colocated_memory(trainer: TrainerMemory, engine: EngineMemory, offload: bool) -> float:
    """DoesNotFit when the trainer's resident state and the engines' static share exceed a GPU; the GiB kept."""
    kept = resident_while_generating(trainer, offload)
    left = engine.gpu_mem_gib - engine.static
    if kept > left:
        what = "weights and gradients" if offload else "weights, gradients and optimizer state"
        fix = "" if offload else "rollout.colocate_offload=true, "
        raise DoesNotFit(
            f"colocated: while the engines generate, the trainer keeps {kept:.1f} GiB per GPU ({what}), more than "
            f"the {left:.1f} GiB their static share leaves ({MEM_FRACTION_FLAG} {engine.fraction:g} of "
            f"GPU_MEM_GIB={engine.gpu_mem_gib:g}): set {fix}a smaller {MEM_FRACTION_FLAG} in SGLANG_ARGS, or "
            "train on more nodes"
        )
    return kept


def memory_lines(
    trainer: TrainerMemory, engine: EngineMemory | None, kept: float | None, gpu_mem_gib: float, sequence: int
) -> list[str]:
    """The figures of a passing plan, one line per part (`sequence`: the configured context in tokens)."""
    host = f"; {trainer.host:.1f} GiB of optimizer state on the host" if trainer.host else ""
    critic = f", the critic's {trainer.critic:.1f} GiB among them" if trainer.critic else ""
    lines = [
        f"memory per GPU of {gpu_mem_gib:g} GiB (arithmetic): trainer {trainer.total:.1f} GiB static (weights "
        f"{trainer.weights:.1f} + gradients {trainer.grads:.1f} + optimizer {trainer.optimizer:.1f}{critic}){stage_text(trainer)} within {STATIC_MEMORY_SHARE:.0%} ({STATIC_MEMORY_SHARE * gpu_mem_gib:.1f} GiB)"
        f"{host}"
    ]
    if engine is not None:
        lines.append(engine_line("engine", engine, sequence))
    if kept is not None:
        lines.append(f"colocated: the trainer keeps {kept:.1f} GiB while the engines generate")
    return lines


def engine_line(label: str, engine: EngineMemory, sequence: int) -> str:
    """One engine's figures per GPU as the plan prints them (`label`: "engine", "teacher")."""
    return (
        f"{label} ({engine.engine_gpus} GPU{'s' * (engine.engine_gpus > 1)}): {engine.weights:.1f} GiB "
        f"{engine.dtype} weights ({engine.params:.1f} B parameters) + {engine.kv_cache:.1f} GiB KV cache "
        f"({engine.kv_tokens:,} {engine.kv_dtype} tokens at {engine.kv_token_bytes:,} bytes: "
        f"{engine.kv_tokens // sequence:,} sequences of {sequence:,}) = {engine.static:.1f} GiB: "
        f"{MEM_FRACTION_FLAG} {engine.fraction:g} ({engine.fraction_source})"
    )


def check_tokenizer(cfg: Any) -> str | None:
    """DoesNotFit when the tokenizer has more tokens than the model's vocabulary (ids past the embedding,
    which the trainer refuses too), under SMALL_TOKENIZER_SHARE of it (padding adds a fraction of a
    percent: another model's tokenizer, which transformers and Megatron would take silently), or an
    explicit `data.tokenizer_path` holds none; a warning line when `model.hf_path` holds no tokenizer
    (planning from a config.json alone); else None."""
    from megatron_rl.data.readers import DataError
    from megatron_rl.data.tokenizer import TOKENIZER_FILES, has_tokenizer_files, load_tokenizer
    from megatron_rl.models.source import tokenizer_source

    path, key = tokenizer_source(cfg)
    vocab = cfg.model.vocab_size
    if Path(path).is_dir() and not has_tokenizer_files(path):
        missing = f"{key} = {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})"
        if key != "model.hf_path":
            raise DoesNotFit(missing)
        return f"{missing}: the trainer will refuse it; set data.tokenizer_path"
    try:
        n = len(load_tokenizer(path, key, vocab_size=vocab))
    except DataError as err:
        raise DoesNotFit(str(err)) from None
    if n < SMALL_TOKENIZER_SHARE * vocab:
        raise DoesNotFit(
            f"{key} = {path}: the tokenizer has {n:,} tokens for a model vocabulary of {vocab:,} (config.json's "
            f"vocab_size): under {SMALL_TOKENIZER_SHARE:.0%} of it, more than padding explains, so another model's "
            "tokenizer; set data.tokenizer_path to this model's"
        )
    return None


def check_resources(
    cfg: Any,
    world: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    engine_args: Sequence[str],
    own_engines: bool,
    colocated_fraction: str | None,
) -> tuple[list[str], list[str]]:
    """(memory figures, warnings) of a job that passes, else DoesNotFit: on GPUs the trainer's memory and,
    when the job starts its own engines (`own_engines`), theirs and, colocated (`colocated_fraction`:
    the job's default share), both together; the tokenizer on any device. The warnings: an engine's KV
    cache under `rollout.max_concurrency` whole sequences, no tokenizer in `model.hf_path`."""
    warning = check_tokenizer(cfg)
    warnings = [warning] if warning else []
    if not gpus_per_node:
        return [], warnings
    trainer = check_trainer_memory(cfg, world, gpu_mem_gib)
    engine = kept = None
    if own_engines:
        engine, concurrency = check_engine_memory(cfg, gpus_per_node, gpu_mem_gib, engine_args, colocated_fraction)
        warnings += [concurrency] if concurrency else []
        if colocated_fraction is not None:
            kept = check_colocated_memory(trainer, engine, bool(cfg.rollout.colocate_offload))
    return memory_lines(trainer, engine, kept, gpu_mem_gib, sequence_tokens(cfg)[0]), warnings
