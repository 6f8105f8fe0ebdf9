"""Per-token log-probs and entropy from the output layer's input and weight shard, in fp32, chunked
over tokens: logits are never materialised.

Each tensor-parallel (TP) rank holds the rows of the output layer for its contiguous vocabulary
slice [rank * V/TP, (rank + 1) * V/TP), as Megatron's ColumnParallelLinear does. Per chunk of
`chunk_tokens` rows, `vocab_parallel_logprobs_from_hidden` computes that chunk's logits
(hidden @ W.T) into an fp32 buffer, and the ranks all-reduce one max and three sums per token; the
full vocabulary is never gathered. Temperature follows SGLang: `log_softmax(logits / T)`, no
division for T = 0 (greedy) and T = 1. With `softcap` c (Gemma's final logit soft-capping) the logits are
c * tanh(logits / c) before the temperature, as the model's output layer gives them.

Memory: two fp32 scratch buffers of chunk_tokens x V/TP that every chunk reuses, in forward and in
backward (plus one chunk in the weight dtype when it is not fp32, and a third buffer in a soft-capped backward). Backward recomputes each chunk's
logits from what forward saved (hidden, weight, log Z and the entropy per token) and accumulates
the gradients chunk by chunk: of the hidden states into one [tokens, H] tensor, of the weight into
Megatron's fp32 `main_grad` buffer when the weight has one (as Megatron's gradient-accumulation
fusion does), else into one fp32 [V/TP, H] accumulator. The price is one more matmul (the
recompute): four of tokens x H x V/TP instead of three.

Both outputs are differentiable: the log-probs (the policy loss) and the entropy (an entropy
bonus). Backward needs no communication except the TP all-reduce of the hidden-state gradient
(see `reduce_hidden_grad`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

ProcessGroup = dist.ProcessGroup | None


class LogProbs(NamedTuple):
    """Per-token results, fp32, shaped like the target ids; 0 where the mask is False."""

    logprobs: Tensor
    entropy: Tensor


class TopLogProbs(NamedTuple):
    """`LogProbs` and `top` [..., K]: the log-probs of K more token ids per position (`top_ids`)."""

    logprobs: Tensor
    entropy: Tensor
    top: Tensor


@dataclass(frozen=True)
class _Shard:
    """Where this rank's logits sit in the vocabulary and how to reduce over the TP group."""

    group: ProcessGroup
    world: int
    start: int  # first vocabulary id of this rank's slice
    width: int  # columns of this rank's slice that are real tokens (the rest is vocab padding)
    temperature: float
    chunk: int
    softcap: float | None = None

    def all_reduce(self, t: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        if self.world > 1:
            dist.all_reduce(t, op=op, group=self.group)


def _tp_group(group: ProcessGroup) -> tuple[ProcessGroup, int, int]:
    """(group, world size, rank): the given group, else Megatron's TP group, else a single rank."""
    if group is not None:
        return group, dist.get_world_size(group), dist.get_rank(group)
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "vocab_parallel_logprobs_from_hidden: torch.distributed is initialised but Megatron parallel_state is not; "
            "pass group= (the tensor-parallel process group) explicitly"
        )
    tp = parallel_state.get_tensor_model_parallel_group()
    return tp, dist.get_world_size(tp), dist.get_rank(tp)


def _make_shard(
    local_vocab: int,
    vocab_size: int | None,
    temperature: float,
    chunk_tokens: int,
    group: ProcessGroup,
    softcap: float | None = None,
) -> _Shard:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens (train.logprob_chunk_tokens) must be >= 1, got {chunk_tokens}")
    group, world, rank = _tp_group(group)
    padded = local_vocab * world
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {padded}] = local vocab {local_vocab} x TP {world}")
    start = rank * local_vocab
    width = min(max(vocab_size - start, 0), local_vocab)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
    return _Shard(group, world, start, width, float(temperature), int(chunk_tokens), softcap)


