"""A row's prompt value (a string or chat messages) as the text the model sees."""

from __future__ import annotations

from typing import Any


class PromptFormatError(ValueError):
    """A prompt value that cannot be rendered; `reason` is the skip-count key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def as_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages from a prompt value: a string becomes one user message; a list must hold
    {role, content} string pairs."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        if not value:
            raise PromptFormatError("empty_prompt", "the prompt is an empty message list")
        messages = []
        for i, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise PromptFormatError("bad_type", f"message {i} is not a {{role, content}} mapping with text content")
            if not isinstance(message.get("role"), str):
                raise PromptFormatError("bad_type", f"message {i} has no string 'role'")
            messages.append({"role": message["role"], "content": message["content"]})
    else:
        raise PromptFormatError("bad_type", f"the prompt is a {type(value).__name__}, not a string or a message list")
    if not any(m["content"].strip() for m in messages):
        raise PromptFormatError("empty_prompt", "the prompt has no text")
    return messages


def uses_chat_template(tokenizer: Any, apply_chat_template: bool) -> bool:
    """Whether prompts go through the tokenizer's chat template (enabled and the tokenizer has one)."""
    return bool(apply_chat_template and getattr(tokenizer, "chat_template", None))


def render_prompt(value: Any, tokenizer: Any, use_template: bool) -> str:
    """The prompt text: the chat template with the generation prompt appended, or, without a template,
    the messages' contents joined by newlines (roles dropped)."""
    return _render(as_messages(value), tokenizer, use_template)


class PromptRenderer:
    """render_prompt with a cache: datasets such as DAPO-Math-17k repeat each prompt many times, and a
    Jinja render costs far more than the lookup."""

    def __init__(self, tokenizer: Any, use_template: bool) -> None:
        self.tokenizer = tokenizer
        self.use_template = use_template
        self.cache: dict[tuple[tuple[str, str], ...], str] = {}

    def __call__(self, value: Any) -> str:
        messages = as_messages(value)
        key = tuple((m["role"], m["content"]) for m in messages)
        text = self.cache.get(key)
        if text is None:
            text = self.cache[key] = _render(messages, self.tokenizer, self.use_template)
        return text


def _render(messages: list[dict[str, str]], tokenizer: Any, use_template: bool) -> str:
    if not use_template:
        return "\n".join(m["content"] for m in messages)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a Jinja template may raise anything (e.g. on unexpected roles)
        raise PromptFormatError("template_error", f"the chat template failed: {err}") from err
