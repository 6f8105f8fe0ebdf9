"""Benchmark: the actor's log-prob path (hidden states, no logits) against the naive full-vocabulary
fp32 path and against the actor's previous logits path.

Three figures, each path in a fresh process:

- actor:  the actor of this tree: a one-layer `MegatronActor` (dense Qwen3 layer, --hidden,
          --heads, --vocab, untied), one sample of --tokens tokens; one `compute_log_probs` call and
          one `train` call (one micro-batch, one optimizer step), each measured on its own.
- before: the same script and calls on the actor of git revision --before (default `main`: its
          `megatron_rl/` exported with `git archive` into a temporary folder and imported from
          there), so the figure before the change is measured the same way. `--before ''` skips it.
- naive:  the output projection and a full-vocabulary fp32 log_softmax + gather on hidden states
          [T, H] and W [V, H], forward and backward (gradients of hidden and W of sum(logp * A)),
          the entropy from the same log-probs as a metric.

Memory: the peak extra resident memory of the call: the Linux VmHWM high-water mark, reset through
/proc/self/clear_refs right before the call, minus the RSS then; on CUDA,
torch.cuda.max_memory_allocated over memory_allocated at the same point. The actor first runs both
calls on a 32-token sample, so the state that persists across calls (Adam moments, gradient
buffers) is in place before the measured calls and only what a call needs for itself is counted.
A one-layer model at this vocabulary is almost all output layer; what the transformer layer
itself needs at --tokens is the `layer_only` figure (the same actor with a 1,024-token vocabulary).
`memory_ratio_vs_layer_only` is the actor's peak over that one; a naive path out of memory (its fp32 T x V
logits) is reported as `naive_error`, its ratios left out.
Time: wall-clock and process CPU seconds of the same calls (the machine may be shared: CPU time
is less sensitive to other processes). One JSON line per figure with its baselines and ratios.

    python tools/bench/logprobs.py [--tokens 4096 --vocab 151936 --hidden 1024 --heads 16 --before main]
    python tools/bench/logprobs.py --device cuda --tokens 32768 --before ''
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_MEMORY_RATIO = 0.1  # of the naive path's peak memory
GOAL_TIME_RATIO = 1.0  # of the naive path's time
REPO = Path(__file__).resolve().parents[2]
SMALL_VOCAB = 1024


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the one sample")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16, help="attention heads (head dim 64, up to 4 query groups)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="train.logprob_chunk_tokens of the actor")
    p.add_argument("--before", default="main", help="git revision of the 'before' figure; '' = skip it")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--child", choices=["naive", "actor"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- child: one path, one process ----


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(fn, device: str) -> dict:  # noqa: ANN001
    """Peak extra memory (fresh high-water mark), wall and CPU seconds of one call of `fn`."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        base = _status_kb("VmRSS") * 1024
    t0, c0 = time.perf_counter(), _cpu_s()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kb("VmHWM") * 1024
    return {"peak_extra_GiB": (peak - base) / 2**30, "time_s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0}


def _naive_child(args: argparse.Namespace) -> dict:
    import torch

    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g, device=dev).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g, device=dev) * 0.05).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g, device=dev)
    adv = torch.randn(args.tokens, generator=g, device=dev)

    def naive() -> None:
        logp_all = torch.log_softmax(hidden @ weight.t(), dim=-1)
        logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            p = logp_all.exp()
            p.mul_(logp_all).sum(-1)
            del p
        del logp_all  # autograd keeps its own reference for backward
        torch.autograd.grad((logp * adv).sum(), [hidden, weight])

    return {"fwd_bwd": _measure(naive, args.device)}


