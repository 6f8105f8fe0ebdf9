"""The one-shot GPU check (run through tools/gpu_check.sh): every GPU path once, one JSON summary.

First the probe, in this process (a second or two, on any machine): torch's and CUDA's versions, the devices,
whether `torch._grouped_mm` exists, the parameters of `torch.nn.attention.varlen.varlen_attn` (its signature
changed between torch 2.10 and 2.12), the SDPA backends torch enables and, on CUDA, whether flash attention is
built in; whether Transformer Engine, Apex and SGLang import.

Then the steps, in order, each a child process with its own time limit inside one overall budget (--budget-s,
default 480 s: 8 minutes on one H100 / H200); each records status ok, failed or skipped
with the reason, its seconds, the figures it printed (the benchmarks' JSON lines) and, when it
failed, the tail of its output:

- gpu_tests: the `gpu`-marked tests (pytest -m gpu) but the context-parallel one, with
  passed/failed/skipped counts.
- context_parallel: the actor under CP = 2 against CP = 1 (tests/test_actor_gpu.py::
  test_actor_context_parallel, bf16): log-probs of padded and packed micro-batches, R2 replay, the
  loss and gradient norm of a padded and a packed update; needs two GPUs (skipped, saying so, on one).
- te_vs_local: Transformer Engine specs against Megatron's local specs on the same weights
  (`init_deterministic`): the actor's log-probs and entropy of one batch, fp32, max abs difference.
- fast_vs_local_1b: the ~1B Qwen3-MoE preset's bf16 train step on the local specs' slow path (experts one after
  another, Megatron's local attention) against the fast path (grouped experts, SDPA / varlen attention), in one
  process on the same weights and batch (tools/bench/train_step.py --fast-path --profile): loss and gradient-norm
  difference, tokens/s, MFU, and per path the 10 kernels of the most GPU time and the GPU-busy share.
- experts: one MoE layer's experts at the 1b widths, loop against grouped GEMMs, bf16: rows/s, peak memory
  (tools/bench/experts.py).
- attention: one layer's core attention, local against SDPA (padded) and varlen (packed), bf16, at 2,048 and
  8,192 tokens: tokens/s, peak memory (tools/bench/attention.py).
- logprobs_32k, logprobs_64k: the actor's log-prob path on the fast path (SDPA, the default with CUDA) at
  V = 151,936 and T = 32,768 / 65,536 against the naive full-vocabulary path: peak memory
  (tools/bench/logprobs.py --device cuda).
- train_step_1b: bf16 train-step tokens/s and MFU of the ~1B Qwen3-MoE preset (tools/bench/train_step.py).
- train_step_mixed: the same preset on 32 samples of 32..1024 response tokens, packed micro-batches
  (`train.micro_batch_tokens`) against right-padded ones: seconds per update, peak memory, and the
  loss and gradient norm of both (tools/bench/train_step.py --lengths mixed).
- weight_sync: tensor-mode (CUDA IPC) weight sync into the local engine on the same GPU, GB/s and
  the ratio to a device memcpy (tools/bench/weight_sync.py).
- sglang_sync: tools/gpu/sglang_sync_check.py when it exists (skipped, saying so, when it does not);
  its tensor mode also reports the bf16 engine's log-prob gap to the bf16 actor right after the sync
  (`logprob_gap_abs_mean`, against `rollout.max_logprob_gap`'s bf16 default).

Without CUDA every step that needs it is skipped with that reason, so the script runs anywhere and
its summary is the same shape; --dry-run skips every step (the plan only).

    bash tools/gpu_check.sh [--budget-s 480] [--only gpu_tests,te_vs_local] [--dry-run]

The summary (one JSON object; docs/benchmarks.md, "One-shot GPU check"): gpu_check, device, budget_s, seconds,
the ok / failed / skipped counts, probe, and steps (name, what, status, reason when not ok, seconds, figures,
tail when failed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_STEP_S = 20  # a step is skipped rather than started with less time than this left
TE_TOLERANCE = 2e-3  # fp32 log-probs: TE's fused kernels sum in another order than the local specs


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    timeout_s: int
    command: Callable[[Path], list[str]]  # the step's scratch folder -> argv
    needs: Callable[[], str] = lambda: ""  # "" = can run, else why not
    parse: Callable[[str, Path], dict] = lambda out, scratch: {"figures": json_lines(out)}
    env: dict[str, str] = field(default_factory=dict)


def json_lines(text: str) -> list[dict]:
    """Every line of `text` that is a JSON object (the benchmarks print one per figure)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                out.append(value)
    return out


