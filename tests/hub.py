"""A local Hugging Face hub: the part of the hub's HTTP API that ``huggingface_hub`` calls to
pull a model, reached through ``HF_ENDPOINT``.

- ``GET /api/models/{org}/{repo}[/revision/{rev}]``: the model info, with each file's size
  and LFS sha256 when asked (``blobs=true``);
- ``HEAD|GET /{org}/{repo}/resolve/{rev}/{path}``: the file, with the hub's headers
  (``X-Repo-Commit``, ``ETag``/``X-Linked-Etag`` = the sha256, ``X-Linked-Size``) and ranges
  (``Range: bytes=N-``: a 206 from byte N).

Faults a test sets on a file: ``drop_after`` (the first download's connection is cut after
that many bytes, once), ``flip`` (every byte served inverted), ``declared`` (a size and
sha256 that are not the file's: a file the disk cannot hold), ``delay_s`` (a pause before
each chunk of :data:`CHUNK` bytes: a download slow enough to cancel). Unknown repos and files get
the hub's 404s (``X-Error-Code``). ``gets`` counts the downloads begun per file."""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CHUNK = 256 * 1024


@dataclass
class HubFile:
    path: Path
    size: int
    sha256: str
    drop_after: int | None = None
    flip: bool = False
    declared: int | None = None  # a size declared in place of the real one
    delay_s: float = 0.0  # a pause before each chunk: a slow download


def hub_file(path: Path) -> HubFile:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * 2**20):
            digest.update(chunk)
    return HubFile(path, path.stat().st_size, digest.hexdigest())


class Hub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, HubFile]] = {}
        self.commits: dict[str, str] = {}
        self.gets: Counter[str] = Counter()  # "repo/path": downloads begun (not resumptions)

    def add(self, repo: str, files: dict[str, HubFile]) -> None:
        self.repos[repo] = files
        self.commits[repo] = hashlib.sha1(repo.encode()).hexdigest()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/api/models/{org}/{name}", self._info),
            Route("/api/models/{org}/{name}/revision/{rev}", self._info),
            Route("/{org}/{name}/resolve/{rev}/{path:path}", self._resolve,
                  methods=["GET", "HEAD"]),
        ])

    def _repo(self, request: Request) -> tuple[str, dict[str, HubFile]] | Response:
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        found = next((r for r in self.repos if r.lower() == repo.lower()), None)
        if found is None:
            return JSONResponse({"error": "Repository not found"}, 404,
                                headers={"X-Error-Code": "RepoNotFound"})
        return found, self.repos[found]

    async def _info(self, request: Request) -> Response:
        got = self._repo(request)
        if isinstance(got, Response):
            return got
        repo, files = got
        blobs = request.query_params.get("blobs", "").lower() == "true"
        siblings = []
        for name, f in sorted(files.items()):
            size = f.declared or f.size
            sibling: dict[str, object] = {"rfilename": name}
            if blobs:
                sibling |= {"size": size, "blobId": hashlib.sha1(name.encode()).hexdigest(),
                            "lfs": {"sha256": self._sha(f), "size": size, "pointerSize": 134}}
            siblings.append(sibling)
        return JSONResponse({"_id": repo, "id": repo, "modelId": repo,
                             "sha": self.commits[repo], "private": False, "gated": False,
                             "disabled": False, "tags": ["gguf"], "siblings": siblings})

    @staticmethod
    def _sha(f: HubFile) -> str:
        return hashlib.sha256(f.sha256.encode()).hexdigest() if f.declared else f.sha256

    async def _resolve(self, request: Request) -> Response:
        got = self._repo(request)
        if isinstance(got, Response):
            return got
        repo, files = got
        path = request.path_params["path"]
        f = files.get(path)
        if f is None:
            return JSONResponse({"error": "Entry not found"}, 404,
                                headers={"X-Error-Code": "EntryNotFound",
                                         "X-Repo-Commit": self.commits[repo]})
        size = f.declared or f.size
        headers = {"X-Repo-Commit": self.commits[repo], "ETag": f'"{self._sha(f)}"',
                   "X-Linked-Etag": f'"{self._sha(f)}"', "X-Linked-Size": str(size),
                   "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(size)})
        start = 0
        ranged = request.headers.get("range", "")
        if ranged.startswith("bytes="):
            start = int(ranged.removeprefix("bytes=").split("-")[0] or 0)
        else:
            self.gets[f"{repo}/{path}"] += 1
        drop = f.drop_after
        if drop is not None and start == 0:
            f.drop_after = None  # once
        body = self._body(f, start, drop)
        if start:
            return StreamingResponse(body, 206, headers={
                **headers, "Content-Length": str(size - start),
                "Content-Range": f"bytes {start}-{size - 1}/{size}"})
        return StreamingResponse(body, 200, headers={**headers, "Content-Length": str(size)})

    @staticmethod
    def _body(f: HubFile, start: int, drop: int | None) -> Iterator[bytes]:
        """The file from ``start`` (Starlette reads a plain iterator in its thread pool)."""
        sent = 0
        with open(f.path, "rb") as fh:
            fh.seek(start)
            while chunk := fh.read(CHUNK):
                if f.delay_s:
                    time.sleep(f.delay_s)
                if drop is not None and sent + len(chunk) > drop:
                    yield chunk[: drop - sent]
                    raise ConnectionResetError("the test hub drops the connection")
                sent += len(chunk)
                yield (np.frombuffer(chunk, np.uint8) ^ 0xFF).tobytes() if f.flip else chunk
