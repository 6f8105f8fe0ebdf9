"""Benchmark of checkpoint conversion against a raw safetensors read + write of the same bytes.

A random Qwen3-MoE checkpoint (bf16, the shapes of --hidden/--layers/--experts/...) is written as
sharded safetensors. Each repeat times, in turn: the baseline (read every tensor of the folder
with safetensors and write it to a new folder, same files), `convert hf-to-megatron` (parallel
state, model build, streaming import, Megatron distributed checkpoint), `convert megatron-to-hf`
(build, distributed load, export, sharded safetensors), and the format floor of each direction:
the same tensors, unconverted, read with safetensors and saved with Megatron's
`dist_checkpointing` through the converter's strategies (and loaded back and written with
safetensors). One process, world size 1, Megatron imported before timing; the first repeat also
pays one-time start-up. Garbage is collected before each timed step (a Megatron model is freed by
the cycle collector, which would otherwise run inside a later step). Two JSON lines per
direction: GB/s of HF bytes (median over repeats) next to the raw safetensors baseline (ratio;
goal >= 0.5), and next to the format floor (how much of the time conversion adds to what the
checkpoint format costs by itself).

    python tools/bench/convert.py [--hidden 1024 --layers 4 --experts 16 --moe-width 512 --vocab 32000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_checkpoint(folder: Path, args: argparse.Namespace) -> int:
    """A random bf16 Qwen3-MoE folder (config.json + safetensors shards); returns its bytes."""
    from megatron_rl.config import ModelConfig
    from megatron_rl.models.hf_config import hf_config_from_model
    from megatron_rl.models.hf_io import ShardedSafetensorsWriter, finalize_hf_folder
    from megatron_rl.models.hf_mapping import HFMapping

    model = ModelConfig(
        family="qwen3_moe",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.moe_width * 4,
        num_attention_heads=args.hidden // 64,
        num_query_groups=max(1, args.hidden // 256),
        kv_channels=64,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        num_experts=args.experts,
        moe_router_topk=2,
        moe_ffn_hidden_size=args.moe_width,
        params_dtype="bf16",
    )
    folder.mkdir()
    writer = ShardedSafetensorsWriter(folder, "part", int(args.shard_mb * 2**20))
    gen = torch.Generator().manual_seed(0)
    for name, shape in HFMapping(model).expected_hf_shapes().items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.flush()
    finalize_hf_folder(folder, writer.files)
    (folder / "config.json").write_text(json.dumps(hf_config_from_model(model)))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def raw_copy(src: Path, dst: Path) -> None:
    """The baseline: every tensor read with safetensors and written again, file by file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})


def dcp_write(src: Path, dst: Path) -> None:
    """Floor of hf-to-megatron: the tensors read with safetensors and saved as one Megatron distributed checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safetensors import safe_open

    from megatron_rl.models.torch_dist_io import DirectSaveStrategy

    sharded = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                sharded[name] = ShardedTensor.from_rank_offsets(name, handle.get_tensor(name), replica_id=0)
    dst.mkdir()
    dist_checkpointing.save(sharded, str(dst), sharded_strategy=DirectSaveStrategy())


def dcp_read(src: Path, like: Path, dst: Path) -> None:
    """Floor of megatron-to-hf: the checkpoint of `dcp_write` loaded and written with safetensors (files of `like`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_rl.models.torch_dist_io import DirectLoadStrategy

    files: dict[str, list[str]] = {}
    sharded = {}
    for file in sorted(like.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            files[file.name] = list(handle.keys())
            for name in handle.keys():
                piece = handle.get_slice(name)
                empty = torch.empty(piece.get_shape(), dtype=getattr(torch, _TORCH_DTYPES[piece.get_dtype()]))
                sharded[name] = ShardedTensor.from_rank_offsets(name, empty, replica_id=0)
    loaded = dist_checkpointing.load(sharded, str(src), sharded_strategy=DirectLoadStrategy())
    dst.mkdir()
    for file, names in files.items():
        save_file({n: loaded[n] for n in names}, str(dst / file), metadata={"format": "pt"})


_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def timed(fn, *args, **kwargs) -> float:  # noqa: ANN001
    gc.collect()
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--moe-width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=float, default=100, help="safetensors file size of the source folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from megatron_rl.commands.convert import hf_to_megatron, megatron_to_hf

    root = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        src = root / "hf"
        nbytes = make_checkpoint(src, args)
        raw_copy(src, root / "warm")  # page cache and allocator warm-up, untimed
        times: dict[str, list[float]] = {
            k: [] for k in ("raw", "hf_to_megatron", "megatron_to_hf", "floor_h2m", "floor_m2h")
        }
        for i in range(args.repeats):
            times["raw"].append(timed(raw_copy, src, root / f"raw{i}"))
            times["hf_to_megatron"].append(timed(hf_to_megatron, src, root / f"mg{i}"))
            times["megatron_to_hf"].append(timed(megatron_to_hf, root / f"mg{i}", root / f"back{i}"))
            times["floor_h2m"].append(timed(dcp_write, src, root / f"dcp{i}"))
            times["floor_m2h"].append(timed(dcp_read, root / f"dcp{i}", src, root / f"dcpback{i}"))
            for name in (f"raw{i}", f"mg{i}", f"back{i}", f"dcp{i}", f"dcpback{i}"):
                shutil.rmtree(root / name)
        raw = nbytes / statistics.median(times["raw"]) / 1e9
        for direction, floor in (("hf_to_megatron", "floor_h2m"), ("megatron_to_hf", "floor_m2h")):
            gbps = nbytes / statistics.median(times[direction]) / 1e9
            floor_gbps = nbytes / statistics.median(times[floor]) / 1e9
            for baseline, value, seconds in (
                ("safetensors_read_write_gbps", raw, times["raw"]),
                ("dist_checkpointing_format_floor_gbps", floor_gbps, times[floor]),
            ):
                line = {
                    "figure": f"convert_{direction}_gbps",
                    "value": round(gbps, 3),
                    "baseline": baseline,
                    "baseline_value": round(value, 3),
                    "ratio": round(gbps / value, 3),
                    "bytes": nbytes,
                    "seconds": [round(t, 3) for t in times[direction]],
                    "baseline_seconds": [round(t, 3) for t in seconds],
                    "threads": args.threads,
                }
                print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
