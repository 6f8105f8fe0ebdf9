"""Vocab-parallel log-probs and entropy from hidden states against a plain full-vocabulary log_softmax reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.actor.logprobs import vocab_parallel_logprobs_from_hidden, vocab_parallel_top_logprobs_from_hidden
from megatron_rl.losses import Normalizer
from megatron_rl.losses.entropy import entropy_bonus

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
    target = torch.randint(0, vocab, lead, generator=g)
    mask = torch.rand(*lead, generator=g) > 0.25
    g_logp, g_ent = torch.randn(*lead, generator=g), torch.randn(*lead, generator=g)
    return h, w, target, mask, g_logp, g_ent


def loss_of(logp, entropy, g_logp, g_ent):
    return (logp * g_logp).sum() + (entropy * g_ent).sum()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk", [1, 3, 22, 1000])
def test_from_hidden_matches_full_vocab(temperature: float, chunk: int) -> None:
    hidden, weight, target, mask, g_logp, g_ent = make_case(2)
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


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 3), (0.6, 1000), (0.0, 5)])
def test_softcapped_logits_match_full_vocab(temperature: float, chunk: int) -> None:
    """Gemma's final logit soft-capping, 2 tanh(logits / 2) before the temperature, on logits of std ~3 (the cap
    bites): log-probs, entropy and both gradients (the backward's 1 - tanh^2) as autograd through the capped
    full-vocabulary reference gives them; without the cap they differ by far more."""
    hidden, weight, target, mask, g_logp, g_ent = make_case(7)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(h, w, target, temperature, mask=mask, chunk_tokens=chunk, softcap=2.0)
    grads = torch.autograd.grad(loss_of(*out, g_logp, g_ent), [h, w])
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference(torch.tanh(hr @ wr.t() / 2.0) * 2.0, target, mask, temperature)
    ref_grads = torch.autograd.grad(loss_of(*ref, g_logp, g_ent), [hr, wr])
    for got, want in zip((*out, *grads), (*ref, *ref_grads), strict=True):
        assert max_diff(got, want) <= TOL
    assert max_diff(out.logprobs, reference(hidden @ weight.t(), target, mask, temperature)[0]) > 1.0
    with pytest.raises(ValueError, match="softcap must be > 0"):
        vocab_parallel_logprobs_from_hidden(hidden, weight, target, softcap=0.0)


@pytest.mark.parametrize("use", ["logprobs", "entropy"])
def test_one_output_backward(use: str) -> None:
    """Backward through only one output (the other's gradient arrives as None)."""
    hidden, weight, target, mask, g_logp, _ = make_case(3)
    pick = 0 if use == "logprobs" else 1
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    grads = torch.autograd.grad(
        (vocab_parallel_logprobs_from_hidden(h, w, target, 0.8, mask=mask)[pick] * g_logp).sum(), [h, w]
    )
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = torch.autograd.grad((reference(hr @ wr.t(), target, mask, 0.8)[pick] * g_logp).sum(), [hr, wr])
    assert max_diff(grads[0], ref[0]) <= TOL
    assert max_diff(grads[1], ref[1]) <= TOL


def test_hand_computed_two_token_vocab() -> None:
    """hidden [0, ln 3], W = I: logits [0, ln 3], p = [1/4, 3/4]; logp(1) = ln 3/4,
    H = ln 4 - (3/4) ln 3; d logp(1)/d logits = [-1/4, 1/4] = d/d hidden, and d/d W = outer([-1/4, 1/4], h)."""
    ln3 = float(torch.log(torch.tensor(3.0)))
    h = torch.tensor([[0.0, ln3]], requires_grad=True)
    w = torch.eye(2).requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(h, w, torch.tensor([1]))
    assert abs(out.logprobs.item() - torch.log(torch.tensor(0.75)).item()) <= 1e-7
    assert abs(out.entropy.item() - (torch.log(torch.tensor(4.0)) - 0.75 * ln3).item()) <= 1e-7
    out.logprobs.sum().backward()
    assert torch.allclose(h.grad, torch.tensor([[-0.25, 0.25]]), atol=1e-7)
    assert torch.allclose(w.grad, torch.tensor([[0.0, -0.25 * ln3], [0.0, 0.25 * ln3]]), atol=1e-7)


def test_masked_positions_are_zero_and_unchecked() -> None:
    hidden, weight, target, mask, g_logp, g_ent = make_case(4)
    target = torch.where(mask, target, torch.full_like(target, -100))  # ignore-index style padding
    h = hidden.clone().requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(h, weight, target, 1.0, mask=mask, chunk_tokens=4)
    loss_of(*out, g_logp, g_ent).backward()
    assert torch.all(out.logprobs[~mask] == 0) and torch.all(out.entropy[~mask] == 0)
    assert torch.all(h.grad[~mask] == 0)
    assert torch.all(h.grad[mask].abs().sum(-1) > 0)


def test_padded_vocab_columns_are_ignored() -> None:
    """Rows of W at ids >= vocab_size (Megatron's vocab padding) take no part and get no gradient."""
    hidden, weight, target, mask, g_logp, g_ent = make_case(5)
    real = 90
    target = target.clamp(max=real - 1)
    w = weight.clone().requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(hidden, w, target, 0.7, mask=mask, vocab_size=real, chunk_tokens=7)
    loss_of(*out, g_logp, g_ent).backward()
    wr = weight[:real].clone().requires_grad_()
    ref = reference(hidden @ wr.t(), target, mask, 0.7)
    loss_of(*ref, g_logp, g_ent).backward()
    assert max_diff(out.logprobs, ref[0]) <= TOL and max_diff(out.entropy, ref[1]) <= TOL
    assert max_diff(w.grad[:real], wr.grad) <= TOL
    assert torch.all(w.grad[real:] == 0)


def test_weight_gradient_goes_into_main_grad() -> None:
    """A weight with Megatron DDP's fp32 `main_grad` gets its gradient added there (what was in it
    stays), autograd gets None; a bf16 `main_grad` is not used."""
    hidden, weight, target, mask, g_logp, g_ent = make_case(7)
    w = weight.clone().requires_grad_()
    w.main_grad = torch.full(weight.shape, 0.5)
    h = hidden.clone().requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(h, w, target, 0.9, mask=mask, chunk_tokens=4)
    loss_of(*out, g_logp, g_ent).backward()
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_of(*reference(hr @ wr.t(), target, mask, 0.9), g_logp, g_ent).backward()
    assert w.grad is None
    assert max_diff(w.main_grad, wr.grad + 0.5) <= TOL
    assert max_diff(h.grad, hr.grad) <= TOL

    w.main_grad = torch.zeros(weight.shape, dtype=torch.bfloat16)
    out = vocab_parallel_logprobs_from_hidden(hidden, w, target, 0.9, mask=mask, chunk_tokens=4)
    loss_of(*out, g_logp, g_ent).backward()
    assert max_diff(w.grad, wr.grad) <= TOL and not w.main_grad.any()


def test_entropy_bonus_gradient_matches_autograd() -> None:
    """loss = sum(-logp)/N + entropy_bonus(coef) on a tiny batch: the bonus is -coef x the mean entropy
    over the loss tokens (hand value), and the gradients of hidden and W equal autograd's through a
    full log_softmax; with coef = 0 the bonus is 0 and the entropy carries no gradient."""
    hidden, weight, target, mask, _, _ = make_case(8, lead=(3, 5), vocab=12, hidden=6)
    norm = Normalizer(num_tokens=float(mask.sum()) + 4, num_sequences=3.0, token_norm=5.0)  # other micro-batches too
    for coef in (0.0, 0.3):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = vocab_parallel_logprobs_from_hidden(h, w, target, 0.8, mask=mask, chunk_tokens=2)
        bonus = entropy_bonus(out.entropy, mask, coef, norm, "token-mean")
        assert abs(bonus.item() - (-coef * out.entropy[mask].sum().item() / norm.num_tokens)) <= 1e-7
        (-(out.logprobs[mask]).sum() / norm.num_tokens + bonus).backward()

        hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lsm = torch.log_softmax((hr @ wr.t()) / 0.8, dim=-1)
        ent = -(lsm.exp() * lsm).sum(-1)
        logp = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        (-(logp[mask]).sum() / norm.num_tokens - coef * ent[mask].sum() / norm.num_tokens).backward()
        assert max_diff(h.grad, hr.grad) <= TOL and max_diff(w.grad, wr.grad) <= TOL
    with pytest.raises(ValueError, match=r"entropy shape \(3, 5\) must equal mask shape \(3, 4\)"):
        entropy_bonus(out.entropy, mask[:, :4], 0.1, norm, "token-mean")


def test_bf16_inputs_give_fp32_outputs() -> None:
    hidden, weight, target, mask, g_logp, g_ent = make_case(6)
    hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    out_h = vocab_parallel_logprobs_from_hidden(hb, wb, target, 0.9, mask=mask, chunk_tokens=5)
    loss_of(*out_h, g_logp, g_ent).backward()
    assert out_h.logprobs.dtype == torch.float32 and out_h.entropy.dtype == torch.float32
    assert wb.grad.dtype == torch.bfloat16 and hb.grad.dtype == torch.bfloat16
    # exact for the bf16 logits it computed, within bf16 rounding of the fp32 ones
    exact = reference((hb.detach() @ wb.detach().t()).float(), target, mask, 0.9)
    assert max_diff(out_h.logprobs, exact[0]) <= TOL and max_diff(out_h.entropy, exact[1]) <= TOL
    wr = weight.clone().requires_grad_()
    ref = reference(hidden @ wr.t(), target, mask, 0.9)
    loss_of(*ref, g_logp, g_ent).backward()
    assert max_diff(out_h.logprobs, ref[0]) <= 0.1 and max_diff(out_h.entropy, ref[1]) <= 0.05
    assert max_diff(wb.grad, wr.grad) <= 0.05 * wr.grad.abs().max().item()


def top_case(seed: int, vocab: int = 96, k: int = 5):
    """`make_case` plus K ids per position (the sampled target among them where a position repeats it) and
    their upstream gradient."""
    hidden, weight, target, mask, g_logp, g_ent = make_case(seed, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 100)
    top = torch.randint(0, vocab, (*target.shape, k), generator=g)
    top[0, :, 0] = target[0]  # the sampled token again: both of its gradients add up
    return hidden, weight, target, top, mask, g_logp, g_ent, torch.randn(*top.shape, generator=g)


def top_reference(hidden, weight, target, top, mask, temperature, g_logp, g_ent, g_top):
    """(log-probs, entropy, top log-probs) of a full log_softmax and the grads of hidden and weight."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = (h @ w.t()).float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    tops = logp_all.gather(-1, top) * mask.unsqueeze(-1)
    (loss_of(logp, entropy, g_logp, g_ent) + (tops * g_top).sum()).backward()
    return logp, entropy, tops, h.grad, w.grad


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 3), (0.6, 1000)])
def test_top_logprobs_match_the_full_vocab_with_their_gradient(temperature: float, chunk: int) -> None:
    """The log-probs of K more ids per position equal a full log_softmax gathered at them, and the gradient of
    a loss on all three outputs (ids repeated: the sampled one among the top) equals autograd's."""
    hidden, weight, target, top, mask, g_logp, g_ent, g_top = top_case(4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_top_logprobs_from_hidden(h, w, target, top, temperature, mask=mask, chunk_tokens=chunk)
    (loss_of(out.logprobs, out.entropy, g_logp, g_ent) + (out.top * g_top).sum()).backward()
    ref = top_reference(hidden, weight, target, top, mask, temperature, g_logp, g_ent, g_top)
    for got, want in zip((out.logprobs, out.entropy, out.top, h.grad, w.grad), ref, strict=True):
        assert max_diff(got, want) <= TOL
    assert out.top.shape == (2, 11, 5) and float(out.top.detach()[mask].abs().min()) > 1.0  # real values, not zeros
    with pytest.raises(ValueError, match=r"top_ids\[0, 1, 2\] = 96 is outside the vocabulary \[0, 96\)"):
        bad = top.clone()
        bad[0, 1, 2] = 96
        vocab_parallel_top_logprobs_from_hidden(hidden, weight, target, bad, mask=torch.ones_like(mask))


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
    """No op allocates more than one fp32 chunk of logits: no [tokens, V] tensor in forward or backward."""
    n, vocab, hid, chunk = 64, 512, 8, 8
    target = torch.randint(0, vocab, (n,))
    hidden, weight = torch.randn(n, hid, requires_grad=True), torch.randn(vocab, hid, requires_grad=True)
    weight.main_grad = torch.zeros(vocab, hid)  # as under Megatron's DDP: no [V, H] accumulator either
    with _LargestNewTensor() as seen:
        out = vocab_parallel_logprobs_from_hidden(hidden, weight, target, 0.7, chunk_tokens=chunk)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert seen.largest[0] <= chunk * vocab * 4, seen.largest
    assert weight.main_grad.abs().sum() > 0


def test_bad_inputs_name_the_culprit() -> None:
    hidden, weight, target = torch.randn(4, 6), torch.randn(10, 6), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=r"target shape \(3,\) must equal hidden"):
        vocab_parallel_logprobs_from_hidden(hidden, weight, target[:3])
    with pytest.raises(ValueError, match=r"target\[2\] = 10 is outside the vocabulary \[0, 10\)"):
        vocab_parallel_logprobs_from_hidden(hidden, weight, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        vocab_parallel_logprobs_from_hidden(hidden, weight, target, -1.0)
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens"):
        vocab_parallel_logprobs_from_hidden(hidden, weight, target, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"vocab_size \(11\) must be in \[1, 10\]"):
        vocab_parallel_logprobs_from_hidden(hidden, weight, target, vocab_size=11)
    with pytest.raises(ValueError, match="cannot be viewed"):
        vocab_parallel_logprobs_from_hidden(
            torch.randn(4, 3, 6).transpose(0, 1), weight, torch.zeros(3, 4, dtype=torch.long)
        )
    with pytest.raises(ValueError, match=r"weight shape \(10, 5\) must be \[V/TP, H\]"):
        vocab_parallel_logprobs_from_hidden(hidden, torch.randn(10, 5), target)
    with pytest.raises(TypeError, match="hidden dtype torch.float32 differs from weight dtype torch.bfloat16"):
        vocab_parallel_logprobs_from_hidden(hidden, weight.bfloat16(), target)


# ---- TP = 2: a real 2-process gloo group, every scenario in one launch ----


def _tp_worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for seed, temperature, chunk in [(10, 1.0, 3), (11, 0.0, 64), (12, 0.6, 5), (13, 1.7, 22)]:
            _check_tp_case(rank, world, seed, temperature, chunk)
        _check_tp_padded_vocab(rank, world)
        _check_tp_bf16(rank, world)
        _check_tp_top(rank, world)
    finally:
        dist.destroy_process_group()


def _shard(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].clone()


def _check_tp_case(rank: int, world: int, seed: int, temperature: float, chunk: int) -> None:
    hidden, weight, target, mask, g_logp, g_ent = make_case(seed)
    where = f"rank {rank}, seed {seed}, T={temperature}, chunk={chunk}"
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
    hidden, weight, target, mask, g_logp, g_ent = make_case(14)
    for real in (60, 40):  # 40: rank 1 holds only padding
        where = f"rank {rank}, vocab {real}"
        tgt = target.clamp(max=real - 1)
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
        assert max_diff(out.entropy, ref[1]) <= TOL, where
        assert max_diff(h.grad, hr.grad) <= TOL, where
        assert max_diff(w.grad, _shard(full_grad_w, rank, world, 0)) <= TOL, where


def _check_tp_bf16(rank: int, world: int) -> None:
    hidden, weight, target, mask, g_logp, g_ent = make_case(15)
    hb, wb = hidden.bfloat16().requires_grad_(), _shard(weight, rank, world, 0).bfloat16().requires_grad_()
    out = vocab_parallel_logprobs_from_hidden(hb, wb, target, 1.0, mask=mask, chunk_tokens=4, group=dist.group.WORLD)
    loss_of(*out, g_logp, g_ent).backward()
    assert out.logprobs.dtype == torch.float32 and wb.grad.dtype == torch.bfloat16
    exact = reference((hidden.bfloat16() @ weight.bfloat16().t()).float(), target, mask, 1.0)
    assert max_diff(out.logprobs, exact[0]) <= TOL and max_diff(out.entropy, exact[1]) <= TOL
    assert max_diff(out.logprobs, reference(hidden @ weight.t(), target, mask, 1.0)[0]) <= 0.1


def _check_tp_top(rank: int, world: int) -> None:
    """The teacher's top-k ids under TP 2, each id on one rank's slice (and a vocabulary of 40: rank 1 only
    padding), equal to the full vocabulary's, and so are the gradients."""
    hidden, weight, target, top, mask, g_logp, g_ent, g_top = top_case(16)
    for real in (96, 40):
        where = f"rank {rank}, top-k, vocab {real}"
        tgt, ids = target.clamp(max=real - 1), top.clamp(max=real - 1)
        h, w = hidden.clone().requires_grad_(), _shard(weight, rank, world, 0).requires_grad_()
        out = vocab_parallel_top_logprobs_from_hidden(
            h, w, tgt, ids, 0.8, mask=mask, chunk_tokens=4, vocab_size=real, group=dist.group.WORLD
        )
        (loss_of(out.logprobs, out.entropy, g_logp, g_ent) + (out.top * g_top).sum()).backward()
        ref = top_reference(hidden, weight[:real], tgt, ids, mask, 0.8, g_logp, g_ent, g_top)
        full_grad_w = torch.cat([ref[4], torch.zeros(weight.shape[0] - real, weight.shape[1])])
        for got, want in zip((out.logprobs, out.entropy, out.top, h.grad), ref[:4], strict=True):
            assert max_diff(got, want) <= TOL, where
        assert max_diff(w.grad, _shard(full_grad_w, rank, world, 0)) <= TOL, where


def test_tensor_parallel_two_ranks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init_file = str(tmp_path / "rendezvous")
    assert not os.path.exists(init_file)
    mp.spawn(_tp_worker, args=(2, init_file), nprocs=2, join=True)
