"""GGUF metadata: the facts about a model file that serving decisions need.

The header is scanned with the ``gguf`` package's type codes and key names, but without its
``GGUFReader``: that reader builds a numpy view of every tokenizer string (6-10 s for a
150k-token vocabulary on 2 cores), while serving needs a dozen scalars. The scanner below
skips the large arrays by their lengths and reads the rest (about 50-100 ms), and the unit tests
check it against ``GGUFReader`` on the same files.

A model file is untrusted input (a download, a runtime registration, a sparse file that
declares GiBs in a few KiB of disk). Every count and length the header declares is checked
against the bytes the file has left before it is used; arrays nest at most
:data:`MAX_ARRAY_DEPTH` deep; the whole scan visits at most :data:`MAX_HEADER_ITEMS` items
one by one (arrays of numbers are seeked over whole) and a header holds at most
:data:`MAX_KEYS` keys; only the strings a caller names are read, each at most
:data:`MAX_STRING_BYTES`, and everything kept takes at most :data:`MAX_KEPT_BYTES`. Anything
else wrong is a ``GGUFError``, never another exception. The scan is blocking file work: the
front runs it off the event loop.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGUFValueType, LlamaFileType

from bunkhouse.errors import GGUFError

# Numeric arrays longer than this (per-layer tables are far shorter) are skipped, not read.
_MAX_KEPT_ARRAY = 4096

MAX_ARRAY_DEPTH = 8
"""Arrays of arrays nest at most this deep (real models nest none)."""

MAX_HEADER_ITEMS = 1 << 21
"""Items a scan visits one by one, in the whole header: keys, the strings of string arrays,
the arrays of nested arrays and the numbers of the short arrays it keeps. 2,097,152: 7x the
303,323 of Qwen2.5's tokens and merges, 8x Gemma 3's 262,144 tokens (the largest vocabulary
shipped today); about a second of scanning on a loaded core (0.3 us a string, 0.55 us a
nested array). Arrays of numbers are seeked over in one step, at no cost per item."""

MAX_KEYS = 1 << 16
"""Metadata keys in one header (real models have tens)."""

MAX_KEY_BYTES = 65535
"""Bytes in one metadata key: the GGUF specification's bound."""

MAX_STRING_BYTES = 1 << 20
"""Bytes in one string the scan keeps (a chat template, the architecture, a vocabulary token):
1 MiB. Real chat templates are at most tens of KiB (Qwen2.5-Coder's is 2.5 KiB), tokens at
most hundreds of bytes. A longer one is a GGUFError naming its key; strings the scan does not
keep are seeked over, never read, whatever their length."""

MAX_KEPT_BYTES = 1 << 26
"""Memory the values a scan keeps may take, all together: 64 MiB, counting each key, string
and number kept as its bytes plus :data:`_OBJECT_BYTES`. Gemma 3's vocabulary, the largest
read, counts 19 MiB (262,144 tokens of 2.3 MB)."""

_OBJECT_BYTES = 64
"""What one kept Python value costs besides its bytes (a str object is 49-80 bytes, an int
28-32, plus its slot in a list or dict): a round figure, on the side of caution."""

MAX_VALUE = 1 << 48
"""Largest count or size a model's metadata may state; beyond it (or negative, or not a finite
number) the key counts as absent."""

_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")  # an array's item type and count

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
_ITEM_BYTES = {vtype: struct.calcsize(fmt) for vtype, fmt in _SCALAR_FORMATS.items()}


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
    parameters: int | None = None  # weights in all its tensors (None: unknown)
    general_type: str | None = None  # general.type: "model", or "adapter" for a LoRA file
    adapter_type: str | None = None  # adapter.type of an adapter file: "lora"

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def quantization(self) -> str:
        """The file's quantization as llama.cpp's tools name it (``general.file_type``: 15 is
        "Q4_K_M", 1 "F16"); "unknown" when it states none or one not known here."""
        try:
            name = LlamaFileType(self.file_type).name if self.file_type is not None else ""
        except ValueError:
            name = ""
        known = name.removeprefix("MOSTLY_").removeprefix("ALL_")
        return known if known and known != "GUESSED" else "unknown"


