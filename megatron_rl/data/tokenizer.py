"""Loading the policy's tokenizer from a local Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.data.readers import DataError


def load_tokenizer(path: str | Path, key: str = "data.tokenizer_path") -> Any:
    """`AutoTokenizer.from_pretrained(path)` offline; `key` names the setting that gave the path in errors."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"{key} = {str(path)!r}: no such tokenizer folder")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # transformers raises OSError/ValueError/... for unusable folders
        raise DataError(f"{key} = {str(path)!r}: not a loadable Hugging Face tokenizer folder: {err}") from err
