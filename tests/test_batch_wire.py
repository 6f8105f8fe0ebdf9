"""The step batch's wire form (actor/batch_wire.py) and each DP rank's samples (micro_batches.step_shares),
in-process; the scatter across ranks is tests/mrl_multiproc/scenarios_actor.py's w2_/w4_scattered_batch."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch, build_inputs
from megatron_rl.actor.batch_wire import (
    HEADER_SLOTS,
    LightPacket,
    WireBatch,
    WireFormatError,
    expert_wire_dtype,
    field_buffers,
    pack_light,
    pack_routed,
    routed_buffer,
    routed_layout,
    unpack_light,
    unpack_routed,
)
from megatron_rl.actor.micro_batches import MicroBatch, balance_across_ranks, mini_batches, step_shares

LENGTHS = (9, 4, 12, 6, 7)
PROMPTS = (3, 2, 5, 1, 4)
LAYERS, TOP_K = 3, 2


def make_wire(num_experts: int = 8, *, per_token_adv: bool = False, seed: int = 0) -> WireBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 50_000, (n,), generator=gen) for n in LENGTHS]
    resp = [n - p for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    adv = [torch.randn((r,) if per_token_adv else (), generator=gen) for r in resp]
    routed = [
        torch.rand(n - 1, LAYERS, num_experts, generator=gen).argsort(-1)[..., :TOP_K].to(torch.int32) for n in LENGTHS
    ]
    batch = ActorBatch(
        tokens=tokens,
        prompt_lengths=list(PROMPTS),
        response_mask=[torch.rand(r, generator=gen) > 0.3 for r in resp],
        advantages=adv,
        rollout_log_probs=[-torch.rand(r, generator=gen) for r in resp],
        routed_experts=routed,
    )
    versions = [[3] * (r - 1) + [4] for r in resp]
    episodes = torch.arange(len(LENGTHS), dtype=torch.int64) // 2  # two sequences per episode (agent segments)
    return WireBatch(batch, torch.randn(len(LENGTHS), generator=gen), versions, episodes)


def through_the_wire(wire: WireBatch, num_experts: int) -> tuple[LightPacket, WireBatch]:
    """What a receiver rebuilds: buffers from the header and the index alone, the values copied in."""
    sent = pack_light(wire, num_experts=num_experts)
    buffers = field_buffers(sent.header.clone(), sent.index.clone())
    assert [(b.dtype, b.shape) for b in buffers] == [(f.dtype, f.shape) for f in sent.fields]
    for b, f in zip(buffers, sent.fields, strict=True):
        b.copy_(f)
    return sent, unpack_light(LightPacket(sent.header.clone(), sent.index.clone(), buffers))


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_every_field_comes_back_bit_for_bit_in_its_dtype(per_token_adv: bool) -> None:
    wire = make_wire(per_token_adv=per_token_adv)
    sent, got = through_the_wire(wire, 8)
    assert got.batch.prompt_lengths == list(PROMPTS) and got.batch.lengths == list(LENGTHS)
    for name in ("tokens", "response_mask", "advantages", "rollout_log_probs"):
        assert_same(getattr(got.batch, name), getattr(wire.batch, name))
    assert got.batch.tokens[0].dtype == torch.int64 and got.batch.response_mask[0].dtype == torch.bool
    assert got.batch.old_log_probs is None and got.batch.ref_log_probs is None
    assert torch.equal(got.rewards, wire.rewards) and got.versions == wire.versions
    assert got.episodes.dtype == torch.int64 and torch.equal(got.episodes, wire.episodes)
    assert got.batch.routed_experts is None  # routing travels in per-rank shards
    # the fixed-size header, and the light part's bytes: tokens as int32, masks as uint8
    assert sent.header.shape == (HEADER_SLOTS,)
    tokens, responses = sum(LENGTHS), sum(n - p for n, p in zip(LENGTHS, PROMPTS, strict=True))
    adv = 4 * (responses if per_token_adv else len(LENGTHS))
    fields = 4 * tokens + responses + adv + 4 * responses + 4 * len(LENGTHS) + 8 * responses + 8 * len(LENGTHS)
    assert sent.nbytes == 8 * HEADER_SLOTS + 8 * 3 * len(LENGTHS) + fields


def test_the_teacher_top_k_comes_back_as_rows_of_k() -> None:
    """distill.mode = forward_topk: the teacher's top-k ids (int32 on the wire) and log-probs, [r_i, K] per
    sample, K in the header: a receiver rebuilds them from the header and the index alone."""
    wire = make_wire()
    gen = torch.Generator().manual_seed(5)
    resp = [n - p for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    ids = [torch.randint(0, 50_000, (r, 3), generator=gen, dtype=torch.int32) for r in resp]
    values = [-torch.rand(r, 3, generator=gen) for r in resp]
    topped = WireBatch(wire.batch.with_fields(teacher_top_ids=ids, teacher_top_logprobs=values), wire.rewards)
    sent, got = through_the_wire(topped, 8)
    assert_same(got.batch.teacher_top_ids, ids)
    assert_same(got.batch.teacher_top_logprobs, values)
    assert int(sent.header[7]) == 3
    _, plain = through_the_wire(wire, 8)
    assert plain.batch.teacher_top_ids is None and plain.batch.teacher_top_logprobs is None
    bad = WireBatch(topped.batch.with_fields(teacher_top_ids=[ids[0][:, :2], *ids[1:]]))
    with pytest.raises(WireFormatError, match=r"teacher_top_ids\[1\] has shape \(2, 3\), expected \(2, 2\)"):
        pack_light(bad, num_experts=8)


def test_without_optional_fields() -> None:
    wire = make_wire()
    bare = WireBatch(ActorBatch(tokens=wire.batch.tokens, prompt_lengths=list(PROMPTS)))
    _, got = through_the_wire(bare, 8)
    assert_same(got.batch.tokens, wire.batch.tokens)
    assert got.batch.response_mask is None and got.batch.advantages is None
    assert (
        got.rewards is None
        and got.versions is None
        and got.episodes is None
        and routed_layout(pack_light(bare, num_experts=None).header) is None
    )


@pytest.mark.parametrize(
    ("experts", "dtype"), [(8, torch.uint8), (256, torch.uint8), (300, torch.int16), (40_000, torch.int32)]
)
def test_routed_experts_narrowed_to_what_the_expert_count_allows(experts: int, dtype: torch.dtype) -> None:
    assert expert_wire_dtype(experts) == dtype
    wire = make_wire(experts)
    layout = routed_layout(pack_light(wire, num_experts=experts).header)
    assert layout is not None and (layout.layers, layout.top_k, layout.dtype) == (LAYERS, TOP_K, dtype)
    mine = [1, 2, 4]
    flat = pack_routed(wire.batch.routed_experts, mine, layout)
    assert flat.dtype == dtype and flat.numel() == sum(LENGTHS[i] - 1 for i in mine) * LAYERS * TOP_K
    assert layout.nbytes(list(LENGTHS), mine) == flat.numel() * dtype.itemsize
    buffer = routed_buffer(list(LENGTHS), mine, layout)
    buffer.copy_(flat)
    got = unpack_routed(buffer, list(LENGTHS), mine, layout, len(LENGTHS))
    assert [g is not None for g in got] == [False, True, True, False, True]
    for i in mine:
        assert got[i].dtype == dtype and torch.equal(got[i].to(torch.int32), wire.batch.routed_experts[i])
        assert got[i].data_ptr() >= buffer.data_ptr()  # views of the received buffer, no copy


def test_wire_refusals_name_the_problem() -> None:
    wire = make_wire(300)
    layout = routed_layout(pack_light(wire, num_experts=200).header)  # says uint8, the ids reach 299
    with pytest.raises(WireFormatError, match=r"outside torch.uint8's \[0, 255\]"):
        pack_routed(wire.batch.routed_experts, range(len(LENGTHS)), layout)
    mixed = make_wire()
    mixed.batch.advantages[0] = torch.zeros(LENGTHS[0] - PROMPTS[0])
    with pytest.raises(WireFormatError, match="mixes 0-dim and per-token"):
        pack_light(mixed, num_experts=8)
    sent = pack_light(make_wire(), num_experts=8)
    bad = sent.header.clone()
    bad[0] = 7
    with pytest.raises(WireFormatError, match="not a batch header"):
        field_buffers(bad, sent.index)
    with pytest.raises(WireFormatError, match="fields, 1 came"):
        unpack_light(LightPacket(sent.header, sent.index, sent.fields[:1]))


def test_step_shares_are_each_mini_batches_balanced_split() -> None:
    lengths = [31, 5, 17, 22, 9, 40, 12, 8, 26, 3, 19, 14]
    for dp, updates in ((2, 1), (2, 3), (3, 2), (4, 3)):
        shares = step_shares(lengths, updates, dp)
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))  # disjoint, covering
        for run in mini_batches(len(lengths), updates, dp):
            split = balance_across_ranks([lengths[i] for i in run], dp)
            for share, part in zip(shares, split, strict=True):
                assert sorted(set(share) & set(run)) == sorted(run[j] for j in part)
    assert step_shares(lengths, 1, 3) == balance_across_ranks(lengths, 3)
    # a DP rank's share of the step is about 1/DP of the tokens: 69, 67 and 70 of 206
    assert [sum(lengths[i] for i in s) for s in step_shares(lengths, 2, 3)] == [69, 67, 70]


def test_a_batch_with_other_ranks_routing_absent() -> None:
    wire = make_wire()
    routed = [r if i in (0, 3) else None for i, r in enumerate(wire.batch.routed_experts)]
    batch = wire.batch.with_fields(routed_experts=routed)
    batch.validate(vocab_size=50_000, num_layers=LAYERS, top_k=TOP_K, num_experts=8)
    inputs = build_inputs(batch, MicroBatch((0, 3), (LENGTHS[0], LENGTHS[3])), torch.device("cpu"))
    assert [torch.equal(a, b) for a, b in zip(inputs.routed_experts, [routed[0], routed[3]], strict=True)] == [
        True,
        True,
    ]
    with pytest.raises(ValueError, match=r"samples \[1\] are not on this rank"):
        build_inputs(batch, MicroBatch((0, 1), (LENGTHS[0], LENGTHS[1])), torch.device("cpu"))
