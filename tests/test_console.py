"""The console filters (megatron_rl/console.py): known-harmless noise hidden by default, everything
shown with MEGATRON_RL_LOG_LEVEL=debug or `megatron-rl --verbose`, real warnings always shown."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from megatron_rl import cli
from megatron_rl.console import HARMLESS_LOG_RECORDS, LOG_LEVEL_VARIABLE, configure_console

RERUN_LOGGER = "megatron.core.rerun_state_machine"


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start as a fresh process does (another test's `megatron-rl` call may have configured the console)
    and undo what configure_console changes: the variable, the package's log level, the log filters."""
    monkeypatch.setenv(LOG_LEVEL_VARIABLE, "")  # recorded, so that it is unset again after the test
    monkeypatch.delenv(LOG_LEVEL_VARIABLE)
    package = logging.getLogger("megatron_rl")
    level = package.level
    loggers = {record.logger: logging.getLogger(record.logger) for record in HARMLESS_LOG_RECORDS}
    filters = {name: list(logger.filters) for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.filters[:] = [f for f in logger.filters if f not in HARMLESS_LOG_RECORDS]
    with warnings.catch_warnings():
        yield
    package.setLevel(level)
    for name, logger in loggers.items():
        logger.filters[:] = filters[name]


def deprecated_collective_warnings() -> list[str]:
    """The FutureWarning torch gives for a collective Megatron calls by its old name (then fails: no group)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configure_console()
        with pytest.raises((RuntimeError, ValueError)):
            dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_harmless_warning_is_hidden_by_default(console: None) -> None:
    messages = deprecated_collective_warnings()
    assert not any("all_gather_into_tensor" in m for m in messages)
    assert "a real problem" in messages


def test_debug_level_shows_every_warning(console: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_LEVEL_VARIABLE, "debug")
    messages = deprecated_collective_warnings()
    assert any("all_gather_into_tensor" in m for m in messages)
    assert "a real problem" in messages
    assert logging.getLogger("megatron_rl.trainer").isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize(
    ("message", "module"),
    [
        (
            "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
            "megatron_rl.models.torch_dist_io",
        ),
        ("Please use DTensor instead and we are deprecating ShardedTensor.", "megatron_rl.parallel.cpu_compat"),
    ],
)
def test_checkpoint_reads_deprecation_notices_are_hidden_unless_debug(
    console: None, monkeypatch: pytest.MonkeyPatch, message: str, module: str
) -> None:
    """torch's FutureWarnings at every read of a Megatron checkpoint (`checkpoint.load`, `--resume`), which the
    console printed with a run's first lines, attributed to the modules that issue them on CPU."""
    for level, shown in ((None, False), ("debug", True)):
        if level:
            monkeypatch.setenv(LOG_LEVEL_VARIABLE, level)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            configure_console()
            warnings.warn_explicit(message, FutureWarning, "x.py", 1, module=module)
        assert [str(w.message) for w in caught] == ([message] if shown else [])


@pytest.mark.parametrize("level, shown", [(None, False), ("debug", True)])
def test_harmless_log_record_is_dropped_unless_debug(
    console: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, level: str | None, shown: bool
) -> None:
    if level is not None:
        monkeypatch.setenv(LOG_LEVEL_VARIABLE, level)
    configure_console()
    logging.getLogger(RERUN_LOGGER).warning("Implicit initialization of Rerun State Machine!")
    logging.getLogger(RERUN_LOGGER).warning("a rerun found a mismatch")
    expected = ["Implicit initialization of Rerun State Machine!"] if shown else []
    assert [r.getMessage() for r in caplog.records] == [*expected, "a rerun found a mismatch"]


def test_verbose_flag_sets_debug_for_this_process_and_its_children(
    console: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--verbose"]) == 2  # no subcommand: help
    assert os.environ[LOG_LEVEL_VARIABLE] == "debug"
    assert "--verbose" in capsys.readouterr().out


def test_unknown_log_level_names_the_variable_and_the_allowed_values(
    console: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(LOG_LEVEL_VARIABLE, "loud")
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert f"{LOG_LEVEL_VARIABLE} = 'loud'" in err and "['debug', 'info', 'warning', 'error']" in err


def test_ctrl_c_while_a_command_is_imported_exits_130_without_a_traceback(
    console: None, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "slow_to_import.py").write_text("raise KeyboardInterrupt  # Ctrl-C while torch is imported\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "slow", ("slow_to_import", "a command whose import is interrupted"))
    assert cli.main(["slow"]) == 130
    assert capsys.readouterr().err == ""
