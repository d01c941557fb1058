"""Tokenizers: byte-level by default, or a Hugging Face tokenizer from a local directory or file.

The byte tokenizer maps each UTF-8 byte b to id ``b + 3`` and reserves 0 (pad), 1 (BOS), 2 (EOS),
so any text round-trips and a model with ``vocab_size >= 259`` can serve it.

`HFTokenizer.from_dir` reads what ``save_pretrained`` writes next to a model: ``tokenizer.json``
(through the ``tokenizers`` package), ``tokenizer_config.json`` (BOS/EOS/pad tokens,
``add_bos_token``/``add_eos_token``, the chat template, also from ``chat_template.jinja`` or
``chat_template.json``) and ``generation_config.json`` (EOS ids, possibly several; config.json's
when there is none). Generation stops at any of `Tokenizer.eos_ids`. Chat prompts are the model's
own template rendered as transformers renders it (`serve_jax.chat_template`) and tokenized without
adding special tokens (the template writes them). Text is produced incrementally, one token at a
time (`Tokenizer.decoder`: the ``tokenizers`` `DecodeStream` primed with the prompt's tail, or an
incremental UTF-8 decoder for bytes), so detokenizing a request is linear in its length and a
character split over several tokens appears once it is complete. Special tokens are left out of
the text, as vLLM does. Nothing is downloaded.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.decoders import DecodeStream

from serve_jax.chat_template import ChatTemplate
from serve_jax.hf_config import read_json

__all__ = [
    "Tokenizer",
    "IncrementalDecoder",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "BYTE_CHAT_TEMPLATE",
]

BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The byte tokenizer's chat format: ``<|role|>`` lines, then ``<|assistant|>``."""

_PRIME_TOKENS = 6
"""Prompt tokens a decode stream starts from, so the first output token decodes in context."""


class IncrementalDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """Text completed by ``token_id`` ("" while a character is still incomplete)."""
        ...

    def flush(self) -> str:
        """At the end: the text of tokens still held back (an incomplete character's U+FFFD)."""
        ...


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decoder(self, prompt_ids: list[int]) -> IncrementalDecoder: ...

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]: ...


class _ByteDecoder:
    def __init__(self, offset: int):
        self._offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        b = token_id - self._offset
        return self._utf8.decode(bytes([b])) if 0 <= b < 256 else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes shifted by 3; BOS is prepended by `encode`."""

    OFFSET = 3
    vocab_size = 256 + OFFSET

    def __init__(self, add_bos: bool = True):
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = frozenset({self.eos_id})
        self.add_bos = add_bos
        self.chat_template = ChatTemplate(BYTE_CHAT_TEMPLATE)

    def encode(self, text: str) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def decoder(self, prompt_ids: list[int]) -> IncrementalDecoder:
        return _ByteDecoder(self.OFFSET)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt of a chat (BOS, then the ``<|role|>`` format)."""
        return self.encode(self.chat_template.render(messages))


class _StreamDecoder:
    """`DecodeStream`, plus the few ids `flush` needs to decode what the stream holds back."""

    def __init__(self, tok: _RustTokenizer, prime: list[int]):
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        for token_id in prime:  # the prompt's tail: text already shown, the context of the next
            self._stream.step(tok, token_id)
        self._context = prime  # ids whose text is out (a few), then those held back
        self._held: list[int] = []

    def step(self, token_id: int) -> str:
        chunk = self._stream.step(self._tok, token_id)
        if chunk is None:
            self._held.append(token_id)
            return ""
        self._context = [*self._context, *self._held, token_id][-_PRIME_TOKENS:]
        self._held = []
        return chunk

    def flush(self) -> str:
        if not self._held:
            return ""
        base = self._tok.decode(self._context, skip_special_tokens=True)
        full = self._tok.decode([*self._context, *self._held], skip_special_tokens=True)
        self._held = []
        return full[len(base) :] if full.startswith(base) else full


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template_source(d: Path, tok_cfg: dict[str, Any]) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    source = tok_cfg.get("chat_template")
    if source is None and (d / "chat_template.json").is_file():
        source = read_json(d / "chat_template.json").get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