def _actor_child(args: argparse.Namespace) -> dict:
    import torch

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.config import Config, ModelConfig, RolloutConfig, TrainConfig, preset, validate

    model = ModelConfig(
        family="qwen3",
        num_layers=1,
        hidden_size=args.hidden,
        ffn_hidden_size=3 * args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=min(4, args.heads),
        kv_channels=64,
        vocab_size=args.vocab,
        max_position_embeddings=args.tokens,
        num_experts=None,
        qk_layernorm=True,
        add_qkv_bias=False,
        tie_word_embeddings=False,
    )
    cfg = Config(
        model=model,
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=args.tokens),
        algorithm=preset("grpo"),
        train=TrainConfig(
            steps=2, max_tokens_per_micro_batch=args.tokens, logprob_chunk_tokens=args.chunk_tokens, lr=1e-6, seed=1
        ),
    )
    validate(cfg)
    actor = MegatronActor(cfg)
    gen = torch.Generator().manual_seed(0)

    def batch(n: int) -> ActorBatch:
        return ActorBatch(
            tokens=[torch.randint(0, args.vocab, (n,), generator=gen)],
            prompt_lengths=[n // 8],
            advantages=[torch.tensor(1.0)],
        )

    def both_calls(b: ActorBatch) -> dict:
        out: dict = {}
        result = {}
        out["compute_log_probs"] = _measure(lambda: result.update(lp=actor.compute_log_probs(b)), args.device)
        trained = b.with_fields(old_log_probs=[lp + 0.1 for lp in result["lp"].log_probs])
        out["train"] = _measure(lambda: actor.train(trained), args.device)
        return out

    both_calls(batch(32))  # persistent state (Adam moments, buffers) before the measured calls
    return both_calls(batch(args.tokens))


def _child(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = _naive_child(args) if args.child == "naive" else _actor_child(args)
    print(json.dumps(result))


# ---- parent: run every path, compare ----


def _run_child(args: argparse.Namespace, path: str, code: Path, vocab: int | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path]
    for key in ("tokens", "vocab", "hidden", "heads", "chunk_tokens", "threads", "device"):
        value = vocab if key == "vocab" and vocab is not None else getattr(args, key)
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    from megatron_rl.parallel.launch import free_port

    launch = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    pythonpath = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, MASTER_PORT=str(free_port()), **launch)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} path ({code}) failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _export(revision: str, into: Path) -> Path:
    """`megatron_rl/` of git revision `revision` of this repository, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "megatron_rl"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {revision!r} failed (--before): {archive.stderr.decode()[-2000:]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.child:
        _child(args)
        return
    common = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "heads": args.heads,
        "chunk_tokens": args.chunk_tokens,
        "device": args.device,
        "measured": "peak extra memory of the call (fresh high-water mark), fresh process per path",
    }
    try:
        naive, naive_error = _run_child(args, "naive", REPO)["fwd_bwd"], None
    except RuntimeError as err:  # at T = 65,536 the naive logits alone (T x V fp32) outgrow an H100
        if "out of memory" not in str(err).lower():
            raise
        naive, naive_error = None, "out of memory"
    actor = _run_child(args, "actor", REPO)
    layer_only = _run_child(args, "actor", REPO, vocab=SMALL_VOCAB)
    before = None
    if args.before:
        with tempfile.TemporaryDirectory() as tmp:
            before = _run_child(args, "actor", _export(args.before, Path(tmp)))
    met = {}
    for call in ("compute_log_probs", "train"):
        now = actor[call]
        line = {
            "figure": f"actor_{call}",
            "peak_extra_GiB": now["peak_extra_GiB"],
            "time_s": now["time_s"],
            "cpu_s": now["cpu_s"],
            "layer_only_GiB": layer_only[call]["peak_extra_GiB"],
            "layer_only_time_s": layer_only[call]["time_s"],
            "memory_ratio_vs_layer_only": now["peak_extra_GiB"] / max(layer_only[call]["peak_extra_GiB"], 1e-9),
        }
        if naive is None:
            line["naive_error"] = naive_error
        else:
            line.update(
                naive_GiB=naive["peak_extra_GiB"],
                memory_ratio_vs_naive=now["peak_extra_GiB"] / naive["peak_extra_GiB"],
                naive_time_s=naive["time_s"],
                time_ratio_vs_naive=now["time_s"] / naive["time_s"],
                naive_cpu_s=naive["cpu_s"],
                cpu_ratio_vs_naive=now["cpu_s"] / naive["cpu_s"],
            )
        if before is not None:
            then = before[call]
            line.update(
                before=args.before,
                before_GiB=then["peak_extra_GiB"],
                before_memory_ratio_vs_naive=then["peak_extra_GiB"] / naive["peak_extra_GiB"],
                memory_ratio_vs_before=now["peak_extra_GiB"] / then["peak_extra_GiB"],
                before_time_s=then["time_s"],
                time_ratio_vs_before=now["time_s"] / then["time_s"],
                before_cpu_s=then["cpu_s"],
            )
        print(json.dumps({**line, **common}), flush=True)
        if naive is not None:
            met[call] = {
                "memory": line["memory_ratio_vs_naive"] <= GOAL_MEMORY_RATIO,
                "time": line["time_ratio_vs_naive"] <= GOAL_TIME_RATIO,
            }
    goals = {"memory_ratio": GOAL_MEMORY_RATIO, "time_ratio": GOAL_TIME_RATIO}
    print(json.dumps({"figure": "goal_met", **met, "goals_vs_naive": goals, **common}), flush=True)


if __name__ == "__main__":
    main()
