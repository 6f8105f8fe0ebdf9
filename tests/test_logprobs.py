"""Vocab-parallel log-probs and entropy against a plain full-vocabulary log_softmax reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.actor.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden

TEMPERATURES = [0.0, 1.0, 0.6, 1.7]
TOL = 1e-5


def reference(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, temperature: float):
    """Full-vocab fp32 log_softmax(logits / T) + gather, and the entropy; 0 where masked."""
    z = logits.float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * mask, entropy * mask


def make_case(seed: int, lead=(2, 11), vocab: int = 96, hidden: int = 16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.8
    logits = torch.randn(*lead, vocab, generator=g) * 3.0
    target = torch.randint(0, vocab, lead, generator=g)
    mask = torch.rand(*lead, generator=g) > 0.25
    g_logp, g_ent = torch.randn(*lead, generator=g), torch.randn(*lead, generator=g)
    return h, w, logits, target, mask, g_logp, g_ent


def loss_of(logp, entropy, g_logp, g_ent):
    return (logp * g_logp).sum() + (entropy * g_ent).sum()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk", [1, 5, 22, 1000])
def test_from_logits_matches_full_vocab(temperature: float, chunk: int) -> None:
    _, _, logits, target, mask, g_logp, g_ent = make_case(1)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, temperature, mask=mask, chunk_tokens=chunk)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == target.shape
    (grad,) = torch.autograd.grad(loss_of(*out, g_logp, g_ent), x)

    xr = logits.clone().requires_grad_()
    ref_logp, ref_ent = reference(xr, target, mask, temperature)
    (ref_grad,) = torch.autograd.grad(loss_of(ref_logp, ref_ent, g_logp, g_ent), xr)
    assert max_diff(out.logprobs, ref_logp) <= TOL
    assert max_diff(out.entropy, ref_ent) <= TOL
    assert max_diff(grad, ref_grad) <= TOL
    assert torch.equal(x.detach(), logits), "the caller's logits were modified"


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk", [3, 22])
def test_from_hidden_matches_full_vocab(temperature: float, chunk: int) -> None:
    hidden, weight, _, target, mask, g_logp, g_ent = make_case(2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(h, w, target, temperature, mask=mask, chunk_tokens=chunk)
    grads = torch.autograd.grad(loss_of(*out, g_logp, g_ent), [h, w])

    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference(hr @ wr.t(), target, mask, temperature)
    ref_grads = torch.autograd.grad(loss_of(*ref, g_logp, g_ent), [hr, wr])
    assert max_diff(out.logprobs, ref[0]) <= TOL
    assert max_diff(out.entropy, ref[1]) <= TOL
    assert max_diff(grads[0], ref_grads[0]) <= TOL
    assert max_diff(grads[1], ref_grads[1]) <= TOL


@pytest.mark.parametrize("use", ["logprobs", "entropy"])
def test_one_output_backward(use: str) -> None:
    """Backward through only one output (the other's gradient arrives as None)."""
    hidden, weight, logits, target, mask, g_logp, _ = make_case(3)
    pick = 0 if use == "logprobs" else 1
    x, w = logits.clone().requires_grad_(), weight.clone().requires_grad_()
    (grad,) = torch.autograd.grad((vocab_parallel_logprobs(x, target, 0.8, mask=mask)[pick] * g_logp).sum(), x)
    (grad_w,) = torch.autograd.grad(
        (vocab_parallel_logprobs_from_hidden(hidden, w, target, 0.8, mask=mask)[pick] * g_logp).sum(), w
    )
    xr, wr = logits.clone().requires_grad_(), weight.clone().requires_grad_()
    (ref,) = torch.autograd.grad((reference(xr, target, mask, 0.8)[pick] * g_logp).sum(), xr)
    (ref_w,) = torch.autograd.grad((reference(hidden @ wr.t(), target, mask, 0.8)[pick] * g_logp).sum(), wr)
    assert max_diff(grad, ref) <= TOL
    assert max_diff(grad_w, ref_w) <= TOL


def test_hand_computed_two_token_vocab() -> None:
    """logits [0, ln 3]: p = [1/4, 3/4]; logp(1) = ln 3/4, H = ln 4 - (3/4) ln 3; d logp(1)/d logits = [-1/4, 1/4]."""
    x = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]], requires_grad=True)
    out = vocab_parallel_logprobs(x, torch.tensor([1]))
    assert abs(out.logprobs.item() - torch.log(torch.tensor(0.75)).item()) <= 1e-7
    assert abs(out.entropy.item() - (torch.log(torch.tensor(4.0)) - 0.75 * torch.log(torch.tensor(3.0))).item()) <= 1e-7
    out.logprobs.sum().backward()
    assert torch.allclose(x.grad, torch.tensor([[-0.25, 0.25]]), atol=1e-7)