class HFTokenizer:
    """A ``tokenizers`` tokenizer from a local ``tokenizer.json`` (and its directory's configs).

    Args:
      path: the ``tokenizer.json`` file.
      bos_token, eos_token, pad_token: special tokens by text (None: none).
      eos_ids: further ids that end generation (generation_config.json's).
      add_bos, add_eos: add BOS/EOS around encoded text; None leaves it to tokenizer.json's
        post-processor (what transformers does without ``add_bos_token`` in the config).
      chat_template: the Jinja chat template (None: `chat_ids` raises).

    Raises:
      FileNotFoundError: no such file.
      ValueError: a file that is not a ``tokenizer.json`` (its contents are not echoed), or a
        special token the vocabulary lacks.
    """

    def __init__(
        self,
        path: str | Path,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        eos_ids: tuple[int, ...] = (),
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        chat_template: str | None = None,
    ):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception:  # tokenizers raises a bare Exception whose text may quote the file
            raise ValueError(f"{str(path)!r} is not a tokenizer.json file") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._id(bos_token, "bos_token", path)
        self.eos_id = self._id(eos_token, "eos_token", path)
        self.pad_id = self._id(pad_token, "pad_token", path)
        self.eos_ids = frozenset([*eos_ids, *([self.eos_id] if self.eos_id is not None else [])])
        self.add_bos, self.add_eos = add_bos, add_eos
        specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        self.chat_template = ChatTemplate(chat_template, specials) if chat_template else None

    def _id(self, token: str | None, field: str, path: Path) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{field} {token!r} is not in the vocabulary of {str(path)!r}")
        return tid

    @classmethod
    def from_dir(cls, directory: str | Path) -> HFTokenizer:
        """The tokenizer saved in a model directory (see the module docstring).

        Raises:
          FileNotFoundError: no tokenizer.json in ``directory``.
          ValueError: a config file that is not JSON, or an unknown special token.
        """
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{str(d)!r} has no tokenizer.json (only fast tokenizers are read; set "
                "model.tokenizer to one)"
            )
        tok_cfg = (
            read_json(d / "tokenizer_config.json")
            if (d / "tokenizer_config.json").is_file()
            else {}
        )
        if (d / "generation_config.json").is_file():
            gen = read_json(d / "generation_config.json")
        elif (d / "config.json").is_file():
            gen = read_json(d / "config.json")
        else:
            gen = {}
        add_bos = tok_cfg.get("add_bos_token")
        add_eos = tok_cfg.get("add_eos_token")
        return cls(
            d / "tokenizer.json",
            bos_token=_token_text(tok_cfg.get("bos_token")),
            eos_token=_token_text(tok_cfg.get("eos_token")),
            pad_token=_token_text(tok_cfg.get("pad_token")),
            eos_ids=tuple(_eos_list(gen.get("eos_token_id"))),
            add_bos=add_bos if isinstance(add_bos, bool) else None,
            add_eos=add_eos if isinstance(add_eos, bool) else None,
            chat_template=_chat_template_source(d, tok_cfg),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS/EOS as the tokenizer's config says."""
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos is None and self.add_eos is None:
            return self._tok.encode(text).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if self.add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decoder(self, prompt_ids: list[int]) -> IncrementalDecoder:
        return _StreamDecoder(self._tok, list(prompt_ids[-_PRIME_TOKENS:]))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The chat prompt text from the model's template.

        Raises:
          ValueError: the tokenizer has no chat template, or the template rejected ``messages``.
        """
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        return self.chat_template.render(messages, add_generation_prompt)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids of a chat: the rendered template, no special tokens added."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def load_tokenizer(path: str | None) -> Tokenizer:
    """`ByteTokenizer` for None, else a model directory's tokenizer or a ``tokenizer.json``."""
    if not path:
        return ByteTokenizer()
    if Path(path).is_dir():
        return HFTokenizer.from_dir(path)
    return HFTokenizer(path)
