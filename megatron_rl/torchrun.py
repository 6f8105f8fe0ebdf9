"""`python -m megatron_rl.torchrun ARGS`: torchrun (`torch.distributed.run`, the same arguments) that
ends as its ranks do when a signal stops them.

    python -m megatron_rl.torchrun --standalone --nproc-per-node 2 -m megatron_rl.cli train CONFIG.yaml

Why: torchrun starts each rank in a session of its own, so a terminal's Ctrl-C reaches the ranks only
through torchrun, which gets it too. Its handler raises `SignalException`; its agent sends the signal
to every rank's process group, waits for them (`TORCHELASTIC_SHUTDOWN_TIMEOUT`, 30 s, then SIGKILL)
and raises it again, and `torchrun` prints that traceback and exits with 1 whatever the ranks did
(after Ctrl-C each rank exits 130 with one line from rank 0). Here the same agent runs the ranks, and
the signal ends it with 128 + its number (130 after Ctrl-C, 143 after SIGTERM) and no traceback; a
rank that fails ends it with that rank's exit code and one line naming the rank, below the rank's
own error (torchrun prints a `ChildFailedError` traceback). torchrun's own warnings stay (the signal it
received, the ranks it signalled, one it had to kill).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as err:  # the ranks got the same signal and had their time to stop
        return 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C before the agent's handlers were installed (its rendezvous)
        return 130
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode  # killed by signal k: 128 + k
        print(f"torchrun: rank {rank} exited with code {code}; the others were stopped", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