def _check_inputs(what: str, lead_shape: torch.Size, target: Tensor, mask: Tensor | None) -> Tensor:
    if target.shape != lead_shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal {what} without its last dim {tuple(lead_shape)}"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer token ids, got dtype {target.dtype}")
    if mask is None:
        return torch.ones(lead_shape, dtype=torch.bool, device=target.device)
    if mask.shape != lead_shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal target shape {tuple(lead_shape)}")
    return mask.to(torch.bool)


def _check_targets(target: Tensor, mask: Tensor, vocab_size: int, name: str = "target") -> None:
    bad = mask.view(*mask.shape, *(1 for _ in target.shape[mask.dim() :])) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}{list(pos)} = {int(target[pos])} is outside the vocabulary [0, {vocab_size}) at an unmasked position"
        )


def _flat(t: Tensor, cols: int, name: str) -> Tensor:
    """A [rows, cols] view of t; refuses to copy (a copy of the logits is what chunking avoids)."""
    try:
        return t.view(-1, cols)
    except RuntimeError as err:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as [tokens, {cols}] "
            "without a copy; pass a tensor whose leading dims are contiguous"
        ) from err


def _local_targets(target: Tensor, mask: Tensor, shard: _Shard) -> tuple[Tensor, Tensor]:
    """Per target [n, J] (J targets per row): its column in this rank's slice, clamped; whether it is in the
    slice and its row unmasked."""
    local = target.long() - shard.start
    owned = mask.unsqueeze(-1) & (local >= 0) & (local < shard.width)
    return local.clamp_(0, max(shard.width - 1, 0)), owned


def _temper_(x: Tensor, shard: _Shard) -> Tensor:
    """In place on x, an fp32 buffer owned by the caller of this helper."""
    if shard.temperature not in (0.0, 1.0):
        x.div_(shard.temperature)
    return x


class _Scratch:
    """Two fp32 [chunk, width] buffers that every chunk reuses (no allocation, no page faults per chunk), and a
    third for backward's soft-capping derivative when the shard soft-caps."""

    def __init__(self, n: int, shard: _Shard, device: torch.device, backward: bool = False) -> None:
        rows = min(n, shard.chunk)
        self.x = torch.empty(rows, shard.width, dtype=torch.float32, device=device)
        self.tmp = torch.empty_like(self.x)
        self.slope = torch.empty_like(self.x) if backward and shard.softcap is not None else None

    def take(self, c: slice) -> tuple[Tensor, Tensor]:
        rows = c.stop - c.start
        return self.x[:rows], self.tmp[:rows]

    def take_slope(self, c: slice) -> Tensor | None:
        return None if self.slope is None else self.slope[: c.stop - c.start]


def _softcap_(x: Tensor, shard: _Shard, slope: Tensor | None = None) -> Tensor:
    """In place on x (fp32 logits): c * tanh(x / c) with the shard's soft-capping c (none: x as it is); its
    derivative 1 - tanh(x / c)^2 into `slope` when given."""
    if shard.softcap is None:
        return x
    t = x.div_(shard.softcap).tanh_()
    if slope is not None:
        torch.mul(t, t, out=slope).neg_().add_(1.0)
    return t.mul_(shard.softcap)


def _chunks(n: int, shard: _Shard) -> list[slice]:
    return [slice(s, min(s + shard.chunk, n)) for s in range(0, n, shard.chunk)]


