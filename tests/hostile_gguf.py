"""Hostile GGUF headers: what a malicious or broken model file may declare.

Each generator returns the file's bytes; :func:`hostile_headers` names one of each kind:
deep nesting, declared counts and lengths far beyond the file, truncations, wrong types and
absurd values for the keys serving reads.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from pathlib import Path

from gguf import GGUF_MAGIC
from gguf import GGUFValueType as T

Q = struct.Struct("<Q")


def string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return Q.pack(len(raw)) + raw


def header(kvs: list[bytes], *, tensors: int = 0, kv_count: int | None = None,
           version: int = 3) -> bytes:
    count = len(kvs) if kv_count is None else kv_count
    return struct.pack("<IIQQ", GGUF_MAGIC, version, tensors, count) + b"".join(kvs)


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, T.UINT32, struct.pack("<I", value))


def arch(name: str = "llama") -> bytes:
    return kv("general.architecture", T.STRING, string(name))


def nested_arrays(depth: int) -> bytes:
    """``depth`` arrays, each holding the next one; the innermost is empty."""
    out = b""
    for _ in range(depth - 1):
        out += struct.pack("<I", T.ARRAY) + Q.pack(1)
    return out + struct.pack("<I", T.UINT8) + Q.pack(0)


def valid(context: int = 2048) -> bytes:
    return header([arch(), u32("llama.context_length", context), u32("llama.block_count", 2),
                   u32("llama.embedding_length", 64), u32("llama.attention.head_count", 8),
                   kv("tokenizer.ggml.tokens", T.ARRAY,
                      struct.pack("<I", T.STRING) + Q.pack(3) + string("a") + string("b")
                      + string("c"))])


def hostile_headers() -> Iterator[tuple[str, bytes]]:
    yield "nested 5,000 arrays", header([arch(), kv("x", T.ARRAY, nested_arrays(5000))])
    yield "nested 9 arrays", header([arch(), kv("x", T.ARRAY, nested_arrays(9))])
    yield "2^62 strings", header([arch(), kv("x", T.ARRAY, struct.pack("<I", T.STRING)
                                            + Q.pack(1 << 62))])
    yield "2^61 numbers", header([arch(), kv("x", T.ARRAY, struct.pack("<I", T.UINT64)
                                            + Q.pack(1 << 61))])
    yield "2^60 arrays", header([arch(), kv("x", T.ARRAY, struct.pack("<I", T.ARRAY)
                                           + Q.pack(1 << 60))])
    yield "string of 2^63 bytes", header([arch(), kv("x", T.STRING, Q.pack(1 << 63))])
    yield "key of 2^40 bytes", header([Q.pack(1 << 40) + b"k"])
    yield "2^63 keys", header([arch()], kv_count=1 << 63)
    yield "2^64-1 tensors", header([arch()], tensors=(1 << 64) - 1)
    yield "version 99", header([arch()], version=99)
    yield "not GGUF", b"#!/bin/sh\necho this is a text file\n" * 10
    yield "empty file", b""
    yield "magic only", struct.pack("<I", GGUF_MAGIC)
    yield "unknown value type", header([arch(), kv("x", 77, b"\0" * 8)])
    yield "unknown array type", header([arch(), kv("x", T.ARRAY, struct.pack("<I", 77)
                                                  + Q.pack(1))])
    yield "architecture is a number", header([u32("general.architecture", 7)])
    yield "no architecture", header([u32("llama.context_length", 2048)])
    yield "context is a string", header([arch(), kv("llama.context_length", T.STRING,
                                                    string("big"))])
    yield "context is infinite", header([arch(), kv("llama.context_length", T.FLOAT64,
                                                    struct.pack("<d", math.inf))])
    yield "context is NaN", header([arch(), kv("llama.context_length", T.FLOAT32,
                                               struct.pack("<f", math.nan))])
    yield "context is negative", header([arch(), kv("llama.context_length", T.INT32,
                                                    struct.pack("<i", -4096))])
    yield "context is 2^64-1", header([arch(), kv("llama.context_length", T.UINT64,
                                                  Q.pack((1 << 64) - 1))])
    yield "zero heads", header([arch(), u32("llama.embedding_length", 64),
                                u32("llama.attention.head_count", 0),
                                u32("llama.block_count", 4)])
    yield "head count is an array of strings", header([
        arch(), kv("llama.attention.head_count", T.ARRAY,
                   struct.pack("<I", T.STRING) + Q.pack(1) + string("x"))])
    yield "huge sizes", header([arch(), u32("llama.block_count", 0xFFFFFFFF),
                                u32("llama.embedding_length", 0xFFFFFFFF),
                                u32("llama.attention.head_count", 1),
                                u32("llama.vocab_size", 0xFFFFFFFF),
                                u32("llama.attention.sliding_window", 0)])
    yield "2^40 sliding-window layers", header([
        arch("gemma3"), kv("gemma3.block_count", T.UINT64, Q.pack(1 << 40)),
        u32("gemma3.attention.sliding_window", 512), u32("gemma3.context_length", 1024),
        u32("gemma3.embedding_length", 64), u32("gemma3.attention.head_count", 4)])
    yield "architecture of 1 MiB", header([arch("a" * (1 << 20))])
    yield "invalid UTF-8 key and architecture", header([
        kv("general.architecture", T.STRING, string(b"\xff\xfe\xc0")), string(b"\xff")
        + struct.pack("<I", T.UINT8) + b"\1"])
    good = valid()
    for cut in range(0, len(good), max(1, len(good) // 24)):
        yield f"truncated at byte {cut}", good[:cut]


def write_all(directory: Path) -> list[Path]:
    """Every hostile header as ``directory/hNN.gguf``, the sparse ones as ``sNN.gguf``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (_, data) in enumerate(hostile_headers()):
        path = directory / f"h{i:02d}.gguf"
        path.write_bytes(data)
        paths.append(path)
    for i, (_, parts) in enumerate(sparse_headers()):
        paths.append(write_sparse(directory / f"s{i:02d}.gguf", parts))
    return paths


