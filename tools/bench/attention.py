"""Benchmark: the local specs' core attention, `local` (Megatron's `DotProductAttention`) against `sdpa`
(`models.sdpa_attention.SDPAttention`), in one process on the same inputs.

Per sequence length: forward and backward of one layer's core attention on right-padded rows
(`--rows` of `--seq-len` tokens) and on a pack of the same tokens (sequences of `seq-len / 4`),
alternating the two backends: tokens/s (forward + backward, median of `--iters`), the activation
bytes each keeps for backward (the tensors autograd saves, by storage; the [b x heads, s, s] scores
for `local`), on CUDA the allocator's peak, and the largest difference of their outputs.
Widths default to the 1b preset's attention (16 heads, 4 groups, 128 channels); `--mla` uses
DeepSeek-V3's (128 heads' 192-channel queries/keys and 128-channel values, here 16 heads).

    python tools/bench/attention.py --seq-len 512 1024 2048 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _core_attentions(heads: int, groups: int, qk: int, v: int, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.mla_attention import MLADotProductAttention
    from megatron_rl.models.sdpa_attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * qk,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=qk,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    kwargs = dict(k_channels=qk, v_channels=v, pg_collection=pgs)
    return {
        name: cls(config, 1, AttnMaskType.causal, "self", **kwargs)
        for name, cls in (("local", MLADotProductAttention), ("sdpa", SDPAttention))
    }


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    """fn()'s output and the bytes of the distinct storages autograd saves for its backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _bench(module: torch.nn.Module, inputs: dict, iters: int) -> tuple[float, int, int, torch.Tensor]:
    """Median seconds of forward + backward, saved bytes, CUDA peak (0 on the CPU), the output."""
    times = []
    for i in range(iters + 1):
        q, k, v = (t.detach().requires_grad_() for t in inputs["qkv"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out, saved = _saved_bytes(lambda: module(q, k, v, None, packed_seq_params=inputs["packed"]))  # noqa: B023
        out.sum().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:  # the first is warm-up
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return statistics.median(times), saved, peak, out.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--mla", action="store_true", help="192-channel queries/keys, 128-channel values, no GQA")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_distributed, init_distributed
    from megatron_rl.parallel.device import local_device
    from megatron_rl.parallel.launch import ensure_launch_env

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    groups, qk, v = (args.heads, 192, 128) if args.mla else (args.groups, 128, 128)
    device = local_device()
    ensure_launch_env()
    init_distributed(ParallelConfig())
    try:
        modules = _core_attentions(args.heads, groups, qk, v, dtype)
        gen = torch.Generator().manual_seed(0)
        for s in args.seq_len:
            b = args.rows
            rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
            rows = {"qkv": (rand(s, b, args.heads, qk), rand(s, b, groups, qk), rand(s, b, groups, v)), "packed": None}
            t = s * b
            cu = torch.arange(0, t + 1, max(1, s // 4), dtype=torch.int32, device=device)
            pack = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s // 4, max_seqlen_kv=s // 4
            )
            packed = {"qkv": tuple(x.reshape(t, *x.shape[2:]) for x in rows["qkv"]), "packed": pack}
            for layout, inputs in (("padded", rows), ("packed", packed)):
                result = {name: _bench(m, inputs, args.iters) for name, m in modules.items()}
                diff = float((result["sdpa"][3].float() - result["local"][3].float()).abs().max())
                print(
                    json.dumps(
                        {
                            "seq_len": s,
                            "rows": b,
                            "layout": layout,
                            "mla": args.mla,
                            "dtype": args.dtype,
                            "device": device.type,
                            **{f"{n}_tokens_per_s": round(t / r[0]) for n, r in result.items()},
                            "sdpa_speedup": round(result["local"][0] / result["sdpa"][0], 2),
                            **{f"{n}_saved_mib": round(r[1] / 2**20, 1) for n, r in result.items()},
                            **(
                                {f"{n}_peak_mib": round(r[2] / 2**20, 1) for n, r in result.items()}
                                if device.type == "cuda"
                                else {}
                            ),
                            "max_abs_diff": diff,
                        }
                    ),
                    flush=True,
                )
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
