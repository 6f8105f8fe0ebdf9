"""tools/gpu_check.sh: its steps' records (ok, failed, timed out, out of budget, skipped) and the summary,
exercised here without a GPU (every real step is then skipped, saying why)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


gc = _module()


def _python(code: str):  # noqa: ANN202
    return lambda scratch: [sys.executable, "-c", code]


def test_step_records(tmp_path: Path) -> None:
    ok = gc.Step("a", "prints figures", 30, _python('print("noise"); print(\'{"figure": "x", "value": 2}\')'))
    record = gc.run_step(ok, 100.0, tmp_path, dry_run=False)
    assert record["status"] == "ok" and record["figures"] == [{"figure": "x", "value": 2}], record
    assert "tail" not in record

    bad = gc.Step("b", "exits 3", 30, _python("import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    record = gc.run_step(bad, 100.0, tmp_path, dry_run=False)
    assert record["status"] == "failed" and record["reason"] == "exit 3" and "boom" in record["tail"], record

    slow = gc.Step("c", "sleeps", 1, _python("import time; print('started', flush=True); time.sleep(30)"))
    record = gc.run_step(slow, 100.0, tmp_path, dry_run=False)
    assert record["status"] == "failed" and record["reason"] == "timed out after 1 s", record
    assert "started" in record["tail"]  # killed at its timeout: what it printed before is kept

    record = gc.run_step(ok, gc.MIN_STEP_S - 1, tmp_path, dry_run=False)
    assert record["status"] == "skipped" and record["reason"].startswith("time budget"), record
    unmet = gc.Step("d", "needs something", 30, ok.command, needs=lambda: "no widget")
    assert gc.run_step(unmet, 100.0, tmp_path, dry_run=False)["reason"] == "no widget"
    assert gc.run_step(ok, 100.0, tmp_path, dry_run=True)["reason"] == "dry run"


def test_junit_counts(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="t.a" name="one"/>'
        '<testcase classname="t.a" name="two"><failure message="x"/></testcase>'
        '<testcase classname="t.b" name="three"><skipped/></testcase>'
        '<testcase classname="t.b" name="four"><error message="y"/></testcase></testsuite></testsuites>'
    )
    assert gc.junit_counts(report) == {
        "passed": 1,
        "failed": 1,
        "skipped": 1,
        "errors": 1,
        "failing": ["t.a::two", "t.b::four"],
    }


@pytest.mark.skipif(gc._cuda() == "", reason="on a GPU the real steps would run")
def test_script_without_a_gpu_skips_every_step_and_says_why() -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu_check.sh"), "--budget-s", "60"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    names = [s["name"] for s in summary["steps"]]
    assert names == [s.name for s in gc.STEPS], names
    assert summary["skipped"] == len(names) and summary["ok"] == summary["failed"] == 0
    assert all("no CUDA device" in s["reason"] for s in summary["steps"]), summary["steps"]
    assert summary["device"] == "cpu"
    probe = summary["probe"]  # asked of torch on any machine
    import torch

    assert probe["torch"] == torch.__version__ and probe["grouped_mm"] is hasattr(torch, "_grouped_mm")
    assert probe["devices"] == [] and probe["flash_attention_built"] is None
    assert set(probe["sdpa_backends_enabled"]) == {"flash", "mem_efficient", "cudnn", "math"}
    varlen = probe["varlen_attn_parameters"]  # read from the source (importing it would import TorchDynamo)
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        assert varlen.startswith("absent")
    else:
        assert varlen[:5] == ["query", "key", "value", "cu_seq_q", "cu_seq_k"], varlen

    bad = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--only", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown step(s) ['nope']" in bad.stderr


def test_sglang_sync_check_takes_its_free_ports_from_the_package() -> None:
    """tools/gpu/sglang_sync_check.py (run on a GPU only) has no port helper of its own."""
    from megatron_rl.parallel.launch import free_port

    spec = importlib.util.spec_from_file_location("sglang_sync_check", REPO / "tools" / "gpu" / "sglang_sync_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.free_port is free_port and not hasattr(module, "_free_port")