def test_masked_positions_are_zero_and_unchecked() -> None:
    _, _, logits, target, mask, g_logp, g_ent = make_case(4)
    target = torch.where(mask, target, torch.full_like(target, -100))  # ignore-index style padding
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, 1.0, mask=mask, chunk_tokens=4)
    loss_of(*out, g_logp, g_ent).backward()
    assert torch.all(out.logprobs[~mask] == 0) and torch.all(out.entropy[~mask] == 0)
    assert torch.all(x.grad[~mask] == 0)
    assert torch.all(x.grad[mask].abs().sum(-1) > 0)


def test_padded_vocab_columns_are_ignored() -> None:
    """Columns at ids >= vocab_size (Megatron's vocab padding) take no part and get no gradient."""
    hidden, weight, logits, target, mask, g_logp, g_ent = make_case(5)
    real = 90
    target = target.clamp(max=real - 1)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, 0.7, mask=mask, vocab_size=real, chunk_tokens=7)
    loss_of(*out, g_logp, g_ent).backward()
    xr = logits[..., :real].clone().requires_grad_()
    ref = reference(xr, target, mask, 0.7)
    loss_of(*ref, g_logp, g_ent).backward()
    assert max_diff(out.logprobs, ref[0]) <= TOL and max_diff(out.entropy, ref[1]) <= TOL
    assert max_diff(x.grad[..., :real], xr.grad) <= TOL
    assert torch.all(x.grad[..., real:] == 0)

    w = weight.clone().requires_grad_()
    out_h = vocab_parallel_logprobs_from_hidden(hidden, w, target, 0.7, mask=mask, vocab_size=real)
    assert max_diff(out_h.logprobs, reference(hidden @ weight[:real].t(), target, mask, 0.7)[0]) <= TOL
    loss_of(*out_h, g_logp, g_ent).backward()
    assert torch.all(w.grad[real:] == 0)


def test_bf16_inputs_give_fp32_outputs() -> None:
    hidden, weight, logits, target, mask, g_logp, g_ent = make_case(6)
    x = logits.bfloat16().requires_grad_()
    out = vocab_parallel_logprobs(x, target, 0.9, mask=mask, chunk_tokens=5)
    loss_of(*out, g_logp, g_ent).backward()
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16
    # exact for the bf16 values it was given, within bf16 rounding of the fp32 logits
    exact = reference(x.detach().float(), target, mask, 0.9)
    assert max_diff(out.logprobs, exact[0]) <= TOL and max_diff(out.entropy, exact[1]) <= TOL
    fp32 = reference(logits, target, mask, 0.9)
    assert max_diff(out.logprobs, fp32[0]) <= 0.1 and max_diff(out.entropy, fp32[1]) <= 0.05

    hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    out_h = vocab_parallel_logprobs_from_hidden(hb, wb, target, 0.9, mask=mask, chunk_tokens=5)
    loss_of(*out_h, g_logp, g_ent).backward()
    assert out_h.logprobs.dtype == torch.float32 and wb.grad.dtype == torch.bfloat16
    wr = weight.clone().requires_grad_()
    ref = reference(hidden @ wr.t(), target, mask, 0.9)
    loss_of(*ref, g_logp, g_ent).backward()
    assert max_diff(out_h.logprobs, ref[0]) <= 0.1
    assert max_diff(wb.grad, wr.grad) <= 0.05 * wr.grad.abs().max().item()


