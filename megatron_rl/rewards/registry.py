"""The per-sample reward function named by the `reward` config section."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.rewards.rules import Verdict, boxed_rule, dapo_rule, math_verify_rule

if TYPE_CHECKING:
    from megatron_rl.config import RewardConfig

# A rule returns a Verdict (built-ins), a bool (correct or not) or a number (the reward itself). It
# takes (response, answer); one that names a `prompt` or `row` parameter (or takes **kwargs) also gets
# the prompt text the model saw and the data row (see `rule_caller`).
RewardFn = Callable[..., Any]
# (response, answer, prompt, row) -> the rule's output
RuleCall = Callable[[str, str, "str | None", "Mapping[str, Any] | None"], Any]

BUILTIN_RULES: dict[str, Callable[[str, str], Verdict]] = {"dapo": dapo_rule, "boxed": boxed_rule}


class RewardConfigError(ValueError):
    """A `reward` setting that cannot be used (unknown type, missing package or function)."""


RULE_NAMES = (*BUILTIN_RULES, "math_verify")


def resolve_rule(cfg: RewardConfig) -> RewardFn:
    """The function of reward.type; type=math_verify needs the math-verify package, type=custom
    reward.custom_function. (type=remote has no local function: `RewardScorer` asks the server.)"""
    if cfg.type in RULE_NAMES:
        return named_rule(cfg.type, f"reward.type = {cfg.type!r}")
    if cfg.type == "custom":
        if not cfg.custom_function:
            raise RewardConfigError("reward.type = 'custom' needs reward.custom_function = 'module:function'")
        return load_custom_function(cfg.custom_function)
    raise RewardConfigError(f"reward.type = {cfg.type!r} has no local function; allowed: {[*RULE_NAMES, 'custom']}")


def named_rule(name: str, where: str) -> RewardFn:
    """A built-in rule by its name (RULE_NAMES); math_verify needs the math-verify package."""
    if name in BUILTIN_RULES:
        return BUILTIN_RULES[name]
    if name == "math_verify":
        try:
            import math_verify  # noqa: F401
        except ImportError as err:
            raise RewardConfigError(
                f"{where} needs the math-verify package, which is not installed (pip install math-verify): {err}"
            ) from err
        return math_verify_rule
    raise RewardConfigError(f"{where}: no built-in rule {name!r}; built-in: {list(RULE_NAMES)}")


def load_reward_function(spec: str, where: str) -> RewardFn:
    """A built-in rule by name (dapo, boxed, math_verify) or a `module:function` / `file.py:function`."""
    return named_rule(spec, where) if spec in RULE_NAMES else load_custom_function(spec, where)


def extra_arguments(fn: RewardFn) -> tuple[str, ...]:
    """Which of `prompt` and `row` fn takes: the ones it names (both when it takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature take the two positional arguments
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return tuple(name for name in ("prompt", "row") if takes_any or name in params)


def rule_caller(fn: RewardFn) -> RuleCall:
    """(response, answer, prompt, row) -> fn(response, answer), with prompt= and row= passed only
    when fn names them (or takes **kwargs)."""
    extra = extra_arguments(fn)

    def call(response: str, answer: str, prompt: str | None, row: Mapping[str, Any] | None) -> Any:
        given = {"prompt": prompt, "row": row}
        return fn(response, answer, **{name: given[name] for name in extra})

    return call


def load_custom_function(spec: str, where: str | None = None) -> RewardFn:
    """`package.module:function` (imported) or `path/to/file.py:function` (loaded from the file).
    The function takes (response, answer) (and optionally prompt=, row=) and returns a bool or a
    number. `where` names the setting in errors (default: reward.custom_function)."""
    where = where or f"reward.custom_function = {spec!r}"
    module_name, sep, function_name = spec.rpartition(":")
    if not sep or not module_name or not function_name:
        raise RewardConfigError(f"{where}: expected 'module:function' or 'path/to/file.py:function'")
    module = _load_file(module_name, where) if module_name.endswith(".py") else _import(module_name, where)
    function = getattr(module, function_name, None)
    if function is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise RewardConfigError(f"{where}: module {module_name!r} has no function {function_name!r}; it has {public}")
    if not callable(function):
        raise RewardConfigError(f"{where}: {module_name}.{function_name} is a {type(function).__name__}, not callable")
    return function


def load_group_filter(spec: str) -> Callable[..., Any]:
    """`algorithm.dynamic_sampling_filter`: the function that keeps (True) or drops (False) a prompt group
    in dynamic sampling, loaded as reward.custom_function is."""
    return load_custom_function(spec, where=f"algorithm.dynamic_sampling_filter = {spec!r}")


def _import(module_name: str, where: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = "it" if err.name == module_name else f"its import {err.name!r}"
        raise RewardConfigError(f"{where}: cannot import module {module_name!r}: {missing} was not found") from err
    except Exception as err:  # the module's own top-level code failed
        raise RewardConfigError(f"{where}: importing module {module_name!r} failed: {err!r}") from err


def _load_file(path: str, where: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise RewardConfigError(f"{where}: no such file {path!r}")
    spec = importlib.util.spec_from_file_location(f"megatron_rl_custom_reward_{file.stem}", file)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise RewardConfigError(f"{where}: loading {path!r} failed: {err!r}") from err
    return module
