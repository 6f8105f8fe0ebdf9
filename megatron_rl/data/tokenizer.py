"""Loading the policy's tokenizer from a local Hugging Face folder, checked against the model's vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.data.readers import DataError

# what a Hugging Face folder holds a tokenizer in (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether `folder` holds a tokenizer's vocabulary file (config files alone load an empty tokenizer)."""
    return any(any(Path(folder).glob(pattern)) for pattern in TOKENIZER_FILES)


def check_tokenizer_vocab(tokenizer: Any, vocab_size: int, path: str | Path, key: str) -> None:
    """DataError naming `key` = `path` when the tokenizer cannot be the model's: token ids past the
    embedding (more tokens than `vocab_size`), or a folder without a vocabulary file (transformers
    then loads a tokenizer of one token, silently). Fewer tokens than embedding rows is normal:
    vocabularies are padded, and a small tokenizer may drive a larger model."""
    n = len(tokenizer)
    if n > vocab_size:
        raise DataError(
            f"{key} = {str(path)!r}: the tokenizer has {n} tokens, more than the model's vocabulary "
            f"(model.vocab_size = {vocab_size}, from config.json): ids past {vocab_size - 1} have no embedding"
        )
    if not has_tokenizer_files(path):
        raise DataError(
            f"{key} = {str(path)!r}: the tokenizer has {n} tokens for a model vocabulary of {vocab_size}: the "
            f"folder has none of {', '.join(TOKENIZER_FILES)}; set data.tokenizer_path to the model's tokenizer folder"
        )


def load_tokenizer(path: str | Path, key: str = "data.tokenizer_path", vocab_size: int | None = None) -> Any:
    """`AutoTokenizer.from_pretrained(path)` offline; `key` names the setting that gave the path in errors.
    With `vocab_size` (the model's), the tokenizer is checked against it (`check_tokenizer_vocab`)."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"{key} = {str(path)!r}: no such tokenizer folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # transformers raises OSError/ValueError/... for unusable folders
        raise DataError(f"{key} = {str(path)!r}: not a loadable Hugging Face tokenizer folder: {err}") from err
    if vocab_size is not None:
        check_tokenizer_vocab(tokenizer, vocab_size, path, key)
    return tokenizer
