"""The tokenizer of `--tokenizer`: a Hugging Face `tokenizer.json` (or the directory holding it), run with the
`tokenizers` library, and how each kind of document becomes token ids and a loss mask.

Where it comes from (`resolve_tokenizer`): `--tokenizer PATH` when given, else the `--init-from`
model directory (its tokenizer is the model's). Beside `tokenizer.json` the directory may hold
`tokenizer_config.json` (eos_token, the special tokens, chat_template), `special_tokens_map.json`
and `chat_template.jinja` (which wins over the config's template, as in transformers 5).

Each document becomes tokens as transformers would make them (tests/consumers compares with
`AutoTokenizer`), then the end-of-document token:
  * text: `encode(text)` with the tokenizer's special tokens (a BOS where its post-processor
    adds one, as Llama's does and Qwen's does not); every token counts;
  * prompt + completion: `encode(prompt + completion)` likewise; a token counts when it holds a
    character of the completion (transformers' char_to_token rule), and so does the EOS after it;
  * messages: the chat template's rendering, encoded without added special tokens (the template
    writes its own BOS); a token counts when it holds a character of an assistant turn
    (executor/components/data/chat.py); the EOS after the conversation does not.
EOS follows every document unless its last token already is EOS: documents are packed into one
stream, and EOS is where one ends.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor.components.data.chat import ChatTemplate, TemplateRefused
from executor.components.data.documents import Record, where
from topologies.errors import UsageError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# End-of-document tokens tried, in order, when no config names eos_token (a bare tokenizer.json).
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|end|>")


def resolve_tokenizer(tokenizer: str | None, init_from: str | None = None) -> Path | None:
    """The tokenizer a run uses: --tokenizer, else the --init-from directory, else None."""
    chosen = tokenizer if tokenizer is not None else init_from
    return Path(chosen) if chosen is not None else None


def run_tokenizer(flags) -> Path | None:
    """The tokenizer of a run (planner.run_flags.RunFlags): --tokenizer, else the directory its weights come from
    (--init-from, or the plan's weights_dir; none under `--init-from none`)."""
    return resolve_tokenizer(flags.tokenizer, flags.weights_source)


def tokenizer_files(path: Path) -> tuple[Path, list[Path]]:
    """(tokenizer.json, the config files beside it that exist); UsageError when there is no tokenizer.json."""
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            hint = (" (it holds a sentencepiece tokenizer.model: save it as tokenizer.json with transformers, "
                    "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))" if (path / "tokenizer.model").exists()
                    else "")
            raise UsageError(f"--tokenizer {str(path)!r} has no {TOKENIZER_FILE}{hint}")
    elif path.is_file():
        file = path
    else:
        raise UsageError(f"--tokenizer {str(path)!r} does not exist: give a tokenizer.json or a Hugging Face "
                         "model directory holding one")
    configs = [file.parent / name for name in CONFIG_FILES] if file.name == TOKENIZER_FILE else []
    return file, [c for c in configs if c.is_file()]


def tokenizer_sha256(path: Path) -> str:
    """Hash of everything that decides the tokens: tokenizer.json and the config files beside it."""
    file, configs = tokenizer_files(path)
    digest = hashlib.sha256()
    for f in (file, *configs):
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {str(file)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{str(file)!r} is not a JSON object")
    return data


@dataclass
class Encoded:
    """One document's tokens and, where the loss counts only part of it, which tokens count."""

    ids: np.ndarray  # int64
    counted: np.ndarray | None  # bool per token, None when every token counts


class TextTokenizer:
    """tokenizer.json run by the `tokenizers` library, with its EOS, special tokens and chat template."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = path
        file, configs = tokenizer_files(path)
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library raises plain Exception for a malformed file
            raise UsageError(f"cannot load {str(file)!r} with the tokenizers library: {exc}") from None
        settings: dict = {}
        template = None
        for config in configs:  # special_tokens_map.json after tokenizer_config.json: the config wins
            if config.suffix == ".jinja":
                template = config.read_text(encoding="utf-8")
                continue
            for key, value in _read_json(config).items():
                settings.setdefault(key, value)
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(settings.get(k))) is not None}
        self.eos_token = self._eos(self.special_tokens.get("eos_token"), file)
        self.eos_id = self.tokenizer.token_to_id(self.eos_token)
        self.special_tokens.setdefault("eos_token", self.eos_token)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # compiled at the first conversation: a template that does not compile stops only chat data
        self.template_source = template if template is not None else _config_template(settings.get("chat_template"))
        self.chat: ChatTemplate | None = None

    def _eos(self, configured: str | None, file: Path) -> str:
        if configured is not None:
            if self.tokenizer.token_to_id(configured) is None:
                raise UsageError(f"tokenizer {str(self.path)!r}: its eos_token {configured!r} is not in {file.name}")
            return configured
        for candidate in EOS_CANDIDATES:
            if self.tokenizer.token_to_id(candidate) is not None:
                return candidate
        raise UsageError(f"tokenizer {str(self.path)!r} names no eos_token (no tokenizer_config.json beside "
                         f"{file.name}, nor one of {', '.join(EOS_CANDIDATES)} in its vocabulary): documents are "
                         "joined with EOS, so add a tokenizer_config.json with \"eos_token\"")

    def describe(self) -> str:
        return f"{self.path} (vocab {self.vocab_size:,}, EOS {self.eos_token!r})"

    def encode(self, records: list[Record], data: Path) -> list[Encoded]:
        """Every record's tokens, EOS included (see the module docstring); batched through the Rust library."""
        texts, spans, special = [], [], []
        for record in records:
            text, span = self._text(record, data)
            texts.append(text)
            spans.append(span)
            special.append(record.kind != "chat")
        out: list[Encoded | None] = [None] * len(records)
        for add_special in (True, False):
            chosen = [i for i, flag in enumerate(special) if flag == add_special]
            if not chosen:
                continue
            encodings = self.tokenizer.encode_batch([texts[i] for i in chosen], add_special_tokens=add_special)
            for i, encoding in zip(chosen, encodings, strict=True):
                out[i] = self._finish(encoding, spans[i], records[i].kind)
        return out

    def _text(self, record: Record, data: Path) -> tuple[str, list[tuple[int, int]] | None]:
        """The string to encode and the spans of counted characters (None: all count)."""
        if record.kind == "text":
            return record.text, None
        if record.kind == "prompt_completion":
            text = record.prompt + record.completion
            return text, [(len(record.prompt), len(text))]
        if self.template_source is None:
            raise UsageError(f"{where(data, record.line)} holds \"messages\" but tokenizer {str(self.path)!r} has no "
                             "chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")
        try:
            if self.chat is None:
                self.chat = ChatTemplate(self.template_source, self.special_tokens)
            return self.chat.assistant_spans(list(record.messages))
        except TemplateRefused as exc:
            raise UsageError(f"{where(data, record.line)}: {exc}") from None

    def _finish(self, encoding, spans: list[tuple[int, int]] | None, kind: str) -> Encoded:
        ids = np.asarray(encoding.ids, dtype=np.int64)
        counted = None
        if spans is not None:
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            counted = np.zeros(len(ids), dtype=bool)
            for start, end in spans:  # a token counts when it holds a counted character
                counted |= (offsets[:, 0] < end) & (offsets[:, 1] > start) & (offsets[:, 1] > offsets[:, 0])
        if len(ids) == 0 or ids[-1] != self.eos_id:
            ids = np.append(ids, self.eos_id)
            if counted is not None:
                counted = np.append(counted, False)
        if kind == "prompt_completion":  # the EOS ends the completion: the model learns to stop
            counted[-1] = True
        return Encoded(ids, counted)


def _config_template(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (the "default" one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None