Part = bytes | int
"""A sparse file's part: bytes as they are, or an int: a hole of that many zero bytes."""


def write_sparse(path: Path, parts: list[Part]) -> Path:
    """``parts`` as one file whose holes take no disk (they read as zeros)."""
    with path.open("wb") as f:
        for part in parts:
            if isinstance(part, int):
                f.seek(part, 1)
            else:
                f.write(part)
        f.truncate()
    return path


def sparse_headers() -> Iterator[tuple[str, list[Part]]]:
    """Headers declaring more than their disk holds: a few KiB each on disk, GiBs to a reader
    that takes the header's word for it (zeros read as empty strings and arrays)."""
    template = kv("tokenizer.chat_template", T.STRING, Q.pack(1 << 30))
    yield "chat template of 1 GiB", [header([arch(), template]), 1 << 30]
    description = kv("general.description", T.STRING, Q.pack(1 << 30))
    yield "description of 1 GiB", [header([arch(), description]), 1 << 30,
                                   u32("llama.context_length", 2048)]
    empty = 12  # an empty array of bytes: type 0 (UINT8), count 0
    arrays = [header([arch()], kv_count=33)]
    for i in range(32):
        arrays += [kv(f"x{i}", T.ARRAY, struct.pack("<I", T.ARRAY) + Q.pack(1 << 20)),
                   empty << 20]
    yield "32 arrays of 2^20 empty arrays", arrays
    tokens = [header([arch(), kv("tokenizer.ggml.model", T.STRING, string("llama"))],
                     kv_count=3),
              kv("tokenizer.ggml.tokens", T.ARRAY, struct.pack("<I", T.STRING) + Q.pack(100))]
    for _ in range(100):
        tokens += [Q.pack(1 << 20), 1 << 20]
    yield "100 tokens of 1 MiB", tokens