class _LargestNewTensor(TorchDispatchMode):
    """Largest tensor (in bytes) that an aten op allocates, ignoring outputs that alias an input."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, str] = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in _tensors((args, kwargs))}
        for t in _tensors(out):
            nbytes = t.untyped_storage().nbytes()
            if t.untyped_storage().data_ptr() not in inputs and nbytes > self.largest[0]:
                self.largest = (nbytes, f"{func} -> {t.dtype}{list(t.shape)}")
        return out


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def test_memory_is_bounded_by_the_chunk() -> None:
    """No op allocates more than one fp32 chunk of logits (except the logits gradient, in the input dtype)."""
    n, vocab, hid, chunk = 64, 512, 8, 8
    logits = torch.randn(n, vocab).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (n,))
    with _LargestNewTensor() as seen:
        vocab_parallel_logprobs(logits, target, 0.7, chunk_tokens=chunk).logprobs.sum().backward()
    grad_bytes = n * vocab * 2
    assert seen.largest[0] == grad_bytes, seen.largest  # the bf16 gradient, not an fp32 [n, V] copy

    hidden, weight = torch.randn(n, hid, requires_grad=True), torch.randn(vocab, hid, requires_grad=True)
    with _LargestNewTensor() as seen:
        out = vocab_parallel_logprobs_from_hidden(hidden, weight, target, 0.7, chunk_tokens=chunk)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert seen.largest[0] <= chunk * vocab * 4, seen.largest


def test_bad_inputs_name_the_culprit() -> None:
    logits, target = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=r"target shape \(3,\) must equal logits"):
        vocab_parallel_logprobs(logits, target[:3])
    with pytest.raises(ValueError, match=r"target\[2\] = 10 is outside the vocabulary \[0, 10\)"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        vocab_parallel_logprobs(logits, target, -1.0)
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens"):
        vocab_parallel_logprobs(logits, target, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"vocab_size \(11\) must be in \[1, 10\]"):
        vocab_parallel_logprobs(logits, target, vocab_size=11)
    with pytest.raises(ValueError, match="cannot be viewed"):
        vocab_parallel_logprobs(torch.randn(4, 3, 10).transpose(0, 1), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight shape \(10, 5\) must be \[V/TP, H\]"):
        vocab_parallel_logprobs_from_hidden(torch.randn(4, 6), torch.randn(10, 5), target)


# ---- TP = 2: a real 2-process gloo group, every scenario in one launch ----


def _tp_worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for seed, temperature, chunk in [(10, 1.0, 3), (11, 0.0, 64), (12, 0.6, 5), (13, 1.7, 22)]:
            _check_tp_case(rank, world, seed, temperature, chunk)
        _check_tp_padded_vocab(rank, world)
        _check_tp_bf16(rank, world)
    finally:
        dist.destroy_process_group()


def _shard(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].clone()


def _check_tp_case(rank: int, world: int, seed: int, temperature: float, chunk: int) -> None:
    hidden, weight, logits, target, mask, g_logp, g_ent = make_case(seed)
    where = f"rank {rank}, seed {seed}, T={temperature}, chunk={chunk}"
    x = _shard(logits, rank, world, -1).requires_grad_()
    out = vocab_parallel_logprobs(x, target, temperature, mask=mask, chunk_tokens=chunk, group=dist.group.WORLD)
    loss_of(*out, g_logp, g_ent).backward()
    xr = logits.clone().requires_grad_()
    ref = reference(xr, target, mask, temperature)
    loss_of(*ref, g_logp, g_ent).backward()
    assert max_diff(out.logprobs, ref[0]) <= TOL, where
    assert max_diff(out.entropy, ref[1]) <= TOL, where
    assert max_diff(x.grad, _shard(xr.grad, rank, world, -1)) <= TOL, where

    h, w = hidden.clone().requires_grad_(), _shard(weight, rank, world, 0).requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(
        h, w, target, temperature, mask=mask, chunk_tokens=chunk, group=dist.group.WORLD
    )
    loss_of(*out, g_logp, g_ent).backward()
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference(hr @ wr.t(), target, mask, temperature)
    loss_of(*ref, g_logp, g_ent).backward()
    assert max_diff(out.logprobs, ref[0]) <= TOL, where
    assert max_diff(out.entropy, ref[1]) <= TOL, where
    assert max_diff(h.grad, hr.grad) <= TOL, where  # all-reduced over the TP group
    assert max_diff(w.grad, _shard(wr.grad, rank, world, 0)) <= TOL, where


def _check_tp_padded_vocab(rank: int, world: int) -> None:
    """V/TP = 48 per rank; a real vocabulary of 60 leaves 36 padding columns on rank 1, one of 40 leaves rank 1 only padding."""
    hidden, weight, logits, target, mask, g_logp, g_ent = make_case(14)
    for real in (60, 40):  # 40: rank 1 holds only padding
        where = f"rank {rank}, vocab {real}"
        tgt = target.clamp(max=real - 1)
        x = _shard(logits, rank, world, -1).requires_grad_()
        out = vocab_parallel_logprobs(x, tgt, 0.8, mask=mask, chunk_tokens=6, vocab_size=real, group=dist.group.WORLD)
        loss_of(*out, g_logp, g_ent).backward()
        xr = logits[..., :real].clone().requires_grad_()
        ref = reference(xr, tgt, mask, 0.8)
        loss_of(*ref, g_logp, g_ent).backward()
        full_grad = torch.cat([xr.grad, torch.zeros(*xr.shape[:-1], logits.shape[-1] - real)], dim=-1)
        assert max_diff(out.logprobs, ref[0]) <= TOL, where
        assert max_diff(out.entropy, ref[1]) <= TOL, where
        assert max_diff(x.grad, _shard(full_grad, rank, world, -1)) <= TOL, where

        h, w = hidden.clone().requires_grad_(), _shard(weight, rank, world, 0).requires_grad_()
        out = vocab_parallel_logprobs_from_hidden(
            h, w, tgt, 0.8, mask=mask, chunk_tokens=6, vocab_size=real, group=dist.group.WORLD
        )
        loss_of(*out, g_logp, g_ent).backward()
        hr, wr = hidden.clone().requires_grad_(), weight[:real].clone().requires_grad_()
        ref = reference(hr @ wr.t(), tgt, mask, 0.8)
        loss_of(*ref, g_logp, g_ent).backward()
        full_grad_w = torch.cat([wr.grad, torch.zeros(weight.shape[0] - real, weight.shape[1])])
        assert max_diff(out.logprobs, ref[0]) <= TOL, where
        assert max_diff(h.grad, hr.grad) <= TOL, where
        assert max_diff(w.grad, _shard(full_grad_w, rank, world, 0)) <= TOL, where


def _check_tp_bf16(rank: int, world: int) -> None:
    _, _, logits, target, mask, g_logp, g_ent = make_case(15)
    x = _shard(logits, rank, world, -1).bfloat16().requires_grad_()
    out = vocab_parallel_logprobs(x, target, 1.0, mask=mask, chunk_tokens=4, group=dist.group.WORLD)
    loss_of(*out, g_logp, g_ent).backward()
    assert out.logprobs.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    exact = reference(logits.bfloat16().float(), target, mask, 1.0)
    assert max_diff(out.logprobs, exact[0]) <= TOL and max_diff(out.entropy, exact[1]) <= TOL
    assert max_diff(out.logprobs, reference(logits, target, mask, 1.0)[0]) <= 0.1


def test_tensor_parallel_two_ranks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init_file = str(tmp_path / "rendezvous")
    assert not os.path.exists(init_file)
    mp.spawn(_tp_worker, args=(2, init_file), nprocs=2, join=True)
