"""Training data: text or token files in, a global order of token windows out, sharded by data-parallel rank.

  documents.py  what a text corpus holds (.jsonl, .txt, .parquet), record by record with line numbers
  chat.py       chat templates: rendering a conversation, which characters are the assistant's
  tokenizer.py  --tokenizer: tokenizer.json run by the `tokenizers` library; documents to ids and loss masks
  cache.py      the tokenized corpus, made once and kept next to the data
  sources.py    synthetic, text and token-id sources: window i is a pure function of (seed, i)
  batch.py      each dp rank's (inputs, targets) and the global batch's count of counted targets
"""

from executor.components.data.batch import IGNORE_INDEX, counted_targets, local_batch
from executor.components.data.sources import SUCCESSORS, FileTokens, SyntheticTokens, open_source
from executor.components.data.tokenizer import resolve_tokenizer, run_tokenizer

__all__ = ["IGNORE_INDEX", "SUCCESSORS", "FileTokens", "SyntheticTokens", "counted_targets", "local_batch",
           "open_source", "resolve_tokenizer", "run_tokenizer"]
