"""Routed experts as one grouped GEMM per projection (`torch._grouped_mm`), for the local specs.

`GroupedExperts` is Megatron's `SequentialMLP` with its submodules, so it holds the same parameters under the same
names (`local_experts.N.linear_fc1.weight`, `local_experts.N.linear_fc2.weight`) and the same (sharded) state dict:
checkpoints, export, initialisation, LoRA and the weight sync see no difference. Only the forward differs. The
dispatcher hands over the tokens sorted by local expert; the local experts' weights are stacked ([experts, out, in])
and fc1 and fc2 are one `torch._grouped_mm` each, whose group offsets are the cumulative tokens per expert,
computed where the counts are (no `.tolist()`: torch's CUTLASS kernel, bf16 on Hopper and newer, needs no host
sync; its fallback for other dtypes and devices reads the offsets on the host). The backward (`_GroupedLinear`) is
two grouped GEMMs per projection and stacks the weights again instead of keeping the stacked copy from the forward:
the memory held between forward and backward is `SequentialMLP`'s.

- Expert-TP: under Megatron's explicit expert communication the dispatcher gathers the input and reduces the
  output; each expert linear is a matmul of the rank's shard, and so is each group here.
- Expert LoRA (`models.lora`: a forward hook on each expert linear, which this forward does not call): the same
  adapters, applied with grouped GEMMs (`_lora_delta`), their ranks padded with zeros to the 16-byte rows torch's
  grouped GEMM takes (the padding adds zeros; only the rounding of such a matmul may differ in the last bit).
- Each expert linear's forward pre-hooks run before its group (Megatron's DDP waits there for the linear's
  parameters when it overlaps their all-gather); any other forward hook on them is refused.
- One local expert: `SequentialMLP`'s forward (one matmul, no loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_rl.models.experts_choice import ALIGN_BYTES
from megatron_rl.models.lora import LoraLinear, in_row_layout


class _GroupedLinear(torch.autograd.Function):
    """y[rows of group g] = x[rows of group g] @ W_g^T, the weights given one per group ([out, in] each)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):  # frozen weights (LoRA)
            return grad_x, None, *([None] * len(weights))
        grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)  # [groups, out, in]; an empty group's is 0
        return grad_x, None, *grad_w.unbind(0)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """`x` [tokens, in] sorted by group, `offsets` int32 [groups] (cumulative rows), `weights` [out, in] each."""
    return _GroupedLinear.apply(x, offsets, *weights)


class GroupedExperts(SequentialMLP):
    """`SequentialMLP` (same submodules, parameters and state dict) whose forward is grouped GEMMs (module doc)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        if config.add_bias_linear or config.fp8 or config.fp4 or config.use_te_activation_func:
            raise ValueError("GroupedExperts: expert biases, fp8/fp4 and TE activations are not supported")

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        if self.num_local_experts == 1:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        offsets = tokens_per_expert.to(x.device).cumsum(0).to(torch.int32)
        h = self._projection("linear_fc1", x, offsets)
        h = (self._activation(h) * probs.unsqueeze(-1)).to(h.dtype)
        return self._projection("linear_fc2", h, offsets), None

    def _projection(self, name: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        linears = [getattr(expert, name) for expert in self.local_experts]
        loras = [_run_hooks(linear, x) for linear in linears]
        out = grouped_linear(x, offsets, [linear.weight for linear in linears])
        if loras[0] is not None and loras[0].enabled:
            out = out + _lora_delta(loras, x, offsets).to(out.dtype)  # type: ignore[arg-type]
        return out

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """MLP's unfused activation (Megatron's `MLP.forward`), SwiGLU's clamp and offset included."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(h)
        gate, linear = torch.chunk(h, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + config.glu_linear_offset)


def _run_hooks(linear: torch.nn.Module, x: torch.Tensor) -> LoraLinear | None:
    """Run `linear`'s forward pre-hooks; its LoRA (the forward hook `models.lora` puts there), if any."""
    for hook in list(linear._forward_pre_hooks.values()):
        if hook(linear, (x,)) is not None:
            raise RuntimeError(f"GroupedExperts: a forward pre-hook on an expert linear changes its input: {hook}")
    loras = [getattr(hook, "__self__", None) for hook in linear._forward_hooks.values()]
    if not all(isinstance(lora, LoraLinear) for lora in loras) or len(loras) > 1:
        raise RuntimeError(
            f"GroupedExperts: forward hooks {list(linear._forward_hooks.values())} on an expert linear would not run "
            "under grouped GEMMs; set model.moe_grouped_gemm = false"
        )
    return loras[0] if loras else None


def _padded_rank(rank: int, dtype: torch.dtype) -> int:
    align = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    return -(-rank // align) * align


def _lora_delta(loras: list[LoraLinear], x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """What each expert's `LoraLinear.hook` adds to its linear's output, for all experts at once: per slot
    (fc1's gate and up, fc2's one) B (A x) in grouped GEMMs, the slots in fc1's [gate; up] rows, with the
    gradient sums over expert-TP of `LoraLinear._delta` for an expert linear (A of fc1, B of fc2)."""
    first = loras[0]
    x = first.dropout(x)
    rank = first.experts[0][0].A.shape[0]
    pad = _padded_rank(rank, x.dtype) - rank
    partial = first.group_size > 1

    def adapters(slot: int, name: str, summed: bool) -> list[torch.Tensor]:  # one per expert, rank padded with zeros
        weights = [lora.grad_summed(getattr(lora.experts[0][slot], name), summed) for lora in loras]
        return [F.pad(w, (0, 0, 0, pad) if name == "A" else (0, pad)) for w in weights]

    column = first.kind == "column"
    parts = []
    for slot in range(len(first.slots)):
        h = grouped_linear(x, offsets, adapters(slot, "A", partial and column))
        parts.append(grouped_linear(h, offsets, adapters(slot, "B", partial and not column)))
    delta = in_row_layout(parts, first.slots, first.row_layout) if column else parts[0]
    return delta * first.scaling
