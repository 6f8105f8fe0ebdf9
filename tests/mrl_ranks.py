"""`python tests/mrl_ranks.py N PORT ARGS...`: the tests' stand-in for `torchrun --standalone --nproc-per-node N ARGS...`.

torchrun's agent imports torch before it starts a rank: about 1.5 s of wall time per 2-rank launch on
the 2-core test machine (a 2-step SFT run: 7.2 s under torchrun, 5.6 s under this launcher). This one
imports nothing heavy. Each rank is `python ARGS...` with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT=PORT, as torchrun sets them; rank 0 hosts
the process group's store, as under srun. SIGTERM, SIGINT and SIGUSR1 reach every rank. When a rank
fails, the others get SIGTERM and, GRACE_S later, SIGKILL, as under torchrun; the exit code is the
first failing rank's, 0 when all succeed. The tests of torchrun's own behaviour (SIGTERM to its agent)
keep torchrun (`mrl_runs.rank_launcher(ranks, "torchrun")`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 30.0
POLL_S = 0.05
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def launch(world_size: int, port: int, args: list[str]) -> list[subprocess.Popen]:
    ranks = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        env.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen([sys.executable, *args], env=env))
    return ranks


def stop(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those still running GRACE_S later."""
    for proc in ranks:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def supervise(ranks: list[subprocess.Popen]) -> int:
    """Wait for every rank; on the first failure stop the others. The exit code."""
    while True:
        codes = [proc.poll() for proc in ranks]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None:
            stop(ranks)
            return failed if failed > 0 else 128 - failed  # a rank killed by signal k: 128 + k, as a shell says
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python tests/mrl_ranks.py N PORT ARGS...", file=sys.stderr)
        return 2
    ranks = launch(int(argv[0]), int(argv[1]), argv[2:])

    def forward(signum: int, _frame: object) -> None:
        for proc in ranks:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    return supervise(ranks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
