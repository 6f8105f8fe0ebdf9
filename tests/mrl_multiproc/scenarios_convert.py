"""Scenarios for tests/test_convert_distributed.py (run by launcher.py, one process per rank).

Tiny random `transformers` models of each family (fp32, weights O(1), norms not 1) are saved with
`save_pretrained`, converted to Megatron under one layout and loaded under the same or another;
logits must equal the HF model's, right-padded and with two sequences packed in one row (THD), and the way
back must give every tensor bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import ParallelConfig

from mrl_configs import VOCAB, hf_config, layout, save_random_hf_model, tiny_model
from mrl_multiproc.model_helpers import assert_close, forward_logits, pack_rows

LOGIT_TOL = 1e-4
SEQ = 12
PACKED = (SEQ, 8)  # the tokens of each sample row in the packed forward: two sequences of different lengths


def hf_folder(ctx, family: str, dtype: torch.dtype = torch.float32, **overrides: object) -> Path:  # noqa: ANN001
    """The shared HF folder of `family` (written once by rank 0)."""
    tag = "-".join([family, str(dtype).removeprefix("torch."), *(f"{k}={v}" for k, v in overrides.items())])
    folder = ctx.shared_dir / f"hf-{tag}"
    if ctx.rank == 0 and not folder.exists():
        save_random_hf_model(folder, hf_config(family, "split", **overrides), dtype)
    dist.barrier()
    return folder


def sample_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(ctx, folder: Path) -> torch.Tensor:  # noqa: ANN001
    """Logits of the transformers model in `folder` (eager attention, fp32), cached per process."""
    import transformers

    key = f"hf-logits:{folder}"
    if key not in ctx.cache:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        ctx.cache[key] = model.float().eval()(input_ids=sample_ids()).logits
    return ctx.cache[key]


def megatron_logits(ckpt: Path, parallel: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a converted checkpoint loaded under `parallel` (the model config from its hf_config/): of the
    sample rows right-padded, and of their first `PACKED` tokens packed in one row."""
    from megatron_rl.commands.convert import HF_CONFIG_DIR, NO_INIT_OVERRIDES
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.checkpoint_io import load_model_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.parallel import destroy_distributed, init_distributed

    model = model_config_from_hf(read_hf_config(ckpt / HF_CONFIG_DIR))
    init_distributed(parallel, model)
    chunks = build_model(model, parallel, config_overrides=NO_INIT_OVERRIDES)
    load_model_weights(chunks, ckpt)
    logits = forward_logits(chunks, sample_ids(), model.vocab_size)
    packed = forward_logits(chunks, sample_ids(), model.vocab_size, packed=PACKED)
    destroy_distributed(process_group=False)
    return logits, packed


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_same_tensors(actual: Path, expected: Path) -> None:
    """Every tensor of `expected` is in `actual` with the same dtype and bits, and nothing else."""
    a, b = read_all(actual), read_all(expected)
    if set(a) != set(b):
        raise AssertionError(
            f"tensor names differ: missing {sorted(set(b) - set(a))[:3]}, extra {sorted(set(a) - set(b))[:3]}"
        )
    for name, value in b.items():
        if a[name].dtype != value.dtype or not torch.equal(a[name], value):
            raise AssertionError(f"{name}: not bit-identical ({a[name].dtype} vs {value.dtype})")


def roundtrip(
    ctx,  # noqa: ANN001
    family: str,
    convert_with: ParallelConfig,
    load_with: ParallelConfig,
    tag: str,
    tol: float = LOGIT_TOL,
    **hf: object,
) -> None:
    """HF -> Megatron under `convert_with`; logits under `load_with` equal HF's (within `tol`), right-padded and
    packed (`PACKED`); Megatron -> HF under `load_with` gives the original tensors bit for bit, and transformers
    loads the folder as it is.
    `hf`: transformers config fields of the source model."""
    from megatron_rl.commands.convert import hf_to_megatron, megatron_to_hf

    src = hf_folder(ctx, family, **hf)
    ckpt, back = ctx.shared_dir / f"mg-{family}-{tag}", ctx.shared_dir / f"back-{family}-{tag}"
    hf_to_megatron(src, ckpt, parallel=convert_with)
    logits, packed = megatron_logits(ckpt, load_with)
    expected = hf_logits(ctx, src)
    assert_close(logits, expected, tol, f"{family} {tag}: Megatron vs HF")
    assert_close(packed, pack_rows(expected, PACKED)[None], tol, f"{family} {tag}: Megatron packed vs HF")
    megatron_to_hf(ckpt, back, parallel=load_with, max_shard_mb=0.05)
    assert_same_tensors(back, src)
    if ctx.rank == 0:
        assert_close(hf_logits(ctx, back), hf_logits(ctx, src), 0.0, f"{family} {tag}: exported folder in transformers")
    dist.barrier()


