"""Start the local engine (`megatron-rl serve`) as a child process and wait until it serves."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def _die_with_parent() -> None:
    """Linux: the engine gets SIGTERM when the thread that started it dies, even by SIGKILL."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


class LocalEngineProcess:
    """A running `megatron-rl serve` child; `stop()` ends it."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: str):
        self.process, self.url, self.log_path = process, url, log_path

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
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_local_engine(
    model_path: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    timeout_s: float = 300.0,
) -> LocalEngineProcess:
    """Launch the engine on `port` (None = a free one) and return once /health answers 200."""
    workdir = tempfile.mkdtemp(prefix="megatron-rl-serve-")
    port_file = os.path.join(workdir, "port")
    log_path = log_path or os.path.join(workdir, "serve.log")
    cmd = [sys.executable, "-m", "megatron_rl.cli", "serve", "--model", model_path, "--host", host]
    cmd += ["--port", str(port or 0), "--port-file", port_file, "--device", device]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(extra_args or [])
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = Path(log_path).read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"local engine exited with code {process.returncode} (log {log_path}):\n" + "\n".join(tail)
            )
        if os.path.exists(port_file) and open(port_file).read().strip():
            url = f"http://{host}:{int(open(port_file).read())}"
            if _healthy(url, api_key):
                return LocalEngineProcess(process, url, log_path)
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"local engine did not serve within {timeout_s:.0f} s (log {log_path})")


def _healthy(url: str, api_key: str | None) -> bool:
    request = urllib.request.Request(url + "/health")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False
