"""Shared pieces for multi-process model scenarios: a batch, build + init, full logits (tiny configs:
tests/mrl_configs.py)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.parallel.device import local_device

from mrl_configs import layout

SEQ = 16
BATCH = 2


def sample_batch(model: ModelConfig, seed: int = 0) -> torch.Tensor:
    """The same [BATCH, SEQ] token ids on every rank."""
    return torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def setup(model: ModelConfig, parallel: ParallelConfig, seed: int = 0, **build_kwargs: object) -> list[torch.nn.Module]:
    """Parallel state for `parallel`, the model built, weights from `init_deterministic(seed)`."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.init import init_deterministic
    from megatron_rl.parallel import init_distributed

    init_distributed(parallel, model)
    chunks = build_model(model, parallel, **build_kwargs)
    init_deterministic(chunks, model, seed)
    return chunks


def pack_rows(rows: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """The first `lengths[i]` entries of each row i, one after another (a packed THD row's order)."""
    return torch.cat([row[:n] for row, n in zip(rows, lengths, strict=True)])


def forward_logits(
    chunks: list[torch.nn.Module], ids: torch.Tensor, vocab_size: int, packed: tuple[int, ...] | None = None
) -> torch.Tensor:
    """fp32 logits [b, s, vocab_size] on every rank: one forward-only pass through Megatron's
    schedule (1F1B when PP > 1), vocabulary shards gathered over TP, sent from the last stage.
    `packed`: the first `packed[i]` tokens of each row i in one THD row instead ([1, sum(packed), vocab_size]),
    each sequence with its own positions and `cu_seqlens`."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    params = None
    if packed is None:
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    else:
        ids = pack_rows(ids, packed)[None]
        positions = torch.cat([torch.arange(n) for n in packed])[None]
        bounds = torch.tensor([0, *torch.tensor(packed).cumsum(0).tolist()], dtype=torch.int32, device=local_device())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=max(packed),
            max_seqlen_kv=max(packed),
        )  # fmt: skip
    b, s = ids.shape
    ids, positions = ids.to(local_device()), positions.to(local_device())

    def step(data_iterator, model):  # noqa: ANN001, ANN202 - Megatron's forward_step_func contract
        return model(next(data_iterator), positions, None, packed_seq_params=params), None

    outputs = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([ids]),
        model=chunks,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=True,
    )
    full = torch.empty(b, s, vocab_size, device=ids.device)
    if ps.is_pipeline_last_stage():
        local = outputs[0].float()
        parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)[..., :vocab_size].contiguous()
    dist.broadcast(full, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return full.cpu()


def reference_logits(ctx, model: ModelConfig, ids: torch.Tensor, seed: int = 0) -> torch.Tensor:  # noqa: ANN001
    """Logits of the unsplit model (TP = PP = EP = 1; every rank a data-parallel copy, i.e. the
    world-size-1 model), cached per process."""
    from megatron_rl.parallel import destroy_distributed

    key = f"ref:{dataclasses.astuple(model)}:{ids.sum().item()}:{seed}"
    if key not in ctx.cache:
        chunks = setup(model, layout(), seed)
        ctx.cache[key] = forward_logits(chunks, ids, model.vocab_size)
        destroy_distributed(process_group=False)
    return ctx.cache[key]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (actual - expected).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"{what}: max abs diff {diff:.3e} > {tol:.0e}")