def _forward_chunk(
    x: Tensor, tmp: Tensor, local: Tensor, owned: Tensor, shard: _Shard
) -> tuple[Tensor, Tensor, Tensor]:
    """x: this chunk's fp32 logits; x and tmp are scratch (overwritten). Returns (logp [rows, J] of the J
    targets of each row, log Z, entropy) per row."""
    z = _temper_(_softcap_(x, shard), shard)
    rows = z.shape[0]
    if shard.width > 0:
        zmax = z.max(dim=-1).values
    else:
        zmax = torch.full((rows,), float("-inf"), dtype=z.dtype, device=z.device)
    shard.all_reduce(zmax, dist.ReduceOp.MAX)
    z.sub_(zmax.unsqueeze(-1))  # z - M <= 0, M the global max
    e = torch.exp(z, out=tmp)
    sums = torch.empty(2 + local.shape[1], rows, dtype=z.dtype, device=z.device)
    sums[0] = e.sum(dim=-1)
    sums[1] = e.mul_(z).sum(dim=-1)  # sum_v e_v (z_v - M)
    if shard.width > 0:
        sums[2:] = (z.gather(1, local) * owned).t()
    else:
        sums[2:] = 0.0
    shard.all_reduce(sums, dist.ReduceOp.SUM)
    log_s = torch.log(sums[0])
    logp = (sums[2:] - log_s).t()
    entropy = log_s - sums[1] / sums[0]
    return logp, zmax + log_s, entropy


@dataclass(frozen=True)
class _Backward:
    """Per-token tensors backward needs: forward's saved statistics and the upstream gradients (fp32)."""

    local: Tensor
    owned: Tensor
    lse: Tensor
    entropy: Tensor
    g_logp: Tensor | None
    g_ent: Tensor | None

    @staticmethod
    def make(saved: tuple[Tensor, ...], g_logp: Tensor | None, g_ent: Tensor | None) -> _Backward:
        """saved = (local, owned, mask, lse, entropy); masked outputs are constants, so their gradients are 0."""
        local, owned, mask, lse, entropy = saved

        def fix(g: Tensor | None) -> Tensor | None:
            return None if g is None else g.to(torch.float32) * mask.view(-1, *(1 for _ in g.shape[1:]))

        return _Backward(local, owned, lse, entropy, fix(g_logp), fix(g_ent))

    def rows(self, c: slice) -> _Backward:
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[c]

        return _Backward(*(pick(getattr(self, f.name)) for f in dataclasses.fields(self)))  # type: ignore[arg-type]

    @property
    def empty(self) -> bool:
        return self.g_logp is None and self.g_ent is None


def _grad_chunk(x: Tensor, tmp: Tensor, b: _Backward, shard: _Shard, slope: Tensor | None = None) -> Tensor:
    """d(loss)/d(logits) of one chunk from its fp32 logits x, in x or tmp (both scratch, overwritten; `slope`
    too, the soft-capping's scratch when the shard soft-caps).

    With q = log p = z - log Z: d logp_t / dz = onehot(t) - p and d H / dz = -p * (q + H); a row's J
    targets add up: sum_j g_j (onehot(t_j) - p); soft-capped, times d z / d x = 1 - tanh(x / c)^2.
    """
    q = _temper_(_softcap_(x, shard, slope), shard).sub_(b.lse.unsqueeze(-1))
    p = torch.exp(q, out=tmp)
    g_sum = None if b.g_logp is None else b.g_logp.sum(dim=-1, keepdim=True)
    if b.g_ent is not None:
        q.add_(b.entropy.unsqueeze(-1)).mul_(b.g_ent.unsqueeze(-1))
        if g_sum is not None:
            q.add_(g_sum)
        grad = q.mul_(p).neg_()
    else:  # then g_logp is set: backward runs only with at least one upstream gradient
        assert g_sum is not None
        grad = p.mul_(-g_sum)
    if b.g_logp is not None and shard.width > 0:
        grad.scatter_add_(1, b.local, b.g_logp * b.owned)
    if shard.temperature not in (0.0, 1.0):
        grad.div_(shard.temperature)
    if slope is not None:
        grad.mul_(slope)
    return grad