class _Cursor:
    """Little-endian reads over a buffer, with a clear error at a truncated file, and the
    scan's budgets: items visited (:data:`MAX_HEADER_ITEMS`), bytes kept
    (:data:`MAX_KEPT_BYTES`)."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.items_left = MAX_HEADER_ITEMS
        self.kept_left = MAX_KEPT_BYTES

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        """A string the scan keeps: at most ``limit`` bytes (else a GGUFError naming
        ``what``), charged to the kept bytes."""
        length: int = self.unpack("<Q")
        if length > limit:
            raise GGUFError(f"{self.path}: GGUF {what} is a string of {length} bytes at byte "
                            f"{self.pos - 8}, over the limit of {limit}")
        self.keep(length + _OBJECT_BYTES, what)
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        raw = bytes(self.buf[self.pos : end])
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, n: int) -> None:
        """Seek over ``n`` strings, reading only their lengths (the scan's hot loop)."""
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        for _ in range(n):
            if pos + 8 > size:
                raise GGUFError(f"{self.path}: truncated GGUF string at byte {pos}")
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            raise GGUFError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        self.pos = pos

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF value at byte {self.pos}")
        self.pos += n

    def keep(self, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` of kept values (a GGUFError naming ``what`` past the budget)."""
        self.kept_left -= nbytes
        if self.kept_left < 0:
            raise GGUFError(f"{self.path}: GGUF {what} at byte {self.pos} takes the values "
                            f"kept past the limit of {MAX_KEPT_BYTES} bytes")

    def count(self, min_item_bytes: int, what: str, *, limit: int | None = None,
              visited: bool = True) -> int:
        """A declared count of items, each taking at least ``min_item_bytes``: refused when
        the file has not that many bytes left or over ``limit``; items the scan visits one by
        one are charged to its budget of :data:`MAX_HEADER_ITEMS`."""
        n: int = self.unpack("<Q")
        if visited and n > self.items_left:
            raise GGUFError(f"{self.path}: GGUF header declares {n} {what} at byte "
                            f"{self.pos - 8}, past the {MAX_HEADER_ITEMS} items a scan "
                            f"visits in a whole header ({self.items_left} left)")
        if (limit is not None and n > limit) or n * min_item_bytes > len(self.buf) - self.pos:
            bound = "" if limit is None else f" or than the limit of {limit}"
            raise GGUFError(f"{self.path}: GGUF header declares {n} {what} at byte "
                            f"{self.pos - 8}, more than the file can hold{bound}")
        if visited:
            self.items_left -= n
        return n


def _value(cur: _Cursor, key: str, vtype: int) -> Any:
    if vtype == GGUFValueType.ARRAY:
        return _array(cur)
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise GGUFError(f"{cur.path}: unknown GGUF value type {vtype} at byte {cur.pos}")
    cur.keep(_OBJECT_BYTES, key)
    return cur.unpack(fmt)


def _array(cur: _Cursor, depth: int = 1) -> list[Any] | None:
    """A short array of numbers at the top level, as a list; None for anything else, which
    is seeked over (strings one by one, nested arrays and long arrays of numbers whole)."""
    if depth > MAX_ARRAY_DEPTH:
        raise GGUFError(f"{cur.path}: GGUF arrays nested deeper than {MAX_ARRAY_DEPTH} at "
                        f"byte {cur.pos}")
    etype = cur.unpack("<I")
    if etype == GGUFValueType.STRING:
        cur.skip_strings(cur.count(8, "strings"))
        return None
    if etype == GGUFValueType.ARRAY:
        _skip_arrays(cur, cur.count(12, "arrays"), depth + 1)
        return None
    size = _ITEM_BYTES.get(etype)
    if size is None:
        raise GGUFError(f"{cur.path}: unknown GGUF array type {etype} at byte {cur.pos}")
    start = cur.pos
    count = cur.count(size, "numbers", visited=False)  # skipped in one step: no item limit
    if depth > 1 or count > _MAX_KEPT_ARRAY:
        cur.skip(size * count)
        return None
    cur.pos = start
    count = cur.count(size, "numbers")  # kept: each is an item and a value
    cur.keep(count * _OBJECT_BYTES, "array of numbers")
    values = list(struct.unpack_from(f"<{count}{_SCALAR_FORMATS[etype][1]}", cur.buf, cur.pos))
    cur.pos += size * count
    return values


def _skip_arrays(cur: _Cursor, n: int, depth: int) -> None:
    """Seek over ``n`` arrays nested ``depth`` deep: each of numbers in one step (the hot
    loop), any other through :func:`_array` (strings, arrays, errors)."""
    buf, size, head = cur.buf, len(cur.buf), _ARRAY_HEAD.unpack_from
    for _ in range(n):
        pos = cur.pos
        etype, count = head(buf, pos) if pos + 12 <= size else (-1, 0)
        item = _ITEM_BYTES.get(etype)
        if item is None or depth > MAX_ARRAY_DEPTH:
            _array(cur, depth)  # raises, or reads what it holds
            continue
        end = pos + 12 + count * item
        if end > size:
            raise GGUFError(f"{cur.path}: truncated GGUF array at byte {pos}")
        cur.pos = end


PARAMETER_COUNT = "general.parameter_count"
"""The key :func:`read_fields` fills in, when asked and the file has none, with the weights
its tensors hold (as Ollama patches it in): the sum over the tensor infos of their shapes."""


def read_fields(path: Path, strings: frozenset[str] = frozenset(), *,
                parameters: bool = False) -> tuple[dict[str, Any], int]:
    """The number and short numeric-array metadata of ``path``, and its tensor count; the
    strings and string arrays of the keys named in ``strings`` (e.g. the chat template, the
    vocabulary) are read too, arrays as lists. Other strings are seeked over, never read.
    ``parameters``: :data:`PARAMETER_COUNT` counted from the tensor infos if the file has
    no such key and is a whole model, not a shard (left out when they cannot be read within
    the scan's budgets)."""
    with _mapped(path) as cur:
        fields, tensors = _read_header(cur, strings)
        whole = (_int(fields, "split.count") or 1) == 1  # a shard holds a part
        if parameters and whole and _int(fields, PARAMETER_COUNT) is None:
            fields.pop(PARAMETER_COUNT, None)
            count = _tensor_parameters(cur, tensors)
            if count is not None:
                fields[PARAMETER_COUNT] = count
        return fields, tensors


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[_Cursor]:
    """A cursor at the start of the GGUF file at ``path``, memory-mapped; GGUFError for a
    file that cannot be opened or is no regular file, and for a read past its end."""
    try:
        # O_NONBLOCK: a FIFO swapped in for a model file must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read GGUF file: {e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GGUFError(f"{path}: not a regular file")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            yield _Cursor(buf, path)
    except (OSError, ValueError, OverflowError, struct.error) as e:  # e.g. an empty file
        raise GGUFError(f"{path}: cannot read GGUF file: {e}") from e
    finally:
        os.close(fd)


def read_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by name, in ggml's order (``ne[0]``, the row's length, first),
    from the tensor infos after the header; GGUFError for a file that is no readable GGUF or
    whose infos are malformed or past the scan's budgets."""
    with _mapped(path) as cur:
        _, n = _read_header(cur, frozenset())
        if n > cur.items_left:
            raise GGUFError(f"{path}: {n} tensors, past the scan's budget")
        shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(n):
            name = cur.string("tensor name", 256)
            dims = cur.unpack("<I")
            if dims > _MAX_DIMS:
                raise GGUFError(f"{path}: tensor {name!r} has {dims} dimensions")
            shapes[name] = tuple(cur.unpack("<Q") for _ in range(dims))
            cur.skip(4 + 8)  # its type and offset
        return shapes


def lora_misfit(base: dict[str, tuple[int, ...]], lora: dict[str, tuple[int, ...]]
                ) -> str | None:
    """Why a LoRA's tensors (``lora``: :func:`read_tensor_shapes`) cannot apply to a model's
    (``base``); None if they can. Each pair ``T.lora_a`` (``ne`` = [n_in, rank]) and
    ``T.lora_b`` ([rank, n_out]) must adapt a tensor ``T`` of the base of [n_in, n_out]: what
    llama.cpp checks when it loads an adapter (llama-adapter.cpp), found before a load."""
    pairs = 0
    for name, a in lora.items():
        if not name.endswith(".lora_a"):
            continue
        target = name.removesuffix(".lora_a")
        b, weights = lora.get(f"{target}.lora_b"), base.get(target)
        if b is None:
            return f"{name} has no {target}.lora_b"
        if weights is None:
            return f"the model has no tensor {target} for {name} to adapt"
        pairs += 1
        if target == "token_embd.weight":  # llama.cpp takes its pair transposed: its own check
            continue
        if len(a) != 2 or len(b) != 2 or len(weights) < 2 or a[1] != b[0] \
                or a[0] != weights[0] or b[1] != weights[1]:
            return (f"{target}: lora_a {list(a)} and lora_b {list(b)} do not adapt the "
                    f"model's {list(weights)} (ggml's shapes: [n_in, rank], [rank, n_out])")
    return None if pairs else "it has no lora_a/lora_b tensor pairs"


def _string_array(cur: _Cursor, key: str) -> list[str]:
    etype = cur.unpack("<I")
    if etype != GGUFValueType.STRING:
        raise GGUFError(f"{cur.path}: expected an array of strings at byte {cur.pos}")
    n = cur.count(8, "strings")
    buf, size, unpack = cur.buf, len(cur.buf), _U64.unpack_from
    values = []
    for _ in range(n):  # cur.string inlined (the vocabulary's 150k-262k tokens)
        pos = cur.pos
        length = unpack(buf, pos)[0] if pos + 8 <= size else -1
        cur.kept_left -= length + _OBJECT_BYTES
        if not 0 <= length <= MAX_STRING_BYTES or pos + 8 + length > size or cur.kept_left < 0:
            cur.kept_left += length + _OBJECT_BYTES
            return [cur.string(key)]  # raises the error that fits
        values.append(buf[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"))
        cur.pos = pos + 8 + length
    return values


_MAX_DIMS = 4
"""Dimensions a tensor has at most (ggml's GGML_MAX_DIMS)."""


def _tensor_parameters(cur: _Cursor, n: int) -> int | None:
    """The weights of the ``n`` tensor infos at the cursor (each: a name, a dimension count,
    the dimensions, a type and an offset), summed; None for infos past the scan's item
    budget, malformed or truncated (the count is a description, never needed to serve)."""
    if n > cur.items_left:
        return None
    total = 0
    try:
        for _ in range(n):
            cur.skip_strings(1)
            dims = cur.unpack("<I")
            if dims > _MAX_DIMS:
                return None
            weights = 1
            for _ in range(dims):
                weights *= cur.unpack("<Q")
            cur.skip(4 + 8)  # its type and offset
            total += weights
            if total > MAX_VALUE:
                return None
    except GGUFError:
        return None
    cur.items_left -= n
    return total


def _read_header(cur: _Cursor, strings: frozenset[str]) -> tuple[dict[str, Any], int]:
    magic = cur.unpack("<I")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{cur.path}: not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{cur.path}: unsupported GGUF version {version}")
    # tensor infos follow the metadata: not read
    tensor_count = cur.count(0, "tensors", limit=1 << 24, visited=False)
    kv_count = cur.count(12, "metadata keys", limit=MAX_KEYS)  # key length, type, value
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string(f"metadata key at byte {cur.pos}", MAX_KEY_BYTES)
        vtype = cur.unpack("<I")
        if key in strings and vtype == GGUFValueType.ARRAY:
            fields[key] = _string_array(cur, key)
        elif vtype == GGUFValueType.STRING:
            if key in strings:
                fields[key] = cur.string(key)
            else:
                cur.skip_strings(1)
        elif vtype == GGUFValueType.ARRAY:
            start = cur.pos
            fields[key] = _array(cur)
            if fields[key] is None:  # skipped: keep its length
                cur.keep(_OBJECT_BYTES, key)
                fields[f"{key}.count"] = _U64.unpack_from(cur.buf, start + 4)[0]
        else:
            fields[key] = _value(cur, key, vtype)
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


_INFO_STRINGS = frozenset({"general.architecture", "general.name", "tokenizer.chat_template",
                           "general.type", "adapter.type"})


def read_gguf_info(path: Path) -> GGUFInfo:
    """Read the serving-relevant metadata of the GGUF file at ``path``."""
    fields, tensor_count = read_fields(path, _INFO_STRINGS, parameters=True)
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
        parameters=_int(fields, PARAMETER_COUNT),
        general_type=_text(fields, "general.type"),
        adapter_type=_text(fields, "adapter.type"),
    )


def _text(fields: dict[str, Any], key: str) -> str | None:
    value = fields.get(key)
    return value if isinstance(value, str) else None
