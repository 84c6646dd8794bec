"""Shared test helpers: deadlines instead of sleeps, tiny GGUF files, free ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import gguf
import httpx
import numpy as np
import psutil

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]  # the repository's root
CHILD_PYTHONPATH = os.pathsep.join([str(REPO / "src"), str(REPO)])
"""A child process's PYTHONPATH: this checkout's code (not another an editable install points
at) and the tests' modules (the fault engine)."""


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str,
             interval_s: float = 0.05) -> T:
    """Poll ``check`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(interval_s)


def still_running(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs on: a process that died but that init has not reaped yet is a
    zombie, gone (the init of some sandboxes reaps adopted children seconds late)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_tiny_gguf(path: Path, arch: str = "llama", *, context: int = 2048,
                    chat_template: str | None = "{{ messages }}",
                    sliding_window: int | None = None, vocab: int = 300,
                    attention: bool = False) -> Path:
    """A small but well-formed GGUF file (metadata like a real model's, one tensor;
    ``attention``: and each block's ``attn_q`` and ``attn_v``, which a LoRA adapts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(context)
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_file_type(15)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    for block in range(4 if attention else 0):  # numpy's (n_out, n_in): 8 heads, 2 for KV
        w.add_tensor(f"blk.{block}.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
        w.add_tensor(f"blk.{block}.attn_v.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def whisper_dir(root: Path, name: str = "my-whisper", tokenizer: bool = True) -> Path:
    """A directory shaped like a CTranslate2 Whisper model's (its weights are zeros)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(b"\0" * 1000)
    (path / "config.json").write_text(json.dumps({"suppress_ids": []}))
    (path / "vocabulary.txt").write_text("a\nb\n")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path

def app_without_workers(root: Path, **build_app_kwargs: Any) -> Any:
    """The front over one tiny GGUF in ROOT, whose workers must never be reached: for tests of
    the HTTP edge (validation, auth, limits) that a request to a worker would defeat."""
    from bunkhouse.catalog import build_catalog
    from bunkhouse.config import Settings
    from bunkhouse.engines import ENGINES
    from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions

    write_tiny_gguf(root / "tiny.gguf")
    catalog = build_catalog(Settings(models_dirs=(root,), include_packaged=False), engines=ENGINES)

    async def no_workers(model: object) -> Any:
        raise AssertionError("no request here may reach a worker")

    residency = ResidencyManager(catalog, ResidencyOptions(budget_bytes=2**30), no_workers)
    return front_app(catalog, residency, **build_app_kwargs)


def front_app(catalog: Any, residency: Any, **given: Any) -> Any:
    """The front's app, ``given`` named by the fields of its ``Parts`` and ``FrontOptions``
    (``admin_options``: ``FrontOptions.admin``)."""
    import dataclasses

    from bunkhouse.front.app import FrontOptions, Parts, build_app

    if "admin_options" in given:
        given["admin"] = given.pop("admin_options")
    part_names = {f.name for f in dataclasses.fields(Parts)}
    parts = Parts(**{k: v for k, v in given.items() if k in part_names})
    options = FrontOptions(**{k: v for k, v in given.items() if k not in part_names})
    return build_app(catalog, residency, parts, options)


def healthy_socket(sock: Path) -> bool:
    """Whether a worker answers /health 200 on the Unix socket ``sock``."""
    if not sock.exists():
        return False
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as c:
            return c.get("http://w/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def worker_socket(model: Any) -> Iterator[Path]:
    """`python -m bunkhouse.worker` serving ``model`` (a CatalogModel) on a socket in a
    private directory; SIGTERMed on exit, which must end it with code 0."""
    from bunkhouse.supervisor.process import LaunchOptions, WorkerLaunch, worker_argv

    with tempfile.TemporaryDirectory(prefix="bh-test-") as d:
        sock = Path(d) / "w.sock"
        launch = WorkerLaunch(sock, LaunchOptions(ready_timeout_s=60, stop_grace_s=5))
        proc = subprocess.Popen(worker_argv(model, launch), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: proc.poll() is not None or healthy_socket(sock), 120, "worker health")
            assert proc.poll() is None, "worker exited during load"
            yield sock
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        assert not sock.exists()


def split_gguf(src: Path, out: Path) -> list[Path]:
    """``src`` written again as a model split into two files, as llama.cpp's gguf-split names
    them (``out`` less ``.gguf``, then ``-00001-of-00002.gguf``, ``-00002-of-00002.gguf``).
    About ten seconds for Gemma 3 270M (its 262k-token vocabulary is read whole)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=len(reader.tensors) // 2 + 1)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    stem = out.name.removesuffix(".gguf")
    return [out.with_name(f"{stem}-{i:05d}-of-00002.gguf") for i in (1, 2)]


def listening_socket(pid: int) -> str:
    """The Unix socket a worker process listens on (a spare that became a worker keeps its
    spare's command line, so it is found from the process's sockets, not its arguments)."""
    for conn in psutil.Process(pid).net_connections(kind="unix"):
        if isinstance(conn.laddr, str) and conn.laddr.endswith(".sock"):
            return conn.laddr
    raise AssertionError(f"worker pid {pid} listens on no socket")


@contextmanager
def served(app: Any, limits: Any = None) -> Iterator[str]:
    """``app`` behind uvicorn with bunkhouse's HTTP protocol (front/heads.py, ``limits``: a
    HeadLimits) on a free loopback port, in a thread; yields its URL. Real connections, and
    bounds a test may shrink, where a `bunkhouse serve` would take minutes."""
    import threading

    import uvicorn

    from bunkhouse.front.heads import HeadLimits, bounded_http

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           http=bounded_http(limits or HeadLimits()),
                                           log_level="warning", timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 60, "uvicorn to start")
        assert thread.is_alive(), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def silent_flac(seconds: float, rate: int = 16_000, layout: str = "mono",
                declared_s: float | None = None) -> bytes:
    """A FLAC file of ``seconds`` of silence, made with PyAV (an hour of it is 656 KB);
    ``declared_s``: what its header (STREAMINFO's total samples) says instead, a lie."""
    import io

    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout=layout)
        block = 1 << 16
        zeros = np.zeros((len(av.AudioLayout(layout).channels), block), dtype=np.int16)
        for start in range(0, int(seconds * rate), block):
            frame = av.AudioFrame.from_ndarray(zeros, format="s16p", layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    data = bytearray(out.getvalue())
    if declared_s is not None:  # the low 36 bits of STREAMINFO's bytes 10-17
        fields = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)
        data[18:26] = (fields | int(declared_s * rate)).to_bytes(8, "big")
    return bytes(data)


async def asgi_messages(response: Any, out: Any = None) -> list[dict[str, Any]]:
    """The ASGI messages ``response`` (a Starlette response, or the front's relay) sends to a
    client that never disconnects; each also put on ``out`` (an asyncio.Queue) as sent."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if out is not None:
            await out.put(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    return sent


async def asgi_body(response: Any) -> bytes:
    """The body ``response`` sends (see :func:`asgi_messages`)."""
    return b"".join(m.get("body", b"") for m in await asgi_messages(response)
                    if m["type"] == "http.response.body")
