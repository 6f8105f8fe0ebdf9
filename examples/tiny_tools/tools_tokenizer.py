"""The tiny_tools tokenizer: tiny_math's character-level builder with a tool role and tool-call words.

Tokens: <|pad|> = 0, <|eos|> = 1, <|unk|>, the role tokens <|system|>, <|user|>, <|assistant|>,
<|tool|> (special), the 95 printable ASCII characters and newline (so any tool output, error
messages included, is tokenized without <|unk|>), then six words that are NOT special tokens (a
turn decoded with `skip_special_tokens=True` keeps them, so the environment parses the call):
`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` (single tokens, as in Qwen's
vocabulary) and the two constant pieces of a calculator call's JSON, CALL_PREFIX and CALL_SUFFIX
(as a BPE vocabulary merges a phrase it sees this often): a call is 11 tokens instead of 85.

The chat template renders a tool message as `<|tool|><tool_response>RESULT</tool_response>` and,
like tiny_math's, ends an assistant turn with <|eos|>:

    <|user|>123*456=<|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><|eos|>
    <|tool|><tool_response>56088</tool_response><|assistant|>Answer: 56088<|eos|>

(one line, split here).

Usage: python examples/tiny_tools/tools_tokenizer.py --out DIR
"""

from __future__ import annotations

import string
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny_math"))  # tiny_math's builders

from tiny_tokenizer import ROLE_TOKENS, tokenizer_main  # noqa: E402
from tiny_tokenizer import build_tokenizer as build_character_tokenizer  # noqa: E402

TOOL_ROLE = "<|tool|>"
CALL_PREFIX = '{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}'
WORDS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_PREFIX, CALL_SUFFIX)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>"
    "{%- if message['role'] == 'tool' -%}<tool_response>{{ message['content'] }}</tool_response>"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}<|eos|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tokenizer(out: Path | None = None) -> Any:
    """The tiny_tools tokenizer; saved to `out` when given."""
    return build_character_tokenizer(
        out,
        characters=CHARACTERS,
        role_tokens=(*ROLE_TOKENS, TOOL_ROLE),
        words=WORDS,
        chat_template=CHAT_TEMPLATE,
    )


def main(argv: list[str] | None = None) -> int:
    return tokenizer_main(__doc__, build_tokenizer, argv)


if __name__ == "__main__":
    raise SystemExit(main())
