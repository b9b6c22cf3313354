"""Hugging Face models in and out: safetensors directories, per-family state-dict adapters, rank-local loading.

  files.py     the safetensors directory (config.json, model.safetensors or shards + index): headers,
               byte ranges read without mapping the file, shards written with their index
  adapter.py   our parameter names <-> the Hugging Face tensors of each family, both directions
  config.py    the directory's config.json against the plan's model; config.json written from a ModelSpec
  load.py      `execute --init-from DIR`: each rank reads the tensors and rows it owns
  export.py    `checkpoint export --format hf`: a DCP checkpoint -> DIR, shard by shard
  save.py      `execute --save-hf-every K`: the running job writes RUN/hf/step-K/ (every rank converts its shards)

transformers is never imported here (a test reference only); the safetensors
package writes the shard files.
"""