def _project(h: Tensor, w: Tensor, out: Tensor) -> Tensor:
    """out (fp32) = h @ w.T; in the parameters' dtype, as the output layer computes it."""
    if h.dtype == torch.float32:
        return torch.mm(h, w.t(), out=out)
    return out.copy_(h @ w.t())


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, target: Tensor, mask: Tensor, shard: _Shard, reduce_hidden_grad: bool
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        w = weight[: shard.width]
        logp = torch.empty(n, target.shape[1], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lse)
        local, owned = _local_targets(target, mask, shard)
        scratch = _Scratch(n, shard, hidden.device)
        for c in _chunks(n, shard):
            x, tmp = scratch.take(c)
            _project(hidden[c], w, out=x)
            logp[c], lse[c], entropy[c] = _forward_chunk(x, tmp, local[c], owned[c], shard)
        logp, entropy = logp.where(mask.unsqueeze(-1), 0.0), entropy.where(mask, 0.0)
        ctx.save_for_backward(hidden, weight, local, owned, mask, lse, entropy)
        ctx.shard = shard
        ctx.reduce_hidden_grad = reduce_hidden_grad
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, *saved = ctx.saved_tensors
        shard: _Shard = ctx.shard
        b = _Backward.make(tuple(saved), g_logp, g_ent)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp32 = weight.dtype == torch.float32
        # every row of grad_h is written by one chunk; the weight gradient accumulates over chunks in
        # fp32 whatever the parameter dtype: straight into Megatron DDP's gradient buffer when there is
        # one (returning a placeholder DDP does not add, `_main_grad_added`), else into one accumulator returned
        grad_h = (torch.zeros_like(hidden) if b.empty else torch.empty_like(hidden)) if want_h else None
        grad_w = acc_w = None
        if want_w:
            main = getattr(weight, "main_grad", None)
            if main is not None and main.dtype == torch.float32 and main.shape == weight.shape:
                acc_w = main
            else:
                acc_w = grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if not b.empty:
            w = weight[: shard.width]
            scratch = _Scratch(hidden.shape[0], shard, hidden.device, backward=True)
            for c in _chunks(hidden.shape[0], shard):
                x, tmp = scratch.take(c)
                h = hidden[c]
                dx = _grad_chunk(_project(h, w, out=x), tmp, b.rows(c), shard, scratch.take_slope(c))
                if acc_w is not None:
                    acc_w[: shard.width].addmm_(dx.t(), h if fp32 else h.to(torch.float32))
                if grad_h is not None:
                    torch.mm(dx.to(hidden.dtype), w, out=grad_h[c])
        if grad_h is not None and ctx.reduce_hidden_grad:
            shard.all_reduce(grad_h, dist.ReduceOp.SUM)
        if grad_w is not None and not fp32:
            grad_w = grad_w.to(weight.dtype)
        if acc_w is not None and grad_w is None and hasattr(weight, "grad_added_to_main_grad"):
            grad_w = _main_grad_added(weight)
        return grad_h, grad_w, None, None, None, None


