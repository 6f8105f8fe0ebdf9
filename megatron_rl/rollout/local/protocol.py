"""Request bodies of the local engine, parsed and checked with SGLang's field names and defaults.

Every problem raises `FieldError` naming the field (e.g. `sampling_params[2].top_p`); the server
turns it into an HTTP 400. Unknown top-level keys are ignored and unknown sampling keys rejected,
as SGLang 0.5.23 does. Options SGLang has but the local engine does not implement are accepted at
their default value and rejected otherwise, with a message that says so.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from megatron_rl.http.body import parse_json
from megatron_rl.rollout.local.generator import GenRequest
from megatron_rl.rollout.local.model import ModelInfo
from megatron_rl.rollout.wire import flattened_layout


class FieldError(ValueError):
    """A request field with a missing, mistyped or unsupported value."""


RAW_BODY = web.RequestKey("raw_body", bytes)  # the body, read within the endpoint's limit by the server


async def json_body(request: web.Request) -> Any:
    """The request's body (`RAW_BODY`) as strict JSON."""
    return parse_json(request[RAW_BODY])


# SGLang 0.5.23 sampling keys, with the value at which an unimplemented one is harmless.
_UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
_HARMLESS_SAMPLING = {"skip_special_tokens", "spaces_between_special_tokens", "stream_interval"}
_SUPPORTED_SAMPLING = {
    "max_new_tokens",
    "stop",
    "no_stop_trim",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
}
SAMPLING_KEYS = set(_UNSUPPORTED_SAMPLING_DEFAULTS) | _HARMLESS_SAMPLING | _SUPPORTED_SAMPLING


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_field(body: dict, key: str, kind: str, default: Any = None, required: bool = False, where: str = "") -> Any:
    """`body[key]` checked against `kind` (bool, int, number, str, str?, int_list, str_list, shape_list)."""
    name = f"{where}{key}"
    if key not in body or body[key] is None:
        if required:
            raise FieldError(f"{name}: required field is missing")
        return default
    value = body[key]
    checks = {
        "bool": lambda v: isinstance(v, bool),
        "int": _is_int,
        "number": _is_number,
        "str": lambda v: isinstance(v, str),
        "int_list": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
        "str_list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "shape_list": lambda v: (
            isinstance(v, list) and all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in v)
        ),
    }
    if not checks[kind](value):
        expected = {"int_list": "a list of integers", "str_list": "a list of strings"}.get(kind, kind)
        if kind == "shape_list":
            expected = "a list of shapes (lists of non-negative integers)"
        raise FieldError(f"{name}: expected {expected}, got {type(value).__name__} {str(value)[:80]}")
    return value


@dataclass
class GenerateBatch:
    """A parsed /generate call: its requests in input order and whether the body was a batch."""

    requests: list[GenRequest]
    is_batch: bool
    return_text_in_logprobs: bool


def _per_item(body: dict, key: str, n: int, is_batch: bool) -> list[Any]:
    value = body.get(key)
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise FieldError(f"{key}: a list of {len(value)} values for a batch of {n} prompts")
        return value
    return [value] * n


def _float_field(body: dict, key: str, default: float, where: str) -> float:
    value = get_field(body, key, "number", default, where=where)
    try:
        return float(value)
    except OverflowError:  # an integer beyond a float's range (a 400-digit temperature)
        raise FieldError(f"{where}{key}: an integer of {len(str(abs(value)))} digits is out of range") from None


MAX_STOP_COUNT = 32  # SGLang's limit on a request's stop strings


def _stop_strings(raw: dict, where: str, tokenizer: Any, req: GenRequest) -> None:
    """`stop` (a string or a list of them) as SGLang normalises it: the matching window is the longest stop
    string's token count + 1 (`stop_str_max_len`), and without a tokenizer stop strings are refused."""
    stop = raw.get("stop")
    stops = [stop] if isinstance(stop, str) else get_field(raw, "stop", "str_list", [], where=where)
    if not stops:
        return
    if len(stops) > MAX_STOP_COUNT:
        raise FieldError(f"{where}stop: at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
    if tokenizer is None:
        raise FieldError(f"{where}stop: this engine has no tokenizer to match stop strings with; use stop_token_ids")
    req.stop_strs = tuple(stops)
    req.stop_str_max_len = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stops)


