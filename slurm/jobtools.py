"""Small tools of the job script: wait for the servers' /health, read each engine's weight version."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: its siblings in slurm/
    sys.path.append(str(Path(__file__).resolve().parent))
from jobplace import PlanError  # noqa: E402


def _health(url: str, api_key: str | None, timeout: float = 5.0) -> int | None:
    request = urllib.request.Request(url.rstrip("/") + "/health")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_healthy(
    urls: Sequence[str], timeout_s: float, pids: Sequence[int] = (), api_key: str | None = None, interval_s: float = 1.0
) -> None:
    """Until every URL's /health answers 200; PlanError when a watched process ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        dead = [p for p in pids if not _pid_alive(p)]
        if dead:
            raise PlanError(f"a server process ended before answering /health (pid {dead[0]}); see its log")
        pending = [u for u in pending if _health(u, api_key) != 200]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise PlanError(f"no healthy answer from {', '.join(pending)} within {timeout_s:.0f} s")
        time.sleep(interval_s)


def weight_versions(urls: Sequence[str], api_key: str | None = None) -> list[dict[str, Any]]:
    """Each engine's /model_info weight_version (the deprecated /get_model_info where that is missing:
    404; None with the error when it does not answer)."""
    out = []
    for url in urls:
        try:
            try:
                info = _get_json(url, "/model_info", api_key)
            except urllib.error.HTTPError as err:
                if err.code != 404:
                    raise
                info = _get_json(url, "/get_model_info", api_key)
            out.append({"url": url, "weight_version": info.get("weight_version")})
        except (urllib.error.URLError, OSError, ValueError) as err:
            out.append({"url": url, "weight_version": None, "error": str(err)})
    return out


def _get_json(url: str, path: str, api_key: str | None) -> Any:
    request = urllib.request.Request(url.rstrip("/") + path)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())
