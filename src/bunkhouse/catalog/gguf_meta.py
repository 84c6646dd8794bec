"""GGUF metadata: the facts about a model file that serving decisions need.

The header is scanned with the ``gguf`` package's type codes and key names, but without its
``GGUFReader``: that reader builds a numpy view of every tokenizer string (6-10 s for a
150k-token vocabulary on 2 cores), while serving needs a dozen scalars. The scanner below
skips the large arrays by their lengths and reads the rest (about 50 ms), and the unit tests
check it against ``GGUFReader`` on the same files.

A model file is untrusted input (a download, a runtime registration). Every count and length
the header declares is checked against the bytes the file has left before it is used, arrays
nest at most :data:`MAX_ARRAY_DEPTH` deep, an array holds at most :data:`MAX_ARRAY_ITEMS`
items and a header at most :data:`MAX_KEYS` keys; anything else wrong is a ``GGUFError``,
never another exception. The scan is blocking file work: the front runs it off the event loop.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGUFValueType

from bunkhouse.errors import GGUFError

# Numeric arrays longer than this (per-layer tables are far shorter) are skipped, not read.
_MAX_KEPT_ARRAY = 4096

MAX_ARRAY_DEPTH = 8
"""Arrays of arrays nest at most this deep (real models nest none)."""

MAX_ARRAY_ITEMS = 1 << 22
"""Items in one array: 4,194,304, 16x the largest vocabulary shipped today (Gemma 3's 262,144
tokens); it bounds the scan's time on a file of tiny items (about 1 s on one core)."""

MAX_KEYS = 1 << 16
"""Metadata keys in one header (real models have tens)."""

MAX_VALUE = 1 << 48
"""Largest count or size a model's metadata may state; beyond it (or negative, or not a finite
number) the key counts as absent."""

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What serving needs to know about one GGUF file."""

    architecture: str
    name: str | None
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    key_length: int | None
    value_length: int | None
    sliding_window: int | None
    chat_template: str | None
    file_type: int | None
    tensor_count: int
    vocab_size: int | None = None  # tokens in the vocabulary (the output layer's rows)
    feed_forward_length: int | None = None  # the FFN's hidden width
    pooling: bool = False  # an embedding model: it declares how it pools
    split_count: int = 1  # files the model is split into (the engine finds them by name)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)


class _Cursor:
    """Little-endian reads over a buffer, with a clear error at a truncated file."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        raw = self.raw_string()
        return raw.decode("utf-8", errors="replace")

    def raw_string(self) -> bytes:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        raw = bytes(self.buf[self.pos : end])
        self.pos = end
        return raw

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF value at byte {self.pos}")
        self.pos += n

    def count(self, min_item_bytes: int, limit: int, what: str) -> int:
        """A declared count of items, each taking at least ``min_item_bytes``: refused when
        over ``limit`` or when the file has not that many bytes left."""
        n: int = self.unpack("<Q")
        if n > limit or n * min_item_bytes > len(self.buf) - self.pos:
            raise GGUFError(f"{self.path}: GGUF header declares {n} {what} at byte "
                            f"{self.pos - 8}, more than the file can hold or than the "
                            f"limit of {limit}")
        return n


def _value(cur: _Cursor, vtype: int) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        return _array(cur)
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise GGUFError(f"{cur.path}: unknown GGUF value type {vtype} at byte {cur.pos}")
    return cur.unpack(fmt)


def _array(cur: _Cursor, depth: int = 1) -> list[Any] | None:
    if depth > MAX_ARRAY_DEPTH:
        raise GGUFError(f"{cur.path}: GGUF arrays nested deeper than {MAX_ARRAY_DEPTH} at "
                        f"byte {cur.pos}")
    etype = cur.unpack("<I")
    if etype == GGUFValueType.STRING:
        for _ in range(cur.count(8, MAX_ARRAY_ITEMS, "strings")):
            cur.skip(cur.unpack("<Q"))
        return None
    if etype == GGUFValueType.ARRAY:
        for _ in range(cur.count(12, MAX_ARRAY_ITEMS, "arrays")):
            _array(cur, depth + 1)
        return None
    fmt = _SCALAR_FORMATS.get(etype)
    if fmt is None:
        raise GGUFError(f"{cur.path}: unknown GGUF array type {etype} at byte {cur.pos}")
    size = struct.calcsize(fmt)
    count = cur.count(size, 1 << 62, "numbers")  # skipped in one step: no item limit
    if count > _MAX_KEPT_ARRAY:
        cur.skip(size * count)
        return None
    return [cur.unpack(fmt) for _ in range(count)]


