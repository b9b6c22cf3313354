"""Documents of a text corpus, read with their line numbers: what `--data` holds before tokenization.

Formats (by suffix):
  * `.jsonl`: one JSON object per line, one of
      {"text": "..."}                                  a document trained on whole;
      {"prompt": "...", "completion": "..."}           the loss counts the completion only;
      {"messages": [{"role": ..., "content": ...}, ...]}  a conversation rendered with the
                                                       tokenizer's chat template; the loss counts
                                                       the assistant turns only.
    Blank lines are skipped; any other key is ignored. The kind is decided line by line, so one
    file may mix them (TRL's "language modeling", "prompt-completion" and "conversational" types).
  * `.txt`: one document per line (Hugging Face datasets' text loader); blank lines skipped.
  * `.parquet`: one document per row, with the columns a `.jsonl` object would have (pyarrow).

Every record carries its 1-based line (or row) number, so an error names it: a line that is not
JSON, not UTF-8, or lacks the fields is refused here, before anything is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topologies.errors import UsageError

TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")
KINDS = ("text", "prompt_completion", "chat")
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Record:
    """One document: its place in the file and either text, a prompt and completion, or messages."""

    line: int  # 1-based line (jsonl, txt) or row (parquet)
    kind: str  # one of KINDS
    text: str = ""  # kind "text"
    prompt: str = ""  # kind "prompt_completion"
    completion: str = ""
    messages: tuple = ()  # kind "chat": the message dicts as read


def where(path: Path, line: int) -> str:
    """'corpus.jsonl line 7' or 'corpus.parquet row 7': how every error names a record."""
    return f"{path} {'row' if path.suffix.lower() == '.parquet' else 'line'} {line}"


def read_records(path: Path) -> Iterator[tuple[Record, int]]:
    """(record, bytes of the file read so far) for every document of a text corpus, in file order."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl(path)
    if suffix == ".txt":
        return _txt(path)
    if suffix == ".parquet":
        return _parquet(path)
    raise ValueError(f"not a text corpus: {path}")


def _lines(path: Path) -> Iterator[tuple[int, str, int]]:
    """(1-based line number, the line without its end, bytes read so far) for every line."""
    done = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            done += len(raw)
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark may open the file
            except UnicodeDecodeError as exc:
                raise UsageError(f"{where(path, number)}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                 f"{exc.start + 1}): convert the file to UTF-8") from None
            yield number, line.rstrip("\r\n"), done


def _txt(path: Path) -> Iterator[tuple[Record, int]]:
    for number, line, done in _lines(path):
        if line.strip():
            yield Record(number, "text", text=line), done


def _jsonl(path: Path) -> Iterator[tuple[Record, int]]:
    for number, line, done in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where(path, number)}: not JSON ({exc.msg} at column {exc.colno}): every line of a "
                             ".jsonl file must be one JSON object") from None
        except RecursionError:
            raise UsageError(f"{where(path, number)}: JSON nested too deeply to read") from None
        yield record_from(obj, number, path), done


def _parquet(path: Path) -> Iterator[tuple[Record, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        total_rows, size = file.metadata.num_rows, path.stat().st_size
        row = 0
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for obj in batch.to_pylist():
                row += 1
                yield record_from(obj, row, path), size * row // max(total_rows, 1)
    except (pa.ArrowException, OSError) as exc:
        raise UsageError(f"cannot read parquet file {str(path)!r}: {exc}") from None


def record_from(obj: Any, line: int, path: Path) -> Record:
    """The Record a JSON object (or parquet row) describes; UsageError naming the line when it is none."""
    if isinstance(obj, dict):  # the common cases first, without building an error's text
        text, prompt, completion = obj.get("text"), obj.get("prompt"), obj.get("completion")
        if isinstance(text, str):
            return Record(line, "text", text=text)
        if text is None and isinstance(prompt, str) and isinstance(completion, str):
            return Record(line, "prompt_completion", prompt=prompt, completion=completion)
    at = where(path, line)
    if not isinstance(obj, dict):
        raise UsageError(f"{at}: a JSON {type(obj).__name__}, not an object with a \"text\" field "
                         "(or \"prompt\" and \"completion\", or \"messages\")")
    if obj.get("text") is not None:
        return Record(line, "text", text=_string(obj, "text", at))
    if obj.get("prompt") is not None or obj.get("completion") is not None:
        return Record(line, "prompt_completion", prompt=_string(obj, "prompt", at),
                      completion=_string(obj, "completion", at))
    if obj.get("messages") is not None:
        return Record(line, "chat", messages=_messages(obj["messages"], at))
    keys = ", ".join(sorted(map(str, obj))) or "none"
    raise UsageError(f"{at}: no \"text\" field (nor \"prompt\" and \"completion\", nor \"messages\"); its keys: "
                     f"{keys}")


def _string(obj: dict, key: str, at: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        hint = "; a conversation goes in \"messages\"" if isinstance(value, list) else ""
        raise UsageError(f"{at}: \"{key}\" is {got}, not a string{hint}")
    return value


def _messages(value: Any, at: str) -> tuple:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{at}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UsageError(f"{at}: messages[{i}] is not an object with a string \"role\"")
    if not any(m["role"] == "assistant" for m in value):
        raise UsageError(f"{at}: no assistant message: the loss of a conversation counts only the assistant's "
                         "turns, so this one would train nothing")
    return tuple(value)
