"""Tokenizers: byte-level by default, or a local ``tokenizer.json`` via the ``tokenizers`` package.

The byte tokenizer maps each UTF-8 byte b to id ``b + 3`` and reserves 0 (pad), 1 (BOS), 2 (EOS),
so any text round-trips and a model with ``vocab_size >= 259`` can serve it. Nothing is
downloaded: a ``tokenizer.json`` must already be on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by 3; BOS is prepended by `encode`."""

    OFFSET = 3
    vocab_size = 256 + OFFSET

    def __init__(self, add_bos: bool = True):
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a file that is not a ``tokenizer.json`` (its contents are not echoed).
    """

    def __init__(
        self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None
    ):
        from tokenizers import Tokenizer as _Tok  # optional: only for a tokenizer.json

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception:  # tokenizers raises a bare Exception whose text may quote the file
            raise ValueError(f"{str(path)!r} is not a tokenizer.json file") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id = self._tok.token_to_id(bos_token) if bos_token else None
        self.eos_id = self._tok.token_to_id(eos_token) if eos_token else None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text).ids
        return [self.bos_id, *ids] if self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(path: str | None) -> Tokenizer:
    """`ByteTokenizer` when ``path`` is None, else the ``tokenizer.json`` at ``path``."""
    return ByteTokenizer() if not path else HFTokenizer(path)
