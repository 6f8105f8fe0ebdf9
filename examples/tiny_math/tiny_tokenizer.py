"""A character-level tokenizer for tiny_math, saved as a Hugging Face tokenizer folder.

28 tokens: 6 special tokens (<|pad|> = 0, <|eos|> = 1, <|unk|>, <|system|>, <|user|>, <|assistant|>)
and the 22 characters of the task (digits, `+*=:`, space, newline and the letters of "Answer"). No
BOS. The chat template keeps prompts short: `<|user|>2+4*5=<|assistant|>` (8 tokens), and an
assistant turn ends with <|eos|>. `transformers.AutoTokenizer.from_pretrained(folder)` loads it
offline; tokenizer_config.json uses the class name `PreTrainedTokenizerFast` so that older
transformers (as SGLang may pin) load it too.

Usage: python examples/tiny_math/tiny_tokenizer.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAD, EOS, UNK = "<|pad|>", "<|eos|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, EOS, UNK, *ROLE_TOKENS)
CHARACTERS = "0123456789+*=:" + " \n" + "Answer"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}<|eos|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
MAX_LENGTH = 256


def vocabulary(characters: str = CHARACTERS, role_tokens: tuple[str, ...] = ROLE_TOKENS) -> dict[str, int]:
    tokens = [PAD, EOS, UNK, *role_tokens, *dict.fromkeys(characters)]
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer(
    out: Path | None = None,
    *,
    characters: str = CHARACTERS,
    role_tokens: tuple[str, ...] = ROLE_TOKENS,
    words: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """The tokenizer (a transformers fast tokenizer); saved to `out` when given. The defaults are
    tiny_math's; other examples pass their own characters, role tokens, chat template and `words`
    (multi-character tokens that are not special: kept by `decode(skip_special_tokens=True)`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocabulary(characters, role_tokens), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    core.decoder = decoders.Fuse()  # join the characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(role_tokens),
        model_max_length=MAX_LENGTH,
    )
    if words:
        tokenizer.add_tokens(list(words))
    tokenizer.chat_template = chat_template
    if out is not None:
        save_tokenizer(tokenizer, out)
    return tokenizer


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """save_pretrained, then a tokenizer_config.json that transformers 4.x and 5.x both read (the
    role tokens and chat template are the tokenizer's own)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("backend", None)
    config.pop("extra_special_tokens", None)
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        additional_special_tokens=list(tokenizer.extra_special_tokens),
        chat_template=tokenizer.chat_template,
        model_max_length=MAX_LENGTH,
    )
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def tokenizer_main(doc: str, build: Callable[[Path], Any], argv: list[str] | None = None) -> int:
    """The command line of a tokenizer script (this one, tiny_tools'): `build(--out)`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="tokenizer folder to write")
    args = parser.parse_args(argv)
    tokenizer = build(args.out)
    print(f"tokenizer: {args.out} ({len(tokenizer)} tokens)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return tokenizer_main(__doc__, build_tokenizer, argv)


if __name__ == "__main__":
    raise SystemExit(main())
