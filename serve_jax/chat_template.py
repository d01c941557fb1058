"""Chat templates: a model's Jinja template rendered the way transformers renders it.

transformers' ``apply_chat_template`` compiles the template in an immutable sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and its
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII characters, and the globals
``raise_exception`` and ``strftime_now``; it renders with ``messages``, ``add_generation_prompt``,
``tools``, ``documents`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).
`ChatTemplate` does the same, so a prompt is the very text the model was trained on. A template
that raises (``raise_exception``) or fails is a ValueError naming the chat template.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate"]


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound.

    Args:
      source: the Jinja template text.
      special_tokens: variables every render sees (``bos_token``, ``eos_token``, ...).

    Raises:
      ValueError: a template that does not compile.
    """

    def __init__(self, source: str, special_tokens: dict[str, Any] | None = None):
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and ``content``).

        Raises:
          ValueError: the template rejected the conversation (its ``raise_exception`` message)
            or failed.
        """
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None