def _main_grad_added(weight: Tensor) -> Tensor:
    """Megatron's contract for a gradient written straight into DDP's `main_grad` (its gradient-accumulation fusion):
    autograd gets a placeholder, so DDP's per-parameter hook still runs and marks the bucket ready (under
    `overlap_grad_reduce` it refuses a None gradient), and `grad_added_to_main_grad` tells it not to add it. The
    placeholder is zeros where the weight also takes another gradient (tied embeddings, `zero_out_wgrad`): then
    DDP adds their sum."""
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def vocab_parallel_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    chunk_tokens: int = 1024,
    vocab_size: int | None = None,
    group: ProcessGroup = None,
    reduce_hidden_grad: bool = True,
    softcap: float | None = None,
) -> LogProbs:
    """Log-prob of `target` and entropy of softmax(logits / T) for logits = hidden @ weight.T, from
    this rank's vocabulary shard, computed chunk by chunk (see the module docstring).

    hidden: [..., H] (leading dims viewable as one, never copied), the full sequence (gathered if
    sequence parallel), the same on every TP rank.
    weight: [V/TP, H], this rank's rows of the output layer (ColumnParallelLinear.weight); no bias.
    When it carries Megatron DDP's fp32 `main_grad`, its gradient is added there and autograd gets a placeholder
    (None without DDP's `grad_added_to_main_grad` flag).
    target: [...] integer token ids in the full vocabulary (the next token: shift before calling).
    mask: [...] bool, False = padding/prompt: outputs and gradients are 0 there and targets unchecked.
    vocab_size: real vocabulary size; rows at ids >= vocab_size (Megatron's padding) are ignored.
    group: the TP process group; None = Megatron's TP group when torch.distributed is initialised.
    Returns fp32 LogProbs shaped [...]; gradients flow to `hidden` and `weight` through both outputs.
    The gradient of `hidden` is all-reduced over the TP group when `reduce_hidden_grad` is True (the
    caller did a plain copy into the TP region). Pass False when the caller's own region op reduces it,
    e.g. Megatron's gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=True).
    softcap: c > 0 soft-caps the logits to c * tanh(logits / c) before the temperature (Gemma); None = none.
    """
    logp, entropy = _from_hidden(
        hidden, weight, target, None, temperature, mask, chunk_tokens, vocab_size, group, reduce_hidden_grad, softcap
    )
    return LogProbs(logp[..., 0], entropy)


def vocab_parallel_top_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    top_ids: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    chunk_tokens: int = 1024,
    vocab_size: int | None = None,
    group: ProcessGroup = None,
    reduce_hidden_grad: bool = True,
    softcap: float | None = None,
) -> TopLogProbs:
    """`vocab_parallel_logprobs_from_hidden`, and the log-probs of `top_ids` [..., K] (integer ids, K per
    position: the teacher's top-k in on-policy distillation) from the same chunks and reductions, as
    `TopLogProbs.top` [..., K], differentiable too (0 where the mask is False)."""
    if top_ids.shape[:-1] != target.shape or top_ids.dtype.is_floating_point or top_ids.dtype == torch.bool:
        raise ValueError(
            f"top_ids must hold integer ids [*target shape {tuple(target.shape)}, K], got {top_ids.dtype} "
            f"{tuple(top_ids.shape)}"
        )
    logp, entropy = _from_hidden(
        hidden, weight, target, top_ids, temperature, mask, chunk_tokens, vocab_size, group, reduce_hidden_grad, softcap
    )
    return TopLogProbs(logp[..., 0], entropy, logp[..., 1:])


def _from_hidden(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    top_ids: Tensor | None,
    temperature: float,
    mask: Tensor | None,
    chunk_tokens: int,
    vocab_size: int | None,
    group: ProcessGroup,
    reduce_hidden_grad: bool,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """(log-probs [..., 1 + K] of the target then the top ids, entropy [...])."""
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be [V/TP, H] with H = hidden's last dim "
            f"(hidden shape {tuple(hidden.shape)})"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden dtype {hidden.dtype} differs from weight dtype {weight.dtype}")
    mask = _check_inputs("hidden", hidden.shape[:-1], target, mask)
    shard = _make_shard(weight.shape[0], vocab_size, temperature, chunk_tokens, group, softcap)
    targets = (
        target.unsqueeze(-1) if top_ids is None else torch.cat([target.unsqueeze(-1), top_ids.to(target.dtype)], -1)
    )
    _check_targets(target, mask, vocab_size or weight.shape[0] * shard.world)
    if top_ids is not None:
        _check_targets(top_ids, mask, vocab_size or weight.shape[0] * shard.world, "top_ids")
    flat = _flat(hidden, hidden.shape[-1], "hidden")
    width = targets.shape[-1]
    logp, entropy = _FromHidden.apply(
        flat, weight, targets.reshape(-1, width), mask.reshape(-1), shard, reduce_hidden_grad
    )
    return logp.view(*target.shape, width), entropy.view(target.shape)
