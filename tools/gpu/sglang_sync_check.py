"""One real SGLang server on this machine's GPU, one weight sync in each mode against it; one JSON line.

    python tools/gpu/sglang_sync_check.py [--sglang-python PY] [--timeout 900]

Starts `sglang.launch_server` (from `--sglang-python`, default this interpreter) on GPU 0 with a tiny
random Qwen3-MoE, then runs the product's own trainer path once per mode, each in a process of its
own (a Megatron actor of world size 1, `make_weight_sync`, `sync`): `tensor` (colocated on the same
GPU: CUDA-IPC payloads through SGLang's `SafeUnpickler`, inside the weight-update session, after a
memory release), `disk`, and `distributed` (a trainer on one GPU cannot share a NCCL group with an
engine on the same GPU, so this trainer runs on the CPU and the group uses gloo: SGLang's session,
announcement and flattened-bucket receive are the same). After each sync it compares the engine's
`model.norm.weight` (`/get_weights_by_name`) and weight version with the actor's.
The tensor mode trains in bf16 (the GPU dtype) and also reports the log-prob gap of the engine's own
samples to the actor's right after the sync (`logprob_gap_abs_mean`, what `rollout.max_logprob_gap`
bounds) beside the bf16 default bound.

When SGLang or a GPU is not there it says so in the JSON line (`"skipped"`) and exits 0; a failed
mode exits 1. Nothing here is a test stand-in: the server is SGLang's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from megatron_rl.parallel.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
MODES = ("tensor", "disk", "distributed")


def _skip(reason: str) -> int:
    print(json.dumps({"check": "sglang_sync", "ok": None, "skipped": reason}))
    return 0


def _sglang_status(python: str) -> str | None:
    """None when `python` imports sglang, else why not."""
    probe = [python, "-c", "import sglang, sglang.srt.entrypoints.http_server; print(sglang.__version__)"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{python} cannot run: {err}"
    if done.returncode != 0:
        return f"{python} cannot import sglang: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def _tiny_model(folder: Path) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)


def _get(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        body = reply.read()
    return json.loads(body) if body.strip() else None


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang exited with {proc.returncode} before serving:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"sglang did not answer /health within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", sys.executable))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the server to start")
    parser.add_argument("--trainer", choices=MODES, help=argparse.SUPPRESS)  # internal: one mode's trainer
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer:
        print(json.dumps(_trainer(args.trainer, args.url, args.model, Path(args.workdir))))
        return 0

    import torch

    if not torch.cuda.is_available():
        return _skip("no CUDA device")
    if importlib.util.find_spec("megatron") is None:
        return _skip("megatron-core is not installed in this interpreter")
    why = _sglang_status(args.sglang_python)
    if why is not None:
        return _skip(f"SGLang cannot be brought here: {why}")
    version = subprocess.run(
        [args.sglang_python, "-c", "import sglang; print(sglang.__version__)"], capture_output=True, text=True
    ).stdout.strip()

    work = Path(tempfile.mkdtemp(prefix="sglang-sync-check-"))
    model = work / "model"
    _tiny_model(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "sglang.log"
    server_cmd = [
        args.sglang_python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--skip-tokenizer-init", "--mem-fraction-static", "0.3", "--enable-memory-saver",
        "--disable-cuda-graph", "--tp-size", "1", "--base-gpu-id", "0",
    ]  # fmt: skip
    env = {**os.environ, "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    results: dict[str, Any] = {}
    with open(log, "w") as out:
        server = subprocess.Popen(server_cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        started = time.monotonic()
        _wait_healthy(url, server, args.timeout, log)
        results["server_start_s"] = round(time.monotonic() - started, 1)
        for mode in MODES:
            trainer_env = {**env, "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")}
            if mode == "distributed":
                trainer_env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU (see the module docstring)
            cmd = [sys.executable, __file__, "--trainer", mode, "--url", url, "--model", str(model)]
            cmd += ["--workdir", str(work / mode)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env, timeout=1200)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode == 0 and lines:
                results[mode] = json.loads(lines[-1])
            else:
                results[mode] = {"ok": False, "rc": done.returncode, "error": done.stderr.strip()[-2000:]}
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        results["error"] = str(err)[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    ok = all(isinstance(results.get(m), dict) and results[m].get("ok") for m in MODES)
    print(json.dumps({"check": "sglang_sync", "sglang": version, "ok": ok, **results, "log": str(log)}))
    return 0 if ok else 1


def _trainer(mode: str, url: str, model: str, workdir: Path) -> dict[str, Any]:
    """One mode: a world-size-1 actor from `model`, its weights moved, one sync, the engine checked."""
    import torch

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.config import Config, LoggingConfig, RolloutConfig, TrainConfig, validate
    from megatron_rl.models.export import export_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.event_loop import RolloutLoop
    from megatron_rl.weight_sync import make_weight_sync

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    model_cfg = model_config_from_hf(read_hf_config(model), hf_path=model)
    if mode == "tensor" and torch.cuda.is_available():  # the GPU training dtype: the gap below is bf16's
        model_cfg = dataclasses.replace(model_cfg, params_dtype="bf16")
    cfg = Config(
        model=model_cfg,
        rollout=RolloutConfig(
            engine="sglang",
            sglang_urls=[url],
            weight_sync=mode,
            colocate=mode == "tensor",
            request_timeout_s=300.0,
            sync_dir=str(workdir / "weights"),
            bucket_mb=1,
        ),
        train=TrainConfig(steps=1),
        logging=LoggingConfig(run_dir=str(workdir)),
    )
    validate(cfg)
    actor = MegatronActor(
        cfg, initializer=lambda chunks: load_hf_weights(chunks, cfg.model, open_hf_checkpoint(model, cfg.model))
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for chunk in actor.chunks:
            for param in chunk.parameters():
                param.add_((0.05 * torch.randn(param.shape, generator=gen)).to(param.device, param.dtype))
    engine = RolloutEngine.from_config(cfg.rollout, RolloutLoop(), model)
    started = time.perf_counter()
    with make_weight_sync(cfg, engine, actor) as sync:
        if mode == "tensor":
            sync.release_engine_memory()  # the colocated step: released, then resumed by the sync
        report = sync.sync(f"check-{mode}")
    seconds = time.perf_counter() - started
    want = next(t for b in export_hf_weights(actor.chunks, cfg.model) for n, t in b if n == "model.norm.weight")
    got = engine.run(engine.client.get_weights_by_name("model.norm.weight", truncate_size=want.numel()), timeout=60)
    got = torch.tensor(got, dtype=torch.float32).flatten()
    diff = float((got - want.float().cpu().flatten()[: got.numel()]).abs().max())
    info = _get(url + "/model_info")
    gap = _logprob_gap(engine, actor, cfg) if mode == "tensor" else {}
    engine.close()
    engine.loop.close()
    actor.close()
    ok = info.get("weight_version") == f"check-{mode}" and diff < 2e-2  # the engine holds bf16
    return {
        **gap,
        "ok": ok,
        "mode": mode,
        "bytes": report.bytes,
        "sync_s": round(report.seconds, 3),
        "total_s": round(seconds, 3),
        "weight_version": info.get("weight_version"),
        "norm_max_abs_diff": diff,
        "trainer_device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def _logprob_gap(engine: Any, actor: Any, cfg: Any) -> dict[str, Any]:
    """The engine's log-probs of its own samples against the actor's right after a sync (what
    `rollout.max_logprob_gap` bounds), with the default bound of the actor's dtype."""
    import torch

    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.config import logprob_gap_limit
    from megatron_rl.rollout.types import SamplingParams

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, cfg.model.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 13, 17)]
    samples = engine.run(engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)))
    batch = ActorBatch(
        tokens=[torch.tensor(s.prompt_ids + s.output_ids) for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
    )
    ours = actor.compute_log_probs(batch).log_probs
    gaps = torch.cat([(lp.float().cpu() - torch.tensor(s.logprobs)).abs() for lp, s in zip(ours, samples, strict=True)])
    limit = logprob_gap_limit(cfg)
    return {
        "logprob_gap_abs_mean": float(gaps.mean()),
        "logprob_gap_abs_max": float(gaps.max()),
        "logprob_gap_dtype": cfg.model.params_dtype,
        "max_logprob_gap_default": limit,
        "logprob_gap_within_default": limit is None or float(gaps.mean()) <= limit,
    }


if __name__ == "__main__":
    sys.exit(main())
