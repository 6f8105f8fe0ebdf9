"""Start the local engine (`megatron-rl serve`) as a child process and wait until it serves (or spawn
it now and wait later: `spawn_local_engine`).

The port reaches the parent through a file in a `megatron-rl-serve-*` temporary folder that is removed
as soon as the engine serves (or fails to); without a `log_path` the engine's output goes to an
anonymous temporary file, so nothing is left in the temporary directory once the engine exits.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# the engines' key in the environment: what `megatron-rl serve` requires without --api-key, and what
# the trainer sends without rollout.api_key (the Slurm scripts hand the job's key over so)
API_KEY_ENV = "MEGATRON_RL_ENGINE_API_KEY"
ADMIN_API_KEY_ENV = "MEGATRON_RL_ENGINE_ADMIN_API_KEY"  # `megatron-rl serve`'s key of its control endpoints


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None  # loaded before any fork


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` (Linux; None elsewhere) by which the child gets SIGTERM when the thread that starts it
    dies, even by SIGKILL; a child whose parent died between its fork and that setting exits at once,
    before its command runs (no signal would ever come)."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class LocalEngineProcess:
    """A running `megatron-rl serve` child; `stop()` ends it. Its output is in `log_path`, or (None)
    in the anonymous `log_file`."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: str | None, log_file: IO[bytes] | None = None):
        self.process, self.url, self.log_path, self.log_file = process, url, log_path, log_file

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stopped(self) -> bool:
        """Linux: the child is stopped (SIGSTOP, SIGTSTP), not merely slow."""
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, self.log_file, lines)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_file is not None:
            self.log_file.close()


def _tail(log_path: str | None, log_file: IO[bytes] | None, lines: int) -> str:
    try:
        if log_path is not None:
            text = Path(log_path).read_text(errors="replace")
        elif log_file is not None and not log_file.closed:
            fd = log_file.fileno()
            text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")  # pread: the child's offset stays
        else:
            return ""
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class StartingEngine:
    """A `megatron-rl serve` child spawned and not yet waited for: `wait()` returns the running engine
    once /health answers (or raises with the log's tail), `kill()` ends a start-up abandoned before
    that. The engine loads its model while the caller starts other things."""

    def __init__(
        self,
        process: subprocess.Popen,
        host: str,
        api_key: str | None,
        log_path: str | None,
        log_file: IO[bytes] | None,
        workdir: str,
        timeout_s: float,
    ) -> None:
        self.process, self.host, self.api_key = process, host, api_key
        self.log_path, self.log_file, self.workdir = log_path, log_file, workdir
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self._where = f"log {log_path}" if log_path else "its output"

    def wait(self) -> LocalEngineProcess:
        port_file = os.path.join(self.workdir, "port")
        try:
            while time.monotonic() < self.deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"local engine exited with code {self.process.returncode} ({self._where}):\n{self._end()}"
                    )
                if os.path.exists(port_file) and open(port_file).read().strip():
                    url = f"http://{self.host}:{int(open(port_file).read())}"
                    if _healthy(url, self.api_key):
                        return LocalEngineProcess(self.process, url, self.log_path, self.log_file)
                time.sleep(0.2)
            self.kill()
            raise TimeoutError(
                f"local engine did not serve within {self.timeout_s:.0f} s ({self._where}):\n{self._end()}"
            )
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        """A no-op once the child has exited (stopped by the engine handle that took it)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _end(self) -> str:
        tail = _tail(self.log_path, self.log_file, 20)
        if self.log_file is not None:
            self.log_file.close()
        return tail


def spawn_local_engine(
    model_path: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    device: str = "cpu",
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    timeout_s: float = 300.0,
    prefix: list[str] | None = None,
) -> StartingEngine:
    """Spawn the engine on `port` (None = a free one) without waiting; `prefix` runs it under a wrapper
    (`["taskset", "-c", "1"]`). `api_key` and `admin_api_key` (its control endpoints' key) reach it in its
    environment; without an API key, `extra_args` must say `--no-auth` (the engine refuses to start otherwise).
    `timeout_s` counts from the spawn."""
    workdir = tempfile.mkdtemp(prefix="megatron-rl-serve-")
    cmd = [*(prefix or []), sys.executable, "-m", "megatron_rl.cli", "serve", "--model", model_path, "--host", host]
    cmd += ["--port", str(port or 0), "--port-file", os.path.join(workdir, "port"), "--device", device]
    child_env = {**os.environ, **(env or {})}
    # not on the command line, which every user of the machine can read; none inherited from this process
    for name, key in ((API_KEY_ENV, api_key), (ADMIN_API_KEY_ENV, admin_api_key)):
        child_env.pop(name, None)
        if key:
            child_env[name] = key
    cmd += list(extra_args or [])
    log = open(log_path, "ab") if log_path else tempfile.TemporaryFile()
    try:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            preexec_fn=die_with_parent(),
        )
    except BaseException:
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    if log_path:
        log.close()
    return StartingEngine(process, host, api_key, log_path, None if log_path else log, workdir, timeout_s)


def start_local_engine(model_path: str, **kwargs: Any) -> LocalEngineProcess:
    """`spawn_local_engine(model_path, **kwargs)`, then wait until it serves."""
    return spawn_local_engine(model_path, **kwargs).wait()


def _healthy(url: str, api_key: str | None) -> bool:
    request = urllib.request.Request(url + "/health")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False
