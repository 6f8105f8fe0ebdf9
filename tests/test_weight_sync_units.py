"""Weight-sync pieces without Megatron or an engine: bucket packing, the flattened-broadcast test,
look-ahead, and the rendezvous helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.launch import free_port
from megatron_rl.rollout import wire
from megatron_rl.weight_sync import send
from megatron_rl.weight_sync.packing import ALIGN, PackBuffers, broadcasts_flat, pack_bucket, with_last
from megatron_rl.weight_sync.rendezvous import in_daemon_thread, reachable_address
from megatron_rl.weight_sync.tensor import payload_devices, rank_payloads

REPO = Path(__file__).resolve().parents[1]


def test_with_last_looks_one_item_ahead() -> None:
    assert list(with_last([])) == []
    assert list(with_last(["a"])) == [("a", True)]
    assert list(with_last("abc")) == [("a", False), ("b", False), ("c", True)]
    pulled = []

    def source():
        for i in range(3):
            pulled.append(i)
            yield i

    stream = with_last(source())
    assert next(stream) == (0, False) and pulled == [0, 1]  # item 0 is known not to be last once 1 exists


def test_packing_aligns_mixed_dtypes_and_round_trips_through_shared_memory() -> None:
    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("a", torch.randn(3, generator=gen)),  # 12 bytes at 0
        ("b", torch.randn(5, generator=gen).to(torch.bfloat16)),  # 10 bytes at 16
        ("c", torch.randn(2, 2, generator=gen)),  # 16 bytes at 32
        ("d", torch.randn(4, 3, generator=gen).t()),  # a non-contiguous view: 48 bytes at 48
    ]
    flat, meta = pack_bucket(bucket)
    assert ALIGN == 16
    assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in meta] == [
        ("a", 0, 12, 12),
        ("b", 16, 26, 10),
        ("c", 32, 48, 16),
        ("d", 48, 96, 48),
    ]
    assert flat.dtype == torch.uint8 and flat.numel() == 96 and flat.is_shared()
    received = wire.deserialize_named_tensors(
        *send.serialize_named_tensors({"flattened_tensor": flat, "metadata": meta})
    )
    got = wire.unflatten_tensors(received["flattened_tensor"], list(received["metadata"]))
    for (name, want), (got_name, value) in zip(bucket, got, strict=True):
        assert got_name == name and value.dtype == want.dtype and torch.equal(value, want), name

    # every bucket gets a buffer of its own: SGLang replies before its copies finish, so the next
    # bucket must not write where the engine may still be reading
    again, _ = pack_bucket(bucket[:2])
    assert again.data_ptr() != flat.data_ptr() and again.numel() == 26 and again.is_shared()
    assert torch.equal(flat[:12], again[:12])  # the first bucket's bytes are untouched by the second
    with pytest.raises(ValueError, match="empty bucket"):
        pack_bucket([])


def test_host_pack_buffer_is_reused_and_grown() -> None:
    # on the CPU the engine has read a bucket when it answers, so the next bucket may reuse the buffer
    buffers = PackBuffers()
    first = [("a", torch.arange(8.0)), ("b", torch.full((3,), 2.0))]  # 32 bytes, then 12 at 32
    flat, meta = pack_bucket(first, buffers)
    assert flat.numel() == 44 and flat.is_shared() and meta[1].start_idx == 32
    smaller, _ = pack_bucket([("c", torch.full((2,), 7.0))], buffers)
    assert smaller.data_ptr() == flat.data_ptr() and smaller.numel() == 8 and smaller.is_shared()
    assert torch.equal(smaller.view(torch.float32), torch.full((2,), 7.0))
    got = wire.deserialize_named_tensors(*send.serialize_named_tensors({"flattened_tensor": smaller, "metadata": []}))
    assert got["flattened_tensor"].numel() == 8  # the view travels, not the whole buffer
    larger, meta = pack_bucket([("d", torch.arange(20.0))], buffers)
    assert larger.numel() == 80 and larger.is_shared()
    assert torch.equal(wire.unflatten_tensors(larger, meta)[0][1], torch.arange(20.0))


def test_one_serialisation_per_engine_rank() -> None:
    bucket = [("a", torch.arange(6.0)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    devices = payload_devices(torch.device("cpu"), servers=2, engine_gpus=2)
    assert devices == [[torch.device("cpu")] * 2] * 2
    payloads, shm_names = rank_payloads(bucket, devices)
    assert [len(row) for row in payloads] == [2, 2] and len(shm_names) == 1  # one shared buffer serves all
    for payload in (p for row in payloads for p in row):
        got = wire.deserialize_named_tensors(payload, shm_names)
        named = wire.unflatten_tensors(got["flattened_tensor"], list(got["metadata"]))
        assert [n for n, _ in named] == ["a", "b"] and torch.equal(named[0][1], bucket[0][1])


def test_flattened_broadcast_needs_natural_alignment() -> None:
    fp32, bf16 = torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)
    assert broadcasts_flat([("a", fp32), ("b", torch.zeros(2, 2))])
    assert broadcasts_flat([("a", fp32), ("b", bf16)])  # bf16 at byte 12: aligned to 2
    assert not broadcasts_flat([("a", bf16), ("b", fp32)])  # fp32 at byte 6: not aligned to 4


def test_rendezvous_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert reachable_address("http://127.0.0.1:30000") == "127.0.0.1"
    assert 0 < free_port() < 65536
    done = in_daemon_thread(lambda x: (x * 2, threading.current_thread().daemon), 21)
    assert done.result(timeout=10) == (42, True)

    def boom() -> None:
        raise OSError("rendezvous failed")

    with pytest.raises(OSError, match="rendezvous failed"):
        in_daemon_thread(boom).result(timeout=10)

    # under torchrun (agent store switched on) the trainer's rank 0 must still host the group's store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    group = wire.init_weights_update_group("127.0.0.1", free_port(), 0, 1, "agent-store-check", "gloo", 20.0)
    assert group.size() == 1
    wire.destroy_weights_update_group(group)


@pytest.mark.gpu
def test_cuda_payload_names_the_device_by_uuid_and_rebuilds_on_it() -> None:
    import base64

    bucket = [("a", torch.arange(6.0, device="cuda")), ("b", torch.ones(3, dtype=torch.bfloat16, device="cuda"))]
    (row,), shm_names = rank_payloads(bucket, payload_devices(torch.device("cuda", 0), servers=1, engine_gpus=1))
    assert shm_names == []  # CUDA IPC handles, no shared-memory file
    (payload,) = row
    assert wire.cuda_device_uuid(0).encode() in base64.b64decode(payload)  # SGLang's patch_torch form
    # CUDA IPC opens a handle only in another process (the engine's), never in the one that made it
    rebuild = (
        "import json, sys; from megatron_rl.rollout import wire; got = wire.deserialize_named_tensors(sys.stdin.read());"
        "named = wire.unflatten_tensors(got['flattened_tensor'], list(got['metadata']));"
        "print(json.dumps([str(got['flattened_tensor'].device), {n: t.float().tolist() for n, t in named}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", rebuild], input=payload, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    device, values = json.loads(proc.stdout.strip().splitlines()[-1])
    assert device == "cuda:0" and values == {"a": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "b": [1.0, 1.0, 1.0]}
    assert wire.cuda_device_index(wire.cuda_device_uuid(0)) == 0 and wire.cuda_device_index(0) == 0
    with pytest.raises(Exception, match="no visible GPU has this UUID"):
        wire.cuda_device_index("GPU-00000000-0000-0000-0000-000000000000")


@pytest.mark.gpu
def test_payload_devices_refuse_engine_gpus_rank0_cannot_see() -> None:
    from megatron_rl.weight_sync.base import WeightSyncError

    visible = torch.cuda.device_count()
    assert payload_devices(torch.device("cuda", 0), 1, visible)[0] == [torch.device("cuda", k) for k in range(visible)]
    with pytest.raises(WeightSyncError, match=rf"this export sender sees {visible} GPU\(s\)"):
        payload_devices(torch.device("cuda", 0), 1, visible + 1)


@pytest.mark.gpu
def test_optimizer_offload_round_trip_keeps_the_state() -> None:
    from megatron_rl.weight_sync.memory import OptimizerOffload

    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[model.weight].items() if v.dim() > 0}
    offload = OptimizerOffload(optimizer)
    assert offload.to_host() == 2 * 64 * 65 * 4  # exp_avg and exp_avg_sq of weight (64x64) and bias (64), fp32
    assert optimizer.state[model.weight]["exp_avg"].device.type == "cpu" and offload.offloaded
    offload.to_device()
    after = optimizer.state[model.weight]
    assert all(after[k].device.type == "cuda" and torch.equal(after[k], v) for k, v in before.items())
    assert not offload.offloaded


def test_in_place_targets_only_when_every_tensor_fits() -> None:
    from megatron_rl.rollout.local.weights import CheckpointLayout

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    layout = CheckpointLayout(model, "qwen3_moe")
    cpu, fp32 = torch.device("cpu"), torch.float32
    views = layout.in_place_targets(["0.weight", "1.weight"], [fp32, fp32], [[3, 4], [2, 3]], cpu)
    assert views is not None and [v.data_ptr() for v in views] == [
        model[0].weight.data_ptr(),
        model[1].weight.data_ptr(),
    ]
    views[1].copy_(torch.full((2, 3), 5.0))  # a receive into the view lands in the parameter
    assert torch.equal(model[1].weight.detach(), torch.full((2, 3), 5.0))
    # any tensor that needs a conversion or fails validation sends the whole request the copying way
    assert layout.in_place_targets(["0.weight", "1.weight"], [fp32, torch.bfloat16], [[3, 4], [2, 3]], cpu) is None
    assert layout.in_place_targets(["0.weight", "2.weight"], [fp32, fp32], [[3, 4], [2, 3]], cpu) is None
    assert layout.in_place_targets(["0.weight"], [fp32], [[4, 3]], cpu) is None


def test_in_flight_policy_by_loop_mode() -> None:
    from megatron_rl.config import RolloutConfig
    from megatron_rl.weight_sync.base import InFlight

    def policy(pauses: bool, session: bool = False, **keys: object) -> InFlight:
        return InFlight.from_config(RolloutConfig(**keys), pauses_for_transfer=pauses, in_session=session)

    for mode in ("sync", "one_step_off"):  # nothing in flight: today's behaviour, whatever partial_rollout says
        for partial in (True, False):
            assert policy(False, async_mode=mode, partial_rollout=partial) == InFlight(None, False)
            assert policy(True, async_mode=mode, partial_rollout=partial) == InFlight("abort", False)
    for pauses in (False, True):
        assert policy(pauses, async_mode="fully_async", partial_rollout=True) == InFlight("retract", False)
    assert policy(False, async_mode="fully_async", partial_rollout=False) == InFlight(None, True)  # disk
    assert policy(True, async_mode="fully_async", partial_rollout=False) == InFlight("abort", True)
    # distributed: a session's begin on a server that is not paused waits for every running generation
    assert policy(False, True, async_mode="fully_async", partial_rollout=False) == InFlight("abort", True)
    assert policy(False, True, async_mode="one_step_off") == InFlight(None, False)


# ---- bucket k + 1 gathered while bucket k is sent (weight_sync/prefetch.py) ----
def test_prefetched_runs_one_bucket_ahead_in_order() -> None:
    import threading

    from megatron_rl.weight_sync.prefetch import prefetched

    produced: list[int] = []
    ahead = threading.Event()

    def buckets():
        for k in range(5):
            produced.append(k)
            if k == 1:
                ahead.set()  # bucket 1 exists while the consumer still holds bucket 0
            yield k

    got = []
    for k in prefetched(buckets()):
        if k == 0:
            assert ahead.wait(timeout=10), "bucket 1 was not produced while bucket 0 was being sent"
        got.append(k)
    assert got == [0, 1, 2, 3, 4] and produced == got


def test_prefetched_raises_where_the_export_failed_and_drains_after_an_early_stop() -> None:
    from megatron_rl.weight_sync.prefetch import prefetched

    def failing():
        yield 0
        yield 1
        raise RuntimeError("gather failed at bucket 2")

    got = []
    with pytest.raises(RuntimeError, match="at bucket 2"):
        for k in prefetched(failing()):
            got.append(k)
    assert got == [0, 1]
    walked: list[int] = []

    def counted():
        for k in range(6):
            walked.append(k)  # the collectives of every bucket run, also after the consumer stopped
            yield k

    stream = prefetched(counted(), depth=1)
    assert next(stream) == 0
    stream.close()
    assert walked == list(range(6))
    with pytest.raises(ValueError, match="depth must be >= 1"):
        next(prefetched(iter([1]), depth=0))


def test_senders_one_per_stage_and_ep_rank_with_rank0_first() -> None:
    from megatron_rl.weight_sync.senders import Sender, check_senders

    # PP2 x EP2 on 8 ranks: stage 0's EP ranks on ranks 0 and 2, stage 1's on 4 and 6
    roles = [(0, 0, "a"), None, (0, 1, "a"), None, (1, 0, "b"), None, (1, 1, "b"), None]
    assert check_senders(roles, stages=2) == [
        Sender(0, 0, 0, "a"),
        Sender(2, 0, 1, "a"),
        Sender(4, 1, 0, "b"),
        Sender(6, 1, 1, "b"),
    ]
    with pytest.raises(RuntimeError, match=r"stage 0, EP rank 1 has two export senders, ranks 2 and 3"):
        check_senders([(0, 0, "a"), None, (0, 1, "a"), (0, 1, "a")], stages=1)
    with pytest.raises(RuntimeError, match="every stage of 2"):
        check_senders([(0, 0, "a"), (0, 1, "a")], stages=2)
    with pytest.raises(RuntimeError, match="global rank 0 sending for stage 0"):
        check_senders([None, (0, 0, "a")], stages=1)


def test_tensor_mode_refuses_a_sender_off_the_engines_machine() -> None:
    from megatron_rl.weight_sync.senders import Sender
    from megatron_rl.weight_sync.tensor import off_engine_host

    assert off_engine_host([Sender(0, 0, 0, "n1"), Sender(1, 1, 0, "n1")]) is None
    problem = off_engine_host([Sender(0, 0, 0, "n1"), Sender(8, 1, 0, "n2")])
    assert problem is not None and "stage 1, EP rank 0 is global rank 8 on 'n2'" in problem
    assert "rollout.weight_sync=distributed or disk" in problem


def test_safetensors_overwritten_in_place_only_at_the_same_size(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import builtins
    import os

    from megatron_rl.models import safetensors_io
    from megatron_rl.models.hf_io import finalize_hf_folder
    from megatron_rl.models.safetensors_io import MappedSafetensors, write_safetensors

    modes: list[str] = []

    def recording_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        modes.append(mode)
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(safetensors_io, "open", recording_open, raising=False)
    path = tmp_path / "part-pp000-00000.safetensors"
    write_safetensors(path, {"a": torch.zeros(4, 3), "b": torch.ones(5)}, in_place=True)  # nothing there yet
    size = os.path.getsize(path)
    write_safetensors(path, {"a": torch.full((4, 3), 2.0), "b": torch.arange(5.0)}, in_place=True)
    write_safetensors(path, {"a": torch.full((4, 3), 3.0), "b": torch.arange(5.0)})  # not asked: truncated
    assert modes == ["wb", "r+b", "wb"] and os.path.getsize(path) == size
    write_safetensors(path, {"a": torch.full((4, 3), 2.0), "b": torch.arange(5.0)}, in_place=True)
    got = MappedSafetensors(path)
    assert torch.equal(got.get("a"), torch.full((4, 3), 2.0)) and torch.equal(got.get("b"), torch.arange(5.0))
    write_safetensors(path, {"a": torch.ones(2, 3)}, in_place=True)  # another size: written anew
    assert modes[-1] == "wb" and torch.equal(MappedSafetensors(path).get("a"), torch.ones(2, 3))
    (tmp_path / "part-pp001-00000.safetensors").write_bytes(b"stale")  # an earlier layout's file
    final = finalize_hf_folder(tmp_path, [(path.name, ["a"], 24)], rename=False)
    assert final == [path.name] and sorted(p.name for p in tmp_path.glob("*.safetensors")) == [path.name]
    assert '"a": "part-pp000-00000.safetensors"' in (tmp_path / "model.safetensors.index.json").read_text()


def test_engine_turns_come_one_at_a_time_first_come_first_served(world_of_one: None) -> None:
    """Senders (threads here) hold the turn one at a time, in the order they asked for it; a turn that
    does not come within the wait names its holder; the next round is a fresh chain."""
    import time

    from megatron_rl.weight_sync.turns import EngineTurns, TurnTimeout

    turns = EngineTurns(wait_s=60)
    turns.new_round()
    held: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def sender(name: str) -> None:
        with turns.turn(name):
            held.append(f"{name} in")
            if name == "A":
                holding.set()
                release.wait(60)
            held.append(f"{name} out")

    threads = [threading.Thread(target=sender, args=("A",))]
    threads[0].start()
    assert holding.wait(60)
    for asked, name in enumerate("BC", start=2):
        threads.append(threading.Thread(target=sender, args=(name,)))
        threads[-1].start()
        deadline = time.monotonic() + 60
        while turns.store.add(f"{turns.round}/tickets", 0) < asked:  # its ticket drawn: it waits in line
            assert time.monotonic() < deadline, f"{name} drew no ticket"
            time.sleep(0.01)
    release.set()
    for thread in threads:
        thread.join(60)
    assert held == ["A in", "A out", "B in", "B out", "C in", "C out"]

    quick = EngineTurns(wait_s=1)
    quick.new_round()
    with quick.turn("the sender of stage 0"):
        with pytest.raises(TurnTimeout, match=r"^stage 1 waited 1 s for its turn .*; the sender of stage 0 held it$"):
            with quick.turn("stage 1"):
                pass
    quick.new_round()  # the broken chain is left behind
    with quick.turn("stage 1"):
        pass
