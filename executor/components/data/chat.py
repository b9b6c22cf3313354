"""Chat templates: a conversation rendered as the model's chat format, and which characters the assistant wrote.

The template is the Jinja source a Hugging Face tokenizer ships (`chat_template.jinja`, or
`chat_template` in `tokenizer_config.json`), rendered the way transformers' `apply_chat_template`
renders it: a sandboxed environment with trim_blocks and lstrip_blocks, the loop-controls
extension, a `tojson` filter that does not escape HTML, `raise_exception(msg)`, and the
tokenizer's special tokens (bos_token, eos_token, ...) as variables. One difference on purpose:
`strftime_now(fmt)` formats a fixed date (FIXED_NOW, the date Llama 3.1's own template defaults
to) instead of today, so that the tokens of a corpus are a function of the corpus and the
tokenizer alone, whichever day or node tokenizes it.

Which characters count in the loss (the assistant's), in one of two ways:
  * a template with `{% generation %}...{% endgeneration %}` blocks marks them itself (as for
    transformers' `return_assistant_tokens_mask`);
  * otherwise turn by turn: for each assistant message i, the conversation up to message i with
    the generation prompt is a prefix of the whole rendering, and so is the conversation up to
    and including message i; the characters between the two are the assistant's turn (its
    content and whatever closes the turn, such as `<|im_end|>`). A template that does not render
    conversations prefix by prefix is refused with that explanation: marking would be a guess.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

FIXED_NOW = datetime(2024, 7, 26)


class TemplateRefused(Exception):
    """The template raised, or cannot tell the assistant's characters; the message says why."""


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(jinja2.ext.Extension):
        """`{% generation %}body{% endgeneration %}`: renders body and records where it landed in the output."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            recorder = self.environment.recorder
            if recorder is not None:
                start = sum(len(block) for block in recorder["blocks"])
                recorder["spans"].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    env.recorder = None
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = FIXED_NOW.strftime
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template and the tokenizer's special tokens it renders with."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2

        self.source, self.special_tokens = source, dict(special_tokens)
        try:
            self.template = _compile(source)
        except jinja2.TemplateError as exc:
            raise TemplateRefused(f"the chat template does not compile: {exc}") from None
        self.marks_generation = re.search(r"{%[-+]?\s*generation\s*[-+]?%}", source) is not None

    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        return self._render(messages, add_generation_prompt, None)

    def _render(self, messages: list, add_generation_prompt: bool, recorder: dict | None) -> str:
        import jinja2

        env = self.template.environment
        env.recorder = recorder
        blocks = recorder["blocks"] if recorder is not None else []
        try:
            for block in self.template.generate(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt, **self.special_tokens):
                blocks.append(block)
        except jinja2.TemplateError as exc:
            raise TemplateRefused(f"the chat template refused the conversation: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise TemplateRefused(f"the chat template failed on this conversation ({type(exc).__name__}: {exc})") \
                from None
        finally:
            env.recorder = None
        return "".join(blocks)

    def assistant_spans(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, [start, end) character spans of the assistant's turns)."""
        if self.marks_generation:
            recorder: dict = {"blocks": [], "spans": []}
            text = self._render(messages, False, recorder)
            return text, recorder["spans"]
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise TemplateRefused(
                    f"the chat template does not render this conversation prefix by prefix (at messages[{i}]), so "
                    "the assistant's tokens cannot be told apart; mark them in the template with "
                    "{% generation %}...{% endgeneration %} (transformers' convention)")
            spans.append((len(before), len(through)))
        return text, spans
