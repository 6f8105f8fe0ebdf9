"""`megatron-rl convert`: Hugging Face folder <-> Megatron distributed checkpoint.

    megatron-rl convert hf-to-megatron --hf-dir HF --out DIR [--tp N --pp N --ep N --etp N] [--dtype bf16|fp32]
    megatron-rl convert megatron-to-hf --ckpt DIR --out HF [--hf-config-from HF] [--dtype ...]

Run as one process, or under torchrun/srun to spread a large model over ranks (each rank then
holds only its TP/PP/EP shard; the checkpoint itself loads under any layout). The Megatron
checkpoint keeps the HF config.json, generation config and tokenizer files in `DIR/hf_config/`,
so the way back needs no `--hf-config-from` (it overrides them; a checkpoint written by the actor
has none and needs it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config import Config, ConfigError, ModelConfig, ParallelConfig
from megatron_rl.models.hf_config import ConversionError, model_config_from_hf, read_hf_config
from megatron_rl.models.hf_io import copy_assets, prepare_output_dir
from megatron_rl.parallel.launch import ensure_launch_env, launch_rank

HF_CONFIG_DIR = "hf_config"  # inside a Megatron checkpoint: config.json + tokenizer files of the source
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the layout flags and the `parallel` keys they set
LAYOUT_FLAGS = {
    "--tp": "tensor_model_parallel_size",
    "--pp": "pipeline_model_parallel_size",
    "--ep": "expert_model_parallel_size",
    "--etp": "expert_tensor_parallel_size",
}


def _leave_uninitialised(tensor: torch.Tensor) -> torch.Tensor:
    """Init method that keeps the allocated values: every weight is overwritten by the conversion. It returns
    the tensor, as torch's init functions do: Megatron assigns the result back (gpt-oss's attention sinks)."""
    return tensor


# Megatron's `perform_initialization=False` would also skip tagging TP-split parameters, so the
# random init is skipped through the init methods instead (it costs as much as the conversion).
NO_INIT_OVERRIDES: dict[str, Any] = {
    "init_method": _leave_uninitialised,
    "output_layer_init_method": _leave_uninitialised,
    "embedding_init_method": _leave_uninitialised,
}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else launch_rank()


def _check_output(out: str | os.PathLike, force: bool) -> None:
    """The output check every rank makes before any work (read-only)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConversionError(f"output {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ConversionError(f"output folder {path} already exists and is not empty; pass --force to overwrite it")


def _validate(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The model of config.json and the converting ranks' layout through the one configuration check
    (`megatron_rl.validation`), before Megatron is imported; ConfigError naming the keys."""
    from megatron_rl.validation import validate_run

    ensure_launch_env()
    validate_run(Config(model=model, parallel=parallel), "convert")


@contextlib.contextmanager
def _megatron(parallel: ParallelConfig, model: ModelConfig) -> Iterator[list[torch.nn.Module]]:
    """Parallel state and an uninitialised model of `model` under `parallel`; torn down after."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models.builder import build_model
    from megatron_rl.parallel import destroy_distributed, init_distributed

    if ps.model_parallel_is_initialized():
        raise RuntimeError("convert: Megatron parallel state is already initialised in this process")
    ensure_launch_env()
    init_distributed(parallel, model)
    try:
        yield build_model(model, parallel, config_overrides=NO_INIT_OVERRIDES)
    finally:
        destroy_distributed(process_group=False)


def _progress(total: int | None, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled or _rank() != 0, file=sys.stderr)


def _prepare_on_rank0(out: str | os.PathLike, force: bool) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        prepare_output_dir(out, force)
    dist.barrier()


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    parallel: ParallelConfig | None = None,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Convert an HF folder into a Megatron distributed checkpoint `out`; collective over the
    launched ranks. `dtype` (fp32/bf16/fp16): the checkpoint's; None = that of config.json
    (bf16 when it names none). Returns {"tensors", "bytes", "seconds"} of the conversion."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    _check_output(out, force)
    hf = read_hf_config(hf_dir)
    overrides: dict[str, Any] = {"params_dtype": dtype} if dtype else {}
    if not dtype and not (hf.get("dtype") or hf.get("torch_dtype")):
        overrides["params_dtype"] = "bf16"
    model = model_config_from_hf(hf, hf_path=str(hf_dir), source=str(hf_dir / "config.json"), **overrides)
    parallel = parallel or ParallelConfig()
    _validate(model, parallel)
    _check_tokenizer(hf_dir, model.vocab_size)
    from megatron_rl.models.checkpoint_io import save_model_weights
    from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint

    ckpt = open_hf_checkpoint(str(hf_dir), model)
    with _megatron(parallel, model) as chunks:
        with _progress(sum(1 for _ in chunks[0].parameters()), "hf -> megatron", progress) as bar:
            count = load_hf_weights(chunks, model, ckpt, progress=bar.update)
        ckpt.close()
        _prepare_on_rank0(out, force)
        save_model_weights(chunks, out, extra={"source": {"hf_dir": str(hf_dir.resolve()), "family": model.family}})
        if _rank() == 0:
            assets = Path(out) / HF_CONFIG_DIR
            assets.mkdir()
            shutil.copy2(hf_dir / "config.json", assets / "config.json")
            copy_assets(hf_dir, assets)
        import torch.distributed as dist

        dist.barrier()
    return {"tensors": count, "bytes": ckpt.file_bytes, "seconds": time.perf_counter() - start}


def _check_tokenizer(hf_dir: Path, vocab_size: int) -> None:
    """The tokenizer the checkpoint will carry fits the model (DataError); a folder without one is
    converted as weights only, with a warning (a run on it needs data.tokenizer_path)."""
    from megatron_rl.data import TOKENIZER_FILES, has_tokenizer_files, load_tokenizer

    if has_tokenizer_files(hf_dir) or any(hf_dir.glob("tokenizer*")):
        load_tokenizer(hf_dir, "--hf-dir", vocab_size=vocab_size)
    elif _rank() == 0:
        print(
            f"convert hf-to-megatron: warning: {hf_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "the checkpoint carries none: train or sft on it needs data.tokenizer_path",
            file=sys.stderr,
        )


def _config_source(ckpt: Path, hf_config_from: str | os.PathLike | None) -> Path:
    if hf_config_from is not None:
        return Path(hf_config_from)
    stored = ckpt / HF_CONFIG_DIR
    if not (stored / "config.json").is_file():
        raise ConversionError(
            f"{ckpt} has no {HF_CONFIG_DIR}/config.json (it was not written by `convert hf-to-megatron`): "
            "pass --hf-config-from HF_DIR (a folder with the model's config.json)"
        )
    return stored


def _stored_dtype(ckpt: Path) -> str:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    embedding = meta.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ConversionError(f"{ckpt}: the checkpoint has no tensor 'embedding.word_embeddings.weight'")
    names = {v: k for k, v in DTYPES.items()}
    if embedding.dtype not in names:
        raise ConversionError(f"{ckpt}: weights of dtype {embedding.dtype}; supported: {sorted(DTYPES)}")
    return names[embedding.dtype]


def megatron_to_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    hf_config_from: str | os.PathLike | None = None,
    parallel: ParallelConfig | None = None,
    dtype: str | None = None,
    force: bool = False,
    bucket_mb: float = 512,
    max_shard_mb: float = 5000,
    progress: bool = False,
) -> dict[str, Any]:
    """Convert a Megatron distributed checkpoint into an HF folder `out` (sharded safetensors,
    config.json, tokenizer files); collective. `dtype`: of the written tensors, None = the
    checkpoint's. Returns {"tensors", "bytes", "seconds", "files"}."""
    from megatron_rl.models.checkpoint_io import load_model_weights, read_common_state
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.hf_mapping import HFMapping

    start = time.perf_counter()
    ckpt = Path(ckpt)
    _check_output(out, force)
    read_common_state(ckpt)
    source = _config_source(ckpt, hf_config_from)
    hf = read_hf_config(source)
    model = model_config_from_hf(hf, source=str(source / "config.json"), params_dtype=_stored_dtype(ckpt))
    parallel = parallel or ParallelConfig()
    _validate(model, parallel)
    total = len(HFMapping(model).checkpoint_shapes())
    with _megatron(parallel, model) as chunks:
        load_model_weights(chunks, ckpt)
        _prepare_on_rank0(out, force)
        single_stage = parallel.pipeline_model_parallel_size == 1
        with _progress(total if single_stage else None, "megatron -> hf", progress) as bar:
            files = save_hf_folder(
                chunks,
                model,
                out,
                hf,
                assets_from=source,
                dtype=DTYPES[dtype] if dtype else None,
                bucket_mb=bucket_mb,
                max_shard_mb=max_shard_mb,
                progress=bar.update,
            )
    nbytes = sum((Path(out) / f).stat().st_size for f in files)
    return {"tensors": total, "bytes": nbytes, "seconds": time.perf_counter() - start, "files": files}


def _add_layout(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("layout of the converting ranks (any layout loads the result)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    group.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    group.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: = TP)")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --force)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="dtype of the written weights")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_layout(parser)


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model folder (config.json + *.safetensors)")
    _add_common(parser)


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="Megatron distributed checkpoint folder")
    parser.add_argument("--hf-config-from", default=None, help="HF folder whose config.json and tokenizer files to use")
    parser.add_argument("--bucket-mb", type=float, default=512, help="largest tensor bucket gathered at once, MiB")
    parser.add_argument("--max-shard-mb", type=float, default=5000, help="largest safetensors file, MiB")
    _add_common(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    add_hf_to_megatron_arguments(sub.add_parser("hf-to-megatron", help="HF folder -> Megatron distributed checkpoint"))
    add_megatron_to_hf_arguments(sub.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF folder"))


def _parallel(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(**{key: getattr(args, flag.lstrip("-")) for flag, key in LAYOUT_FLAGS.items()})


def _named_by_flags(err: ConfigError) -> str:
    """The message of `err` with the `parallel` keys and `model.hf_path` written as the flags that set them."""
    message = str(err).replace("model.hf_path", "--hf-dir")
    for flag, key in LAYOUT_FLAGS.items():
        message = message.replace(f"parallel.{key}", flag)
    return message


def _convert(args: argparse.Namespace) -> dict[str, Any]:
    common = dict(parallel=_parallel(args), dtype=args.dtype, force=args.force, progress=not args.no_progress)
    if args.direction == "hf-to-megatron":
        return hf_to_megatron(args.hf_dir, args.out, **common)
    return megatron_to_hf(
        args.ckpt,
        args.out,
        hf_config_from=args.hf_config_from,
        bucket_mb=args.bucket_mb,
        max_shard_mb=args.max_shard_mb,
        **common,
    )


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_rl.data import DataError

    try:
        summary = _convert(args)
    except (ConversionError, DataError) as err:
        if _rank() == 0:
            print(f"convert {args.direction}: error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        if _rank() == 0:
            print(f"convert {args.direction}: error: {_named_by_flags(err)}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if _rank() == 0:
        gbps = summary["bytes"] / max(summary["seconds"], 1e-9) / 1e9
        print(
            f"convert {args.direction}: {summary['tensors']} tensors, {summary['bytes'] / 1e9:.3f} GB "
            f"in {summary['seconds']:.1f} s ({gbps:.2f} GB/s) -> {args.out}",
            file=sys.stderr,
        )
    return 0


def main(direction: str, argv: list[str] | None = None) -> int:
    """Entry of tools/convert_*.py: `direction` is hf-to-megatron or megatron-to-hf."""
    parser = argparse.ArgumentParser(prog=f"convert {direction}", description=f"convert checkpoints: {direction}")
    if direction == "hf-to-megatron":
        add_hf_to_megatron_arguments(parser)
    else:
        add_megatron_to_hf_arguments(parser)
    args = parser.parse_args(argv)
    args.direction = direction
    return run(args)