# --- world size 1 ---------------------------------------------------------------------------


def w1_families(ctx) -> None:  # noqa: ANN001
    """Every family: logits of the converted model equal HF's; the way back is bit-identical. DeepSeek-V3
    without shared experts too: transformers writes them 0 wide, and so does the export."""
    for family in ("qwen3_moe", "mixtral", "qwen3", "qwen2", "deepseek_v3", "glm4_moe"):
        roundtrip(ctx, family, layout(), layout(), "w1")
    roundtrip(ctx, "deepseek_v3", layout(), layout(), "w1-no-shared", n_shared_experts=0)


def w1_bf16(ctx) -> None:  # noqa: ANN001
    """A bf16 checkpoint stays bf16 (Megatron weights and the exported tensors, bit for bit)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.commands.convert import hf_to_megatron, megatron_to_hf

    src = hf_folder(ctx, "qwen3_moe", torch.bfloat16)
    ckpt, back = ctx.shared_dir / "mg-bf16", ctx.shared_dir / "back-bf16"
    hf_to_megatron(src, ckpt)
    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    assert {t.dtype for t in meta.values()} == {torch.bfloat16}, {t.dtype for t in meta.values()}
    megatron_to_hf(ckpt, back)
    assert_same_tensors(back, src)
    fp32 = ctx.shared_dir / "back-bf16-as-fp32"
    megatron_to_hf(ckpt, fp32, dtype="fp32")
    for name, value in read_all(fp32).items():
        assert value.dtype == torch.float32 and torch.equal(value, read_all(src)[name].float()), name


def w1_output_folder_and_config(ctx) -> None:  # noqa: ANN001
    """An existing output folder needs --force (then it is replaced); a checkpoint without hf_config/
    needs --hf-config-from; a config that contradicts the checkpoint names the tensor and both shapes."""
    import shutil

    from megatron_rl.commands.convert import HF_CONFIG_DIR, hf_to_megatron, megatron_to_hf
    from megatron_rl.models.hf_config import ConversionError

    src = hf_folder(ctx, "qwen2")
    out = ctx.shared_dir / "existing"
    out.mkdir()
    (out / "old.txt").write_text("old")
    try:
        hf_to_megatron(src, out)
    except ConversionError as err:
        assert "already exists" in str(err) and "--force" in str(err) and str(out) in str(err), err
    else:
        raise AssertionError("an existing output folder was accepted without force")
    assert (out / "old.txt").exists()
    hf_to_megatron(src, out, force=True)
    assert not (out / "old.txt").exists() and (out / "metadata.json").exists()

    bare = ctx.shared_dir / "mg-no-hf-config"
    shutil.copytree(out, bare)
    shutil.rmtree(bare / HF_CONFIG_DIR)
    try:
        megatron_to_hf(bare, ctx.shared_dir / "never")
    except ConversionError as err:
        assert "--hf-config-from" in str(err), err
    else:
        raise AssertionError("a checkpoint without hf_config/ converted without --hf-config-from")
    megatron_to_hf(bare, ctx.shared_dir / "back-from-config", hf_config_from=src)
    assert_same_tensors(ctx.shared_dir / "back-from-config", src)

    wider = hf_folder(ctx, "qwen2", intermediate_size=128)
    try:
        megatron_to_hf(bare, ctx.shared_dir / "never2", hf_config_from=wider)
    except ConversionError as err:
        text = str(err)
        # Megatron stores the layers stacked: [layers, 2 x intermediate, hidden]
        assert "decoder.layers.mlp.linear_fc1.weight" in text and "[4, 192, 64]" in text and "[4, 256, 64]" in text, (
            text
        )
    else:
        raise AssertionError("a config contradicting the checkpoint was accepted")


# --- world size 2 ---------------------------------------------------------------------------


def w2_tp2(ctx) -> None:  # noqa: ANN001
    """TP=2 (with SP; Qwen3-MoE, DeepSeek-V3 and GLM-4.5 are split over TP in w4_tp2_ep2): the family with QKV
    biases, Llama with llama3 RoPE scaling, Gemma 3 (its norms under SP, per-head QK-norm, the sliding layers'
    RoPE); gpt-oss (its sinks split with the heads, o_proj's bias whole; expert-TP 1), DeepSeek-V3.2 (its
    indexer whole on each rank, reading the sequence gathered over SP), GLM-5 and MiniMax-M2 (its QK-norm over the
    whole projection, its sum of squares all-reduced over TP) within 1e-5; Qwen3-Next (a key head and its value
    heads per rank: DeltaNet's in_proj and conv1d split section by section)."""
    for family in ("qwen2", "llama", "gemma3_text"):
        roundtrip(ctx, family, layout(tp=2), layout(tp=2), "tp2")
    roundtrip(ctx, "gpt_oss", layout(tp=2, etp=1), layout(tp=2, etp=1), "tp2", tol=1e-5)
    roundtrip(ctx, "deepseek_v32", layout(tp=2), layout(tp=2), "tp2", tol=1e-5)  # the indexer whole on both ranks
    roundtrip(ctx, "glm_moe_dsa", layout(tp=2), layout(tp=2), "tp2", tol=1e-5, rms_norm_eps=1e-6)
    roundtrip(ctx, "minimax_m2", layout(tp=2), layout(tp=2), "tp2", tol=1e-5)
    roundtrip(ctx, "qwen3_next", layout(tp=2), layout(tp=2), "tp2")


def w2_ep2(ctx) -> None:  # noqa: ANN001
    """EP=2 (Qwen3-MoE, DeepSeek-V3 and GLM-4.5 are split over EP in w4_tp2_ep2); gpt-oss within 1e-5, its stacked
    experts assembled from both EP ranks on export; DeepSeek-V3.2, GLM-5 (at rms_norm_eps 1e-6: transformers fixes
    its latent norms there, docs/training.md) and MiniMax-M2 within 1e-5; Qwen3-Next within 1e-4 (its DeltaNet's
    decay gate and per-head norm amplify float noise: docs/training.md#hybrid-linear-attention-qwen3-next-qwen35)."""
    roundtrip(ctx, "mixtral", layout(ep=2), layout(ep=2), "ep2")
    roundtrip(ctx, "gpt_oss", layout(ep=2), layout(ep=2), "ep2", tol=1e-5)
    roundtrip(ctx, "deepseek_v32", layout(ep=2), layout(ep=2), "ep2", tol=1e-5)
    roundtrip(ctx, "glm_moe_dsa", layout(ep=2), layout(ep=2), "ep2", tol=1e-5, rms_norm_eps=1e-6)
    roundtrip(ctx, "minimax_m2", layout(ep=2), layout(ep=2), "ep2", tol=1e-5)
    roundtrip(ctx, "qwen3_next", layout(ep=2), layout(ep=2), "ep2")  # 1e-4 (float noise)


def w2_pp2(ctx) -> None:  # noqa: ANN001
    """PP=2 (Qwen3 and Qwen3-MoE in w2_across_layouts), including embeddings tied across the two stages (mistral,
    gemma2: its embedding scale on the first stage, its final soft-capping on the last); gpt-oss (a sliding and a
    full layer per stage), DeepSeek-V3.2 and GLM-5 (two sparse-attention layers per stage) and MiniMax-M2 within
    1e-5; Qwen3-Next and Qwen3.5 (a DeltaNet and a full layer per stage)."""
    for family in ("deepseek_v3", "glm4_moe", "mistral", "gemma2"):
        roundtrip(ctx, family, layout(pp=2), layout(pp=2), "pp2")
    roundtrip(ctx, "gpt_oss", layout(pp=2), layout(pp=2), "pp2", tol=1e-5)
    roundtrip(ctx, "deepseek_v32", layout(pp=2), layout(pp=2), "pp2", tol=1e-5)
    roundtrip(ctx, "glm_moe_dsa", layout(pp=2), layout(pp=2), "pp2", tol=1e-5, rms_norm_eps=1e-6)
    roundtrip(ctx, "minimax_m2", layout(pp=2), layout(pp=2), "pp2", tol=1e-5)
    roundtrip(ctx, "qwen3_next", layout(pp=2), layout(pp=2), "pp2")  # a DeltaNet and a full layer per stage
    roundtrip(ctx, "qwen3_5_moe", layout(pp=2), layout(pp=2), "pp2")  # Qwen3.5's separate DeltaNet projections


def w2_across_layouts(ctx) -> None:  # noqa: ANN001
    """Converted under PP=2 (vocab padded to 384), loaded and exported under TP=2 (512) and EP=2; converted
    under uneven PP=2 stages of 3 + 1 layers, loaded and exported under 1 + 3 (layers 1 and 2 change stage: the
    checkpoint and the HF names go by global layer); Qwen3.5 converted under TP=2 (DeltaNet's sections split),
    loaded and exported under EP=2."""
    roundtrip(ctx, "mixtral", layout(pp=2), layout(tp=2), "pp2-to-tp2")
    roundtrip(ctx, "qwen3", layout(tp=2), layout(pp=2), "tp2-to-pp2")
    roundtrip(ctx, "qwen3_moe", layout(pp=2, first=3), layout(pp=2, last=3), "pp2-3+1-to-1+3")
    roundtrip(ctx, "qwen3_5_moe", layout(tp=2), layout(ep=2), "tp2-to-ep2")  # DeltaNet's sections, experts


# --- world size 4 ---------------------------------------------------------------------------


def _export(model, parallel: ParallelConfig, bucket_mb: float) -> list[list[tuple[str, torch.Tensor]]]:  # noqa: ANN001
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.export import export_hf_weights, is_export_sender
    from megatron_rl.models.init import init_deterministic
    from megatron_rl.parallel import destroy_distributed, init_distributed

    init_distributed(parallel, model)
    chunks = build_model(model, parallel)
    init_deterministic(chunks, model, seed=7)
    buckets = [[(n, t.clone()) for n, t in b] for b in export_hf_weights(chunks, model, bucket_mb=bucket_mb)]
    if not is_export_sender():
        assert buckets == [], f"rank {dist.get_rank()} is no sender but got {len(buckets)} buckets"
    destroy_distributed(process_group=False)
    return buckets


def w4_export_tp2_ep2(ctx) -> None:  # noqa: ANN001
    """The exporter under TP=2 x EP=2 yields, on rank 0 only, exactly the single-rank export
    (names, order-independent, bits); buckets respect the size limit."""
    model = tiny_model("qwen3_moe", vocab_size=VOCAB)
    limit = 0.02  # MiB: several buckets, and single tensors above the limit
    single = _export(model, layout(), limit)  # TP = EP = 1: a data-parallel copy of the whole model
    split = _export(model, layout(tp=2, ep=2), limit)
    if dist.get_rank() != 0:
        assert single == [] and split == [], "only rank 0 sends"
        return
    for buckets in (single, split):
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert len(bucket) == 1 or size <= limit * 2**20, (len(bucket), size)
    a = {n: t for b in single for n, t in b}
    b = {n: t for b in split for n, t in b}
    assert sum(len(x) for x in single) == len(a) and sum(len(x) for x in split) == len(b), "a name was yielded twice"
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for name, value in a.items():
        assert torch.equal(value, b[name]), f"{name}: TP2xEP2 export differs from the single-rank export"
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"  # global expert 3 lives on EP rank 1
    assert expert in b and b[expert].shape == (64, 32), expert


def w4_tp2_ep2(ctx) -> None:  # noqa: ANN001
    """HF -> Megatron -> HF under TP=2 x EP=2 (and expert-TP 1)."""
    roundtrip(ctx, "qwen3_moe", layout(tp=2, ep=2), layout(tp=2, ep=2, etp=1), "tp2ep2")
    roundtrip(ctx, "deepseek_v3", layout(tp=2, ep=2, etp=1), layout(tp=2, ep=2), "tp2ep2")
    roundtrip(ctx, "glm4_moe", layout(tp=2, ep=2), layout(tp=2, ep=2, etp=1), "tp2ep2")


def w2_actor_loads_converted(ctx) -> None:  # noqa: ANN001
    """The actor takes a converted (weights-only) checkpoint: through `checkpoint.load` at start-up under
    the converting layout (no RNG or optimizer state asked for), through `load` under TP = 2 (vocabulary
    padded to 512 rows instead of 384) and as an initializer (`load_model_weights`); its parameters are
    then the HF tensors, bit for bit."""
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.commands.convert import HF_CONFIG_DIR, hf_to_megatron
    from megatron_rl.config import Config, validate
    from megatron_rl.models.checkpoint_io import load_model_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.models.hf_mapping import HFMapping
    from megatron_rl.parallel import destroy_distributed

    src = hf_folder(ctx, "qwen3_moe")
    ckpt = ctx.shared_dir / "mg-for-actor"
    hf_to_megatron(src, ckpt, parallel=layout(ep=2))
    model = model_config_from_hf(read_hf_config(ckpt / HF_CONFIG_DIR))
    expected = read_all(src)
    mapping = HFMapping(model)

    def check(actor: MegatronActor, how: str) -> None:
        got = {n: t for name, full in actor.full_params().items() for n, t in mapping.to_hf(name, full)}
        assert set(got) == set(expected), f"{how}: {sorted(set(got) ^ set(expected))[:3]}"
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{how}: {name} differs"
        actor.close()
        destroy_distributed(process_group=False)

    same = Config(model=model, parallel=layout(ep=2))
    same.checkpoint.load = str(ckpt)
    validate(same)
    actor = MegatronActor(same)
    assert actor.step == 0
    check(actor, "checkpoint.load under the converting layout")
    cfg = Config(model=model, parallel=layout(tp=2))
    validate(cfg)
    actor = MegatronActor(cfg)
    info = actor.load(ckpt)
    assert info["weights_only"] and not info["optimizer_loaded"] and not info["rng_restored"], info
    check(actor, "MegatronActor.load under TP = 2")
    check(MegatronActor(cfg, initializer=lambda chunks: load_model_weights(chunks, ckpt)), "initializer")
