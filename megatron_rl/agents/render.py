"""The gateway's tokenizer work, off its event loop: the render threads and a conversation's fresh render.

`RenderPool`: everything of a call that touches the tokenizer or grows with the request (parsing the
body, rendering and tokenizing the messages, decoding the answer) runs on one of `RENDER_THREADS`
threads ("gateway-render"), never on the gateway's event loop, so a large message delays its own
episode only. Each thread renders with its own copy of the tokenizer, made on its first call: a
tokenizer's `split_special_tokens` switch is state of the tokenizer object, and two threads
tokenizing with one tokenizer at once turn a template's delimiters into text or a message's text
into control tokens.

`fresh_ids`: the first call's and a rewritten history's prompt. The template renders the
conversation as a whole; special-token text inside the messages and tools stays text, as in an
environment's observations (`TurnRenderer.plain_ids`), so only the template's own delimiters are
control tokens.
"""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from megatron_rl.envs.episodes import TurnRenderer

T = TypeVar("T")
RENDER_THREADS = 4


class RenderPool:
    """`RENDER_THREADS` threads, each rendering with its own `TurnRenderer` over a copy of `renderer`'s tokenizer."""

    def __init__(self, renderer: TurnRenderer, threads: int = RENDER_THREADS) -> None:
        self._tokenizer = renderer.tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-render")

    def _renderer(self) -> TurnRenderer:
        renderer = getattr(self._local, "renderer", None)
        if renderer is None:
            renderer = self._local.renderer = TurnRenderer(copy.deepcopy(self._tokenizer))
        return renderer

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(renderer, *args)` on a render thread, with that thread's renderer."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._renderer(), *args))

    def close(self) -> None:
        """Queued renders are dropped; one that runs ends on its thread (its episode was left out)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def fresh_ids(renderer: TurnRenderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The chat template's tokens of `messages` (with `tools`), then the assistant header: `first_ids`,
    except that each special token's text inside a message or tool is swapped for a mark before the
    template renders, and the mark's place tokenized as plain text (`plain_ids`; ValueError when the
    tokenizer cannot split it) between the template's text tokenized as usual."""
    tok = renderer.tokenizer
    texts = sorted({tok.decode([i]) for i in renderer.special_ids} - {""}, key=len, reverse=True)
    special = re.compile("|".join(map(re.escape, texts))) if texts else None
    nonce = secrets.token_hex(8)  # letters and digits: a mark passes a template's filters (tojson) unchanged
    mark_of = {text: f"mrl{nonce}t{k}e" for k, text in enumerate(texts)}
    found = False

    def marked(value: Any) -> Any:
        nonlocal found
        if isinstance(value, str):
            new = special.sub(lambda m: mark_of[m.group()], value)
            found = found or new != value
            return new
        if isinstance(value, list):
            return [marked(v) for v in value]
        if isinstance(value, dict):
            return {marked(k): marked(v) for k, v in value.items()}
        return value

    if special is not None:
        messages, tools = marked(messages), marked(tools)
    if not found:
        return renderer.first_ids(messages, tools)
    kwargs = {"tools": tools} if tools else {}
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    text_of = {mark: text for text, mark in mark_of.items()}
    ids: list[int] = []
    for k, piece in enumerate(re.split(f"(mrl{nonce}t\\d+e)", rendered)):
        if k % 2:
            ids += renderer.plain_ids(text_of[piece])
        elif piece:
            ids += tok.encode(piece, add_special_tokens=False)
    return [int(i) for i in ids]