def read_fields(path: Path, strings: frozenset[str] = frozenset()
                ) -> tuple[dict[str, Any], int]:
    """All scalar and short numeric-array metadata of ``path``, and its tensor count; the
    string arrays named in ``strings`` (e.g. the vocabulary) are read too, as lists."""
    try:
        # O_NONBLOCK: a FIFO swapped in for a model file must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read GGUF file: {e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GGUFError(f"{path}: not a regular file")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            return _read_header(_Cursor(buf, path), strings)
    except (OSError, ValueError, OverflowError, struct.error) as e:  # e.g. an empty file
        raise GGUFError(f"{path}: cannot read GGUF file: {e}") from e
    finally:
        os.close(fd)


def _string_array(cur: _Cursor) -> list[str]:
    etype = cur.unpack("<I")
    if etype != GGUFValueType.STRING:
        raise GGUFError(f"{cur.path}: expected an array of strings at byte {cur.pos}")
    return [cur.string() for _ in range(cur.count(8, MAX_ARRAY_ITEMS, "strings"))]


def _read_header(cur: _Cursor, strings: frozenset[str]) -> tuple[dict[str, Any], int]:
    magic = cur.unpack("<I")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{cur.path}: not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{cur.path}: unsupported GGUF version {version}")
    tensor_count = cur.count(0, 1 << 24, "tensors")  # tensor infos follow the metadata
    kv_count = cur.count(12, MAX_KEYS, "metadata keys")  # key length, type, value
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        if len(key) > 65535:  # the GGUF spec's bound on key length
            raise GGUFError(f"{cur.path}: a GGUF metadata key of {len(key)} bytes")
        vtype = cur.unpack("<I")
        if key in strings and vtype == GGUFValueType.ARRAY:
            fields[key] = _string_array(cur)
        elif vtype == GGUFValueType.ARRAY:
            start = cur.pos
            fields[key] = _array(cur)
            if fields[key] is None:  # skipped: keep its length
                fields[f"{key}.count"] = struct.unpack_from("<Q", cur.buf, start + 4)[0]
        else:
            fields[key] = _value(cur, vtype)
    return fields, tensor_count


def _int(fields: dict[str, Any], key: str) -> int | None:
    """A count or size from the metadata; None when absent, negative, not a finite number
    or over MAX_VALUE (what a hostile file may state: never trusted as a number)."""
    value = fields.get(key)
    if isinstance(value, list):  # per-layer tables: the largest entry bounds memory
        value = max((v for v in value if isinstance(v, int | float)), default=None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if value != value or not 0 <= value <= MAX_VALUE:  # NaN, negative, absurd
        return None
    return int(value)


def read_gguf_info(path: Path) -> GGUFInfo:
    """Read the serving-relevant metadata of the GGUF file at ``path``."""
    fields, tensor_count = read_fields(path)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not 0 < len(arch) <= 64:
        raise GGUFError(f"{path}: GGUF file has no general.architecture (a short string)")
    head_count = _int(fields, f"{arch}.attention.head_count")
    embedding = _int(fields, f"{arch}.embedding_length")
    default_head_dim = embedding // head_count if embedding and head_count else None
    key_length = _int(fields, f"{arch}.attention.key_length") or default_head_dim
    template = fields.get("tokenizer.chat_template")
    name = fields.get("general.name")
    return GGUFInfo(
        architecture=arch,
        name=name if isinstance(name, str) else None,
        context_length=_int(fields, f"{arch}.context_length"),
        block_count=_int(fields, f"{arch}.block_count"),
        embedding_length=embedding,
        head_count=head_count,
        head_count_kv=_int(fields, f"{arch}.attention.head_count_kv") or head_count,
        key_length=key_length,
        value_length=_int(fields, f"{arch}.attention.value_length") or key_length,
        sliding_window=_int(fields, f"{arch}.attention.sliding_window"),
        chat_template=template if isinstance(template, str) else None,
        file_type=_int(fields, "general.file_type"),
        tensor_count=tensor_count,
        vocab_size=(_int(fields, f"{arch}.vocab_size")
                    or _int(fields, "tokenizer.ggml.tokens.count")),
        pooling=f"{arch}.pooling_type" in fields,
        feed_forward_length=_int(fields, f"{arch}.feed_forward_length"),
        split_count=max(1, _int(fields, "split.count") or 1),
    )
