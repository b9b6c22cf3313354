"""Tiny text corpora and a tiny BPE tokenizer for the text-data tests, made here with the `tokenizers` library.

The tokenizer is byte-level BPE trained on the corpora's own words (so every id fits the debug
models' 256-token vocabulary), with Llama's habit of a BOS added by the post-processor, `</s>` as
EOS and a ChatML chat template in tokenizer_config.json. `CHAT_TEMPLATE_MARKED` renders the same
text with `{% generation %}` around the assistant's part, for transformers' assistant mask.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog a cat sat on mat we train small models with packed "
         "documents and count only what the assistant says hello world how are you fine thanks question "
         "answer is it true yes no maybe tokens data loss step").split()
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
VOCAB = 240  # below the debug models' 256

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nyou are a small model<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_TEMPLATE_MARKED = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nyou are a small model<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def sentence(rng: random.Random, low: int = 3, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def make_tokenizer(directory: Path, *, template: str | None = CHAT_TEMPLATE, bos: bool = True,
                   vocab: int = VOCAB, extra_tokens: int = 0) -> Path:
    """A tokenizer directory (tokenizer.json + tokenizer_config.json) trained on WORDS; returns it.

    extra_tokens adds `<extra_0>`, `<extra_1>`, ... after the trained vocabulary (ids beyond a small model's).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    lines = [sentence(rng) + rng.choice([".", "?", "!", ","]) for _ in range(400)]
    lines += [f"<|im_start|>{role}\n{sentence(rng)}<|im_end|>\n" for role in ("user", "assistant", "system")
              for _ in range(20)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS))
    tok.add_special_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def text_records(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": sentence(rng, 4, 30) + "."} for _ in range(n)]


def prompt_completion_records(n: int, seed: int = 2) -> list[dict]:
    """Prompts end at a word boundary ("answer:") so that a prompt's tokens are a prefix of the whole's."""
    rng = random.Random(seed)
    return [{"prompt": "question: " + sentence(rng, 2, 20) + "? answer:",
             "completion": " " + sentence(rng, 1, 12) + "."} for _ in range(n)]


def chat_records(n: int, seed: int = 3) -> list[dict]:
    """Conversations of 1-3 exchanges, some with a system message; assistant turns of very different lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng, 2, 6)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(rng, 2, 25)})
            messages.append({"role": "assistant", "content": sentence(rng, 1, rng.choice([3, 40]))})
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


if __name__ == "__main__":  # python tests/text_corpus.py DIR: the README's demo tokenizer and chat corpus
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo")
    make_tokenizer(out / "tok")
    write_jsonl(out / "chat.jsonl", chat_records(2000))
    print(f"wrote {out / 'tok'} (tokenizer.json, tokenizer_config.json) and {out / 'chat.jsonl'}")