def _sampling(raw: Any, where: str, info: ModelInfo, req: GenRequest, tokenizer: Any = None) -> None:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise FieldError(f"{where}: expected an object, got {type(raw).__name__}")
    for key in raw:
        if key not in SAMPLING_KEYS:
            raise FieldError(f"{where}.{key}: unknown sampling parameter")
    for key, default in _UNSUPPORTED_SAMPLING_DEFAULTS.items():
        value = raw.get(key)
        if value is not None and value != default and value not in ([], {}):
            raise FieldError(f"{where}.{key}: not supported by the local engine (only the default {default!r})")
    w = f"{where}."
    req.max_new_tokens = get_field(raw, "max_new_tokens", "int", 128, where=w)
    if req.max_new_tokens < 0:  # 0: a prefill only (SGLang's prompt scoring), no token generated
        raise FieldError(f"{w}max_new_tokens: must be at least 0, got {req.max_new_tokens}")
    req.temperature = _float_field(raw, "temperature", 1.0, w)
    if req.temperature < 0:
        raise FieldError(f"{w}temperature: must be >= 0, got {req.temperature}")
    req.top_p = _float_field(raw, "top_p", 1.0, w)
    if not 0 < req.top_p <= 1:
        raise FieldError(f"{w}top_p: must be in (0, 1], got {req.top_p}")
    req.top_k = get_field(raw, "top_k", "int", -1, where=w)
    if req.top_k < 1 and req.top_k != -1:
        raise FieldError(f"{w}top_k: must be -1 (all tokens) or >= 1, got {req.top_k}")
    if req.top_k >= info.vocab_size:
        req.top_k = -1
    req.sampling_seed = get_field(raw, "sampling_seed", "int", None, where=w)
    if req.sampling_seed is not None and not 0 <= req.sampling_seed < 2**63:
        raise FieldError(f"{w}sampling_seed: must be in [0, 2**63), got {req.sampling_seed}")
    _stop_strings(raw, w, tokenizer, req)
    req.no_stop_trim = get_field(raw, "no_stop_trim", "bool", False, where=w)
    stops = set(get_field(raw, "stop_token_ids", "int_list", [], where=w))
    if not get_field(raw, "ignore_eos", "bool", False, where=w):
        stops |= set(info.eos_token_ids)
    req.stop_token_ids = frozenset(stops)


