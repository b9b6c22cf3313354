"""A Hugging Face weights directory: safetensors headers, byte-range reads, sharded writes with an index.

Format (safetensors): 8 bytes little-endian header length N, N bytes of JSON
{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data, row-major, offsets relative to the end of the header. A
directory holds model.safetensors, or model-0000K-of-0000N.safetensors with
model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map":
{key: file}}).

Reading: a tensor, or a range of its rows (dimension 0), is read with one
positioned read into a tensor of exactly that size. Nothing is memory-mapped,
so a rank's host memory holds what it asked for and nothing else (a mapped
file's touched pages would count in every rank's resident set). Writing goes
through the safetensors package, one shard at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from topologies.errors import UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
# tokenizer and generation files a model directory carries beside its weights (copied into exports)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class WeightsDir:
    """The tensors of a Hugging Face directory by key; reads whole tensors or row ranges."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise UsageError(f"--init-from {str(self.path)!r} is not a directory: give a Hugging Face model "
                             "directory (config.json and *.safetensors)")
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            self.tensors.update(_read_header(file))

    def _files(self) -> list[Path]:
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UsageError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); "
                                 "re-save the model with save_pretrained") from None
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise UsageError(f"{index} names shard files that are missing: {', '.join(missing[:5])}; "
                                 "download the whole snapshot")
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{str(self.path)!r} holds no *.safetensors weights (pytorch_model.bin is not read: "
                             "convert it with save_pretrained(..., safe_serialization=True))")
        return files

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise UsageError(f"{self.path}: no tensor {key!r} in the safetensors files; is this directory the "
                             "model the plan describes?") from None

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `key` (or its rows [first, last) along dimension 0) in its stored dtype."""
        info = self.info(key)
        shape = list(info.shape)
        offset, nbytes = info.offset, info.nbytes
        if rows is not None:
            first, last = rows
            if not shape or not 0 <= first <= last <= shape[0]:
                raise UsageError(f"{self.path}: rows {rows} of {key!r} with shape {tuple(shape)}")
            row_bytes = info.nbytes // shape[0] if shape[0] else 0
            offset, nbytes, shape[0] = offset + first * row_bytes, (last - first) * row_bytes, last - first
        out = torch.empty(nbytes, dtype=torch.uint8)
        with open(info.file, "rb") as f:
            f.seek(offset)
            got = f.readinto(memoryview(out.numpy()))
        if got != nbytes:
            raise UsageError(f"{info.file}: {key!r} is cut short ({got} of {nbytes} bytes); the file is truncated")
        return out.view(info.dtype).reshape(shape)


def _read_header(file: Path) -> dict[str, TensorInfo]:
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
        size = os.path.getsize(file)
    except (OSError, ValueError, struct.error) as exc:
        raise UsageError(f"{file}: not a safetensors file ({exc})") from None
    out = {}
    base = 8 + length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{file}: malformed header entry {key!r} ({exc})") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != math.prod(shape) * itemsize or base + end > size:
            raise UsageError(f"{file}: {key!r} does not fit its header ({shape}, {entry['dtype']}); the file is "
                             "damaged or truncated")
        out[key] = TensorInfo(file, dtype, shape, base + begin, end - begin)
    return out


def shard_names(n_shards: int) -> list[str]:
    """The file names save_pretrained gives n shards (a single file: model.safetensors)."""
    if n_shards == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{n_shards:05d}.safetensors" for k in range(1, n_shards + 1)]


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written to a temporary name and renamed into place."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".tmp-{path.name}")
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    """model.safetensors.index.json (sorted by key, as save_pretrained writes it)."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = directory / f".tmp-{INDEX}"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, directory / INDEX)
