"""Episodes that fail, and when that stops the run.

An episode fails when its environment's `step` raises, runs past `env.step_timeout_s` or gives an
observation that cannot be rendered (it ends as `env_error`), or when its agent fails (`agent_error`:
it raised, exited non-zero, ran past `env.agent_timeout_s`, gave a bad reward or never called the
model). Each such failure ends its own episode only; a step (or an evaluation) where more than
`env.max_failure_frac` of the episodes failed stops the run (`EpisodeFailureError`, one line naming
the environment or agent and the first failure), as `reward.max_failure_frac` does for rewards.
Below it, one warning per step says how many failed and the first failure.

`Environment.start` raising stops the run at once (`EnvStartError`, naming the environment): the
episode has no prompt to generate from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from megatron_rl.config import EnvConfig

log = logging.getLogger(__name__)
FAILED_ENDS = ("env_error", "agent_error")


class EpisodeFailureError(RuntimeError):
    """More than `env.max_failure_frac` of a step's episodes failed."""


class EnvStartError(RuntimeError):
    """An environment's `start` raised: the episode cannot begin."""


def culprit(cfg: EnvConfig) -> str:
    """What runs the episodes, as the configuration names it."""
    if cfg.type == "agent":
        return f"env.agent = {cfg.agent!r}" if cfg.agent else f"env.agent_command = {cfg.agent_command!r}"
    return f"env.type = {cfg.type!r}"


def start_messages(env: Any, row: Any, cfg: EnvConfig) -> list[dict[str, str]] | None:
    """`env.start(row)`; an exception out of it is `EnvStartError`, one line naming the environment."""
    try:
        return env.start(row)
    except Exception as err:
        message = " ".join(f"{type(err).__name__}: {err}".split())
        raise EnvStartError(f"{culprit(cfg)}: {type(env).__name__}.start raised {message}") from err


def check_episode_failures(cfg: EnvConfig, episodes: Sequence[Any], where: str) -> None:
    """Raise `EpisodeFailureError` when more than `env.max_failure_frac` of `episodes` failed (see the
    module doc); else warn once when any did (`where`: e.g. "step 3")."""
    failed = [e for e in episodes if getattr(e, "end_reason", "") in FAILED_ENDS]
    if not failed:
        return
    info = failed[0].meta_info
    first = " ".join(str(info.get("env_error") or info.get("agent_error") or "no message").split())
    counted = f"{len(failed)} of {len(episodes)} episodes failed"
    if len(failed) > cfg.max_failure_frac * len(episodes):
        raise EpisodeFailureError(
            f"{where}: {counted} ({len(failed) / len(episodes):.0%}, above env.max_failure_frac = "
            f"{cfg.max_failure_frac:g}) in {culprit(cfg)}; first: {first}"
        )
    log.warning("%s: %s in %s; first: %s", where, counted, culprit(cfg), first)