def parse_generate(body: Any, info: ModelInfo, tokenizer: Any = None, max_prompts: int | None = None) -> GenerateBatch:
    """The requests of a /generate body (single or batch of at most `max_prompts`: the engine's
    --max-running-requests, so one request never queues more than the engine decodes at once)."""
    if not isinstance(body, dict):
        raise FieldError(f"body: expected a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        raise FieldError("stream: streaming is not supported by the local engine")
    if body.get("token_ids_logprob") is not None:
        raise FieldError("token_ids_logprob: not supported by the local engine")
    batch, is_batch = _prompts(body, info, tokenizer, max_prompts)
    n = len(batch)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == n:
        rids = rid
    else:
        raise FieldError(f"rid: expected a string or a list of {n} strings")
    samplings = _per_item(body, "sampling_params", n, is_batch)
    return_logprob = _per_item(body, "return_logprob", n, is_batch)
    start_lens = _per_item(body, "logprob_start_len", n, is_batch)
    top_nums = _per_item(body, "top_logprobs_num", n, is_batch)
    lora_paths = _per_item(body, "lora_path", n, is_batch)
    routed = get_field(body, "return_routed_experts", "bool", False)
    routed_start = get_field(body, "routed_experts_start_len", "int", 0)
    requests = []
    for i, ids in enumerate(batch):
        where = f"[{i}]" if is_batch else ""
        req = GenRequest(rid=rids[i], input_ids=list(ids))
        _sampling(samplings[i], f"sampling_params{where}", info, req, tokenizer)
        # a prefill only (max_new_tokens 0) may fill every position; a generation needs one more
        if len(ids) > info.max_positions - (req.max_new_tokens > 0):
            raise FieldError(f"input_ids{where}: {len(ids)} tokens reach the model's {info.max_positions} positions")
        lp = return_logprob[i]
        if lp is not None and not isinstance(lp, bool):
            raise FieldError(f"return_logprob{where}: expected bool, got {type(lp).__name__}")
        req.return_logprob = bool(lp)
        start = -1 if start_lens[i] is None else start_lens[i]
        if not _is_int(start):
            raise FieldError(f"logprob_start_len{where}: expected int, got {type(start).__name__}")
        req.logprob_start_len = start
        top = 0 if top_nums[i] is None else top_nums[i]
        if not _is_int(top) or not 0 <= top <= info.vocab_size:
            raise FieldError(f"top_logprobs_num{where}: expected an int in [0, {info.vocab_size}], got {top!r}")
        if top and req.max_new_tokens > 0:
            raise FieldError(
                f"top_logprobs_num{where}: the local engine serves it for a prefill only (max_new_tokens 0: the "
                "prompt's top log-probs), not for generated tokens"
            )
        req.top_logprobs_num = top
        req.return_routed_experts = routed and info.is_moe
        if routed and not 0 <= routed_start < len(ids):
            raise FieldError(f"routed_experts_start_len: {routed_start} is outside the prompt of {len(ids)} tokens")
        req.routed_experts_start_len = routed_start
        if lora_paths[i] is not None and not isinstance(lora_paths[i], str):
            raise FieldError(f"lora_path{where}: expected a string (a loaded adapter's name) or null")
        req.lora_name = lora_paths[i]
        requests.append(req)
    text_lp = get_field(body, "return_text_in_logprobs", "bool", False)
    return GenerateBatch(requests, is_batch, text_lp)


def _prompts(body: dict, info: ModelInfo, tokenizer: Any, max_prompts: int | None) -> tuple[list[list[int]], bool]:
    """The prompts' token ids and whether the body is a batch. Every prompt holds at least one token
    in the vocabulary: an empty one would fail the forward of every request prefilled with it."""
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if text is None:
            raise FieldError("input_ids: required (or text, when the engine has a tokenizer)")
        if tokenizer is None:
            raise FieldError("text: this engine has no tokenizer; send input_ids")
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise FieldError("text: expected a string or a non-empty list of strings")
        _check_count("text", len(texts), max_prompts)
        rows = []
        for i, prompt in enumerate(texts):
            where = f"text[{i}]" if is_batch else "text"
            if not prompt:
                raise FieldError(f"{where}: an empty prompt")
            encoded = tokenizer.encode(prompt)
            if not encoded:
                raise FieldError(f"{where}: {prompt[:40]!r} encodes to no tokens")
            rows.append((where, encoded))
    else:
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        batch = ids if is_batch else [ids]
        _check_count("input_ids", len(batch), max_prompts)
        rows = [(f"input_ids[{i}]" if is_batch else "input_ids", row) for i, row in enumerate(batch)]
    for where, row in rows:
        if not isinstance(row, list) or not row:
            raise FieldError(f"{where}: expected a non-empty list of token ids")
        bad = next((t for t in row if not _is_int(t) or not 0 <= t < info.vocab_size), None)
        if bad is not None or any(isinstance(t, bool) for t in row):
            raise FieldError(f"{where}: token {bad!r} is not an integer in [0, {info.vocab_size})")
    return [row for _, row in rows], is_batch


def _check_count(field: str, n: int, max_prompts: int | None) -> None:
    if max_prompts is not None and n > max_prompts:
        raise FieldError(
            f"{field}: a batch of {n} prompts is over this engine's limit of {max_prompts} per request "
            "(--max-running-requests)"
        )


# ---- weight updates ----

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


def parse_dtypes(values: list[str]) -> list[torch.dtype]:
    out = []
    for i, name in enumerate(values):
        key = name.removeprefix("torch.")
        if key not in _TORCH_DTYPES:
            raise FieldError(f"dtypes[{i}]: {name!r} is not a floating dtype; allowed: {sorted(_TORCH_DTYPES)}")
        out.append(_TORCH_DTYPES[key])
    return out


@dataclass
class UpdateOptions:
    """Fields every weight update shares."""

    weight_version: str | None
    flush_cache: bool
    abort_all_requests: bool

    @classmethod
    def parse(cls, body: dict) -> UpdateOptions:
        return cls(
            weight_version=get_field(body, "weight_version", "str"),
            flush_cache=get_field(body, "flush_cache", "bool", True),
            abort_all_requests=get_field(body, "abort_all_requests", "bool", False),
        )


@dataclass
class DistributedUpdate:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    group_name: str
    flattened: bool
    options: UpdateOptions

    @classmethod
    def parse(cls, body: dict) -> DistributedUpdate:
        names = get_field(body, "names", "str_list", required=True)
        dtypes = parse_dtypes(get_field(body, "dtypes", "str_list", required=True))
        shapes = get_field(body, "shapes", "shape_list", required=True)
        if not len(names) == len(dtypes) == len(shapes):
            raise FieldError(f"names/dtypes/shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})")
        load_format = get_field(body, "load_format", "str")
        if load_format not in (None, "flattened_bucket"):
            raise FieldError(f"load_format: {load_format!r}; allowed: null, 'flattened_bucket'")
        selector = get_field(body, "selector", "str", "all")
        if selector not in ("all", "target"):
            raise FieldError(f"selector: {selector!r}; the local engine has no draft model (allowed: all, target)")
        if not names:
            raise FieldError("names: empty; nothing to update")
        group = get_field(body, "group_name", "str", "weight_update_group")
        flattened = load_format == "flattened_bucket"
        if flattened:
            try:
                flattened_layout(names, dtypes, shapes)
            except ValueError as err:
                raise FieldError(f"shapes: {err}") from None
        return cls(names, dtypes, shapes, group, flattened, UpdateOptions.parse(body))


def check_body(body: Any) -> dict:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise FieldError(f"body: expected a JSON object, got {type(body).__name__}")
    return body