def junit_counts(path: Path) -> dict:
    """passed/failed/skipped/errors and the failing test ids of a pytest --junitxml report."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failing": []}
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "errors"] += 1
            counts["failing"].append(test_id)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _cuda() -> str:
    try:
        import torch
    except ImportError as err:
        return f"torch cannot be imported: {err}"
    return "" if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"


def _cuda_and(module: str, name: str) -> str:
    """ "" when CUDA is present and `module` importable, else why not."""
    return _cuda() or ("" if importlib.util.find_spec(module) else f"{name} is not installed")


def _present(path: Path, module: str) -> Callable[[], str]:
    def check() -> str:
        return f"{path.relative_to(REPO)} is not in this tree" if not path.exists() else _cuda_and(module, module)

    return check


def _transformer_engine() -> str:
    return _cuda_and("transformer_engine", "Transformer Engine")


def _two_gpus() -> str:
    why = _cuda()
    if why:
        return why
    import torch

    count = torch.cuda.device_count()
    return "" if count >= 2 else f"context parallelism needs 2 GPUs (one NCCL rank each), found {count}"


def _gpu_tests_parse(out: str, scratch: Path) -> dict:
    report = scratch / "gpu_tests.xml"
    return junit_counts(report) if report.exists() else {}


PY = sys.executable
SGLANG_CHECK = REPO / "tools" / "gpu" / "sglang_sync_check.py"
CP_TEST = "test_actor_context_parallel"
STEPS = (
    Step(
        "gpu_tests",
        "the gpu-marked tests",
        180,
        lambda s: [PY, "-m", "pytest", "-q", "-m", "gpu", "tests", "-k", f"not {CP_TEST}", "-p", "no:cacheprovider",
                   f"--junitxml={s}/gpu_tests.xml"],
        _cuda,
        _gpu_tests_parse,
    ),
    Step("context_parallel", "CP = 2 vs CP = 1, bf16: log-probs (padded, packed), R2 replay, loss, gradient norm", 150,
         lambda s: [PY, "-m", "pytest", "-q", "-s", "tests/test_actor_gpu.py", "-k", CP_TEST, "-p", "no:cacheprovider",
                    f"--junitxml={s}/gpu_tests.xml"],
         _two_gpus, lambda out, s: {"figures": json_lines(out), **_gpu_tests_parse(out, s)}),
    Step("te_vs_local", "TE specs (padded and packed THD) vs local specs, same weights: log-probs", 90,
         lambda s: [PY, str(Path(__file__).resolve()), "--step", "te_vs_local"], _transformer_engine),
    Step("fast_vs_local_1b", "1b bf16 train step, local specs' slow path vs grouped experts + SDPA, same weights: "
         "loss and grad-norm difference, tokens/s, MFU, top-10 kernels, GPU-busy share", 180,
         lambda s: [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    str(REPO / "tools/bench/train_step.py"), "--preset", "1b", "--fast-path", "--profile",
                    "--warmup", "1", "--iters", "2"], _cuda),
    Step("experts", "one MoE layer's experts at the 1b widths, loop vs grouped, bf16: rows/s, peak memory", 60,
         lambda s: [PY, str(REPO / "tools/bench/experts.py"), "--tokens", "2048", "8192", "--dtype", "bf16"], _cuda),
    Step("attention", "core attention, local vs SDPA (padded) / varlen (packed), bf16: tokens/s, peak memory", 60,
         lambda s: [PY, str(REPO / "tools/bench/attention.py"), "--dtype", "bf16", "--seq-len", "2048", "8192"], _cuda),
    *(Step(f"logprobs_{t // 1024}k", f"actor log-prob path (SDPA) vs naive at V = 151,936, T = {t:,}: peak memory",
           timeout, lambda s, t=t: [PY, str(REPO / "tools/bench/logprobs.py"), "--device", "cuda", "--tokens", str(t),
                                    "--before", ""], _cuda)
      for t, timeout in ((32768, 90), (65536, 120))),
    Step("train_step_1b", "bf16 train step of the ~1B Qwen3-MoE preset: tokens/s, MFU", 120,
         lambda s: [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    str(REPO / "tools/bench/train_step.py"), "--preset", "1b", "--warmup", "1", "--iters", "2"], _cuda),
    Step("train_step_mixed", "bf16 train step, 32 mixed lengths: packed vs padded seconds and peak memory", 120,
         lambda s: [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    str(REPO / "tools/bench/train_step.py"), "--preset", "1b", "--lengths", "mixed", "--samples", "32",
                    "--warmup", "1", "--iters", "1"], _cuda),
    Step("weight_sync", "tensor-mode weight sync into the local engine on the same GPU vs a device memcpy", 90,
         lambda s: [PY, str(REPO / "tools/bench/weight_sync.py"), "--modes", "tensor", "--hidden", "1024", "--layers",
                    "4", "--experts", "16", "--repeats", "3", "--bucket-mb", "512", "--workdir", str(s)], _cuda),
    Step("sglang_sync", "tools/gpu/sglang_sync_check.py (SGLang weight-sync check)", 90,
         lambda s: [PY, str(SGLANG_CHECK)], _present(SGLANG_CHECK, "sglang")),
)  # fmt: skip


def run_step(step: Step, left_s: float, scratch: Path, dry_run: bool) -> dict:
    """One step's record: status ok / failed / skipped, reason, seconds, what it parsed."""
    record: dict = {"name": step.name, "what": step.what}
    why = "dry run" if dry_run else step.needs()
    if not why and left_s < MIN_STEP_S:
        why = f"time budget: {left_s:.0f} s left, a step needs at least {MIN_STEP_S} s"
    if why:
        return {**record, "status": "skipped", "reason": why, "seconds": 0.0}
    limit = min(step.timeout_s, left_s)
    # the tree first, then whatever the caller's PYTHONPATH already holds (a --target install of the deps, say)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, **step.env)
    start = time.monotonic()
    try:
        proc = subprocess.run(step.command(scratch), capture_output=True, text=True, timeout=limit, cwd=REPO, env=env)
        out, code, reason = proc.stdout + proc.stderr, proc.returncode, ""
    except subprocess.TimeoutExpired as err:
        raw = (err.stdout or b"") + (err.stderr or b"")
        out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        code, reason = None, f"timed out after {limit:.0f} s"
    except OSError as err:
        out, code, reason = "", None, f"could not start: {err}"
    record["seconds"] = round(time.monotonic() - start, 1)
    try:
        record.update(step.parse(proc.stdout if code is not None else out, scratch))
    except Exception as err:  # noqa: BLE001 - a broken report is the step's failure, not the script's
        record["parse_error"] = f"{type(err).__name__}: {err}"
    if code == 0 and "parse_error" not in record:
        record["status"] = "ok"
    else:
        record["status"] = "failed"
        record["reason"] = reason or (f"exit {code}" if code else record.get("parse_error", "failed"))
        record["tail"] = out[-3000:]
    return record


