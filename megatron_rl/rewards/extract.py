"""Finding the final answer in a response: the last `Answer:` line, or the last `\\boxed{...}`."""

from __future__ import annotations

import re

# DAPO / Minerva: "Answer:" (any case), then the rest of that line. `[ \t]*` rather than `\s*` so
# that an empty "Answer:" line does not take its answer from the next line.
_ANSWER_LINE = re.compile(r"answer[ \t]*:[ \t]*([^\n]*)", re.IGNORECASE)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_SPACE_BOX_ARG = re.compile(r" +([^\s$]+)")  # the space form: \boxed 5

DAPO_WINDOW_CHARS = 300


def extract_answer_line(text: str, window: int = DAPO_WINDOW_CHARS) -> str | None:
    """The text after the last "Answer:" within the last `window` characters, or None."""
    matches = _ANSWER_LINE.findall(text[-window:] if window > 0 else text)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; `\\boxed 5`
    (space form) gives "5". None when there is no box or its braces are unbalanced."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    box = _box_at(text, start + len(command))
    return box[0] if box else None


def strip_boxed(text: str) -> str:
    """`\\boxed{x}` -> `x` when the whole (stripped) text is one box; otherwise the text unchanged."""
    stripped = text.strip()
    for command in _BOX_COMMANDS:
        if stripped.startswith(command):
            box = _box_at(stripped, len(command))
            if box and box[1] == len(stripped):
                return box[0]
    return text


def _box_at(text: str, i: int) -> tuple[str, int] | None:
    """(content, end index) of the box argument that starts at text[i] (just after the command)."""
    j = i
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return text[j + 1 : k], k + 1
        return None
    match = _SPACE_BOX_ARG.match(text, i)
    return (match.group(1), match.end()) if match else None
