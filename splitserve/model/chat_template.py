"""Render Hugging Face-style Jinja chat templates.

The environment mirrors what `transformers` gives templates, because the templates shipped
with models are written against it: a sandbox (templates come from downloaded files),
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, `raise_exception`,
`strftime_now`, and a `tojson` that keeps non-ASCII text and does not HTML-escape (Jinja's
built-in one escapes `<`, `>` and `&`, which would change the prompt the model sees).
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)


class TemplateRaisedError(jinja2.TemplateError):
    """The template itself called `raise_exception(...)`: its message is for the user."""


def _raise_exception(message: str):
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text; compilation costs milliseconds, rendering
    microseconds, and every chat request renders."""
    return _environment().from_string(source)


def render_chat_template(source: str, messages: list[dict], **context) -> str:
    """Render `source` with `messages` and any extra variables (add_generation_prompt,
    tools, bos_token, ...). Template and rendering errors propagate to the caller."""
    return compile_template(source).render(messages=messages, **context)