def run_all(steps: tuple[Step, ...], budget_s: float, dry_run: bool) -> dict:
    """Every step in order within `budget_s`; the summary."""
    start = time.monotonic()
    records = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for step in steps:
            scratch = Path(tmp) / step.name
            scratch.mkdir()
            records.append(run_step(step, budget_s - (time.monotonic() - start), scratch, dry_run))
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "skipped")}
    return {
        "gpu_check": "megatron-rl",
        "device": _device_name(),
        "budget_s": budget_s,
        "seconds": round(time.monotonic() - start, 1),
        **counts,
        "probe": probe(),
        "steps": records,
    }


def _varlen_parameters() -> list[str] | str:
    """The parameter names of torch's `varlen_attn`, read from its source: importing it imports TorchDynamo
    (seconds of CPU the check on a CPU should not spend)."""
    import ast

    spec = importlib.util.find_spec("torch.nn.attention.varlen")
    if spec is None or spec.origin is None:
        return "absent: torch.nn.attention.varlen does not exist (torch < 2.10)"
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name == "varlen_attn":
            a = node.args
            return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return f"absent: no varlen_attn in {spec.origin}"


def probe() -> dict:
    """What this machine's torch offers the fast path (module doc); no GPU work beyond asking."""
    try:
        import torch
    except ImportError as err:
        return {"torch": f"cannot be imported: {err}"}
    cuda = torch.cuda.is_available()
    varlen = _varlen_parameters()
    backends = torch.backends.cuda
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "grouped_mm": hasattr(torch, "_grouped_mm"),
        "varlen_attn_parameters": varlen,
        "sdpa_backends_enabled": {
            "flash": backends.flash_sdp_enabled(),
            "mem_efficient": backends.mem_efficient_sdp_enabled(),
            "cudnn": backends.cudnn_sdp_enabled(),
            "math": backends.math_sdp_enabled(),
        },
        "flash_attention_built": backends.is_flash_attention_available() if cuda else None,
        "packages": {m: importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex", "sglang")},
    }


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown (no torch)"


