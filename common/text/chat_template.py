"""A checkpoint's chat template rendered as transformers' apply_chat_template renders it:
jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
extension, `tojson` (no HTML escaping), `raise_exception`, `strftime_now`; the template sees
`messages` (role and content), `add_generation_prompt`, `tools` and `documents` (None) and the
named special tokens (bos_token, eos_token, ...). The rendered text is then tokenized without
adding special tokens (the template writes them).

`{% generation %}...{% endgeneration %}` blocks render their body (transformers uses them only
for assistant masks). Not covered: tools, documents, multimodal content parts and
continue_final_message (the template sees none of them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or refused the conversation; the message
    says which."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _generation_extension():
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        """{% generation %} body {% endgeneration %} -> body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return GenerationBlock


class ChatTemplate:
    """One compiled template; render() is pure (a new context per call)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols,
                                                        _generation_extension()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"the model's chat template does not compile: {err}") from None
        self._errors = jinja2.exceptions.TemplateError
        self.special_tokens = dict(special_tokens)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(
                **self.special_tokens, messages=conversation, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt)
        except self._errors as err:
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
        except (TypeError, ValueError, KeyError, IndexError) as err:
            raise ChatTemplateError(f"the chat template failed on the messages: {err}") from None