# ---- the te_vs_local step (run in its own process) ----


def te_vs_local() -> dict:
    """The same tiny MoE policy (weights from `init_deterministic`) under TE and local specs: the
    actor's log-probs and entropy of one batch in fp32, right-padded under both and packed (THD,
    `train.micro_batch_tokens`) under TE, against the local padded ones: the largest differences."""
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from megatron_rl.parallel.launch import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.forward import compute_log_probs
    from megatron_rl.actor.micro_batches import TokenBudget
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models.builder import build_model, transformer_engine_available
    from megatron_rl.models.init import init_deterministic
    from megatron_rl.parallel import destroy_distributed, init_distributed

    if not transformer_engine_available():
        raise RuntimeError("Transformer Engine is not installed: nothing to compare the local specs with")
    model = ModelConfig(
        family="qwen3_moe", num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
        num_query_groups=4, vocab_size=1000, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
        max_position_embeddings=1024, qk_layernorm=True, add_qkv_bias=False,
    )  # fmt: skip
    parallel = ParallelConfig()
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(40, 200, (6,), generator=gen)]
    batch = ActorBatch(
        tokens=[torch.randint(0, model.vocab_size, (n,), generator=gen) for n in lengths],
        prompt_lengths=[16] * len(lengths),
        advantages=[torch.tensor(0.0)] * len(lengths),
    )
    init_distributed(parallel, model)
    try:
        results = {}
        for te, budget in ((False, TokenBudget(512)), (True, TokenBudget(512)), (True, TokenBudget(400, packed=True))):
            chunks = build_model(model, parallel, use_transformer_engine=te)
            init_deterministic(chunks, model, seed=3)
            results[te, budget.packed] = compute_log_probs(
                chunks, batch, temperature=1.0, vocab_size=model.vocab_size, budget=budget, chunk_tokens=128
            )
    finally:
        destroy_distributed()

    def worst(a: list, b: list) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    ref = results[False, False]
    logp = worst(results[True, False].log_probs, ref.log_probs)
    ent = worst(results[True, False].entropy, ref.entropy)
    packed_logp = worst(results[True, True].log_probs, ref.log_probs)
    packed_ent = worst(results[True, True].entropy, ref.entropy)
    return {
        "figure": "te_vs_local_logprobs",
        "max_abs_logprob_diff": logp,
        "max_abs_entropy_diff": ent,
        "max_abs_logprob_diff_te_packed": packed_logp,
        "max_abs_entropy_diff_te_packed": packed_ent,
        "tolerance": TE_TOLERANCE,
        "equal_within_tolerance": max(logp, ent, packed_logp, packed_ent) <= TE_TOLERANCE,
        "tokens": sum(n - 16 for n in lengths),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=480.0, help="overall time for all steps")
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--dry-run", action="store_true", help="skip every step: the summary's shape only")
    p.add_argument("--step", choices=["te_vs_local"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step == "te_vs_local":
        result = te_vs_local()
        print(json.dumps(result), flush=True)
        return 0 if result["equal_within_tolerance"] else 1
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in STEPS})
    if unknown:
        p.error(f"--only: unknown step(s) {unknown}; allowed: {[s.name for s in STEPS]}")
    steps = tuple(s for s in STEPS if not names or s.name in names)
    summary = run_all(steps, args.budget_s, args.dry_run)
    print(json.dumps(summary, indent=1), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
