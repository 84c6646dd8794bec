"""The readers of other tools' model stores, on real layouts built in tmp_path (real symlinks,
manifests and blobs; the fake GGUF files carry only the magic these readers check)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from bunkhouse.catalog import sources
from bunkhouse.catalog.sources import (
    VERIFYING,
    Found,
    hf_cache_models,
    hf_cache_root,
    is_projector,
    lmstudio_models,
    lmstudio_roots,
    ollama_models,
    ollama_root,
)

GGUF = b"GGUF\x03\x00\x00\x00fake"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
MEDIA = "application/vnd.ollama.image."


@pytest.fixture(autouse=True)
def _warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="bunkhouse.catalog.sources")


def warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def ids(found: list[Found]) -> list[str]:
    return [f.id for f in found]


# -- Hugging Face hub cache ---------------------------------------------------------------


def hf_repo(root: Path, name: str, files: dict[str, bytes], commit: str = COMMIT_A,
            ref: str | None = COMMIT_A) -> Path:
    """``root/name`` as huggingface_hub lays it out; returns the snapshot directory."""
    repo = root / name
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(ref)
    return snapshot


def test_hf_files_a_pull_is_still_checking_are_not_listed(tmp_path: Path) -> None:
    """A live pull's marker hides the files it names until its checks pass; a marker whose
    process is gone hides nothing."""
    hf_repo(tmp_path, "models--o--r", {"a-q4_k_m.gguf": GGUF, "b-q8_0.gguf": GGUF + b"b"})
    marker = tmp_path / "models--o--r" / f"{VERIFYING}{os.getpid()}"
    marker.write_text(json.dumps({"pid": os.getpid(), "files": ["a-q4_k_m.gguf"]}))
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:b-q8_0"]
    marker.rename(marker.with_name(f"{VERIFYING}{2**22 + 7}"))  # a pid that runs nothing
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:a-q4_k_m", "o/r:b-q8_0"]


def test_hf_naming_org_repo_repo_only_and_nested_paths(tmp_path: Path) -> None:
    snap = hf_repo(tmp_path, "models--Qwen--Qwen2.5-0.5B-GGUF",
                   {"qwen-q4.gguf": GGUF, "sub/dir/deep.gguf": GGUF + b"2", "README.md": b"hi"})
    hf_repo(tmp_path, "models--gpt2", {"gpt2.gguf": GGUF + b"3"})
    hf_repo(tmp_path, "datasets--org--data", {"x.gguf": GGUF})
    hf_repo(tmp_path, "spaces--org--space", {"x.gguf": GGUF})
    found = list(hf_cache_models(tmp_path))
    assert ids(found) == ["Qwen/Qwen2.5-0.5B-GGUF:qwen-q4", "Qwen/Qwen2.5-0.5B-GGUF:sub/dir/deep",
                          "gpt2:gpt2"]
    assert found[0] == Found("Qwen/Qwen2.5-0.5B-GGUF:qwen-q4", snap / "qwen-q4.gguf", "hf_cache")
    assert found[1].path == snap / "sub" / "dir" / "deep.gguf"  # the link: shards sit by name


def test_hf_refs_main_picks_the_snapshot_else_the_latest(tmp_path: Path) -> None:
    old = hf_repo(tmp_path, "models--o--r", {"old.gguf": GGUF}, commit=COMMIT_A, ref=COMMIT_A)
    new = hf_repo(tmp_path, "models--o--r", {"new.gguf": GGUF + b"n"}, commit=COMMIT_B,
                  ref=COMMIT_A)
    os.utime(old, (1_000_000, 1_000_000))
    os.utime(new, (2_000_000, 2_000_000))
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:old"]
    (tmp_path / "models--o--r" / "refs" / "main").write_text("c" * 40)  # not downloaded
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:new"]
    (tmp_path / "models--o--r" / "refs" / "main").write_text("../../../../etc")
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:new"]
    (tmp_path / "models--o--r" / "refs" / "main").unlink()
    os.utime(old, (3_000_000, 3_000_000))
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:old"]


def test_hf_split_models_and_projectors(tmp_path: Path) -> None:
    snap = hf_repo(tmp_path, "models--o--vision", {
        "m-00001-of-00002.gguf": GGUF + b"1", "m-00002-of-00002.gguf": GGUF + b"2",
        "mmproj-model-f16.gguf": GGUF + b"p1", "mmproj-model-q8.gguf": GGUF + b"p2",
        "other.gguf": GGUF + b"o", "sub/alone.gguf": GGUF + b"s",
    })
    found = {f.id: f for f in hf_cache_models(tmp_path)}
    assert sorted(found) == ["o/vision:m", "o/vision:other", "o/vision:sub/alone"]
    assert found["o/vision:m"].path == snap / "m-00001-of-00002.gguf"
    assert found["o/vision:m"].projector == snap / "mmproj-model-f16.gguf"
    assert found["o/vision:other"].projector == snap / "mmproj-model-f16.gguf"
    assert found["o/vision:sub/alone"].projector is None


def test_hf_missing_blob_is_skipped_with_a_warning(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    snap = hf_repo(tmp_path, "models--o--r", {"ok.gguf": GGUF})
    (snap / "partial.gguf").symlink_to("../../blobs/" + "f" * 64)
    (tmp_path / "models--o--r" / "blobs" / ("f" * 64 + ".incomplete")).write_bytes(b"GG")
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:ok"]
    assert "partial.gguf" in warnings(caplog) and "missing" in warnings(caplog)


def test_hf_links_outside_the_repo_are_skipped(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    other = hf_repo(tmp_path, "models--o--other", {"theirs.gguf": GGUF + b"x"})
    snap = hf_repo(tmp_path, "models--o--r", {})
    outside = tmp_path.parent / f"{tmp_path.name}-outside.gguf"
    outside.write_bytes(GGUF)
    (snap / "abs.gguf").symlink_to(outside)
    (snap / "passwd.gguf").symlink_to("/etc/passwd")
    (snap / "cross.gguf").symlink_to(os.path.relpath((other / "theirs.gguf").resolve(), snap))
    assert ids(list(hf_cache_models(tmp_path))) == ["o/other:theirs"]
    for name in ("abs.gguf", "passwd.gguf", "cross.gguf"):
        assert f"{name}: it links outside" in warnings(caplog)


def test_hf_symlink_loops_and_fifos_do_not_hang(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    snap = hf_repo(tmp_path, "models--o--r", {"ok.gguf": GGUF})
    (snap / "self.gguf").symlink_to("self.gguf")
    (snap / "sub").symlink_to(".")  # a directory loop: never followed
    os.mkfifo(tmp_path / "models--o--r" / "blobs" / "fifo")
    (snap / "fifo.gguf").symlink_to("../../blobs/fifo")
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:ok"]
    assert "self.gguf" in warnings(caplog)
    assert "fifo.gguf: not a regular file" in warnings(caplog)


def test_hf_bad_ids_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf_repo(tmp_path, "models--o--r", {"has space.gguf": GGUF, "x" * 130 + ".gguf": GGUF + b"1",
                                       "fine.gguf": GGUF + b"2"})
    assert ids(list(hf_cache_models(tmp_path))) == ["o/r:fine"]
    assert "has space" in warnings(caplog) and "x" * 130 in warnings(caplog)


def test_hf_cache_root_follows_huggingface_hub(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_root() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert hf_cache_root() == Path("/xdg/huggingface/hub")
    monkeypatch.setenv("HF_HOME", "/hf")
    assert hf_cache_root() == Path("/hf/hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/hub")
    assert hf_cache_root() == Path("/hub")


# -- Ollama -------------------------------------------------------------------------------


def blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def manifest(root: Path, name: str, layers: list[dict[str, Any]] | None = None,
             raw: bytes | None = None) -> Path:
    """``root/manifests/<name>`` (``host/namespace/model/tag``) holding an OCI manifest."""
    path = root / "manifests" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schemaVersion": 2,
           "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      "digest": blob(root, b"{}"), "size": 2},
           "layers": layers}
    path.write_bytes(raw if raw is not None else json.dumps(doc).encode())
    return path


def layer(root: Path, kind: str, data: bytes) -> dict[str, Any]:
    return {"mediaType": MEDIA + kind, "digest": blob(root, data), "size": len(data)}


def test_ollama_names_as_ollama_shows_them(tmp_path: Path) -> None:
    manifest(tmp_path, "registry.ollama.ai/library/llama3.2/1b",
             [layer(tmp_path, "model", GGUF + b"1")])
    manifest(tmp_path, "registry.ollama.ai/bob/mine/latest",
             [layer(tmp_path, "model", GGUF + b"2")])
    manifest(tmp_path, "hf.co/bartowski/Qwen2.5-GGUF/Q4_K_M",
             [layer(tmp_path, "model", GGUF + b"3")])
    found = list(ollama_models(tmp_path))
    assert ids(found) == ["bob/mine:latest", "hf.co/bartowski/Qwen2.5-GGUF:Q4_K_M",
                          "llama3.2:1b"]
    digest = hashlib.sha256(GGUF + b"2").hexdigest()
    assert found[0] == Found("bob/mine:latest", tmp_path / "blobs" / f"sha256-{digest}", "ollama")


def test_ollama_reads_template_params_system_and_projector(tmp_path: Path) -> None:
    manifest(tmp_path, "registry.ollama.ai/library/llava/7b", [
        layer(tmp_path, "model", GGUF),
        layer(tmp_path, "projector", GGUF + b"proj"),
        layer(tmp_path, "template", "{{ .System }} {{ .Prompt }} é".encode()),
        layer(tmp_path, "params", b'{"stop": ["</s>"], "temperature": 0.7}'),
        layer(tmp_path, "system", b"You are terse."),
        layer(tmp_path, "license", b"MIT"),
    ])
    [found] = ollama_models(tmp_path)
    assert found.projector == tmp_path / "blobs" / (
        "sha256-" + hashlib.sha256(GGUF + b"proj").hexdigest())
    assert found.template == "{{ .System }} {{ .Prompt }} é"
    assert found.params == {"stop": ["</s>"], "temperature": 0.7}
    assert found.system == "You are terse."


def test_ollama_unusable_optional_layers_are_ignored(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    manifest(tmp_path, "registry.ollama.ai/library/m/t", [
        layer(tmp_path, "model", GGUF),
        layer(tmp_path, "template", b"x" * (1024 * 1024 + 1)),
        layer(tmp_path, "params", b'["not", "an", "object"]'),
        layer(tmp_path, "system", b"\xff\xfe not utf-8"),
        layer(tmp_path, "projector", b"not gguf"),
    ])
    [found] = ollama_models(tmp_path)
    assert (found.template, found.params, found.system, found.projector) == (None, {}, None, None)
    for kind in ("template", "params", "system", "projector"):
        assert f"ignoring the {kind} layer" in warnings(caplog)


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b'{"layers": {}}', b'{"layers": [1]}',
    b'{"layers": [{"mediaType": "application/vnd.ollama.image.model"}]}',
    b'{"layers": [{"mediaType": 3, "digest": "sha256:' + b"0" * 64 + b'"}]}',
    b'{"layers": [{"mediaType": "application/vnd.ollama.image.model", '
    b'"digest": "sha256:../../etc/passwd"}]}',
    b'{"layers": [{"mediaType": "application/vnd.ollama.image.model", '
    b'"digest": "sha256:' + b"A" * 64 + b'"}]}',
    b"[" * 100_000,
    b"\xff\xfe",
])
def test_ollama_bad_manifests_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                          raw: bytes) -> None:
    manifest(tmp_path, "registry.ollama.ai/library/ok/latest", [layer(tmp_path, "model", GGUF)])
    bad = manifest(tmp_path, "registry.ollama.ai/library/bad/latest", raw=raw)
    assert ids(list(ollama_models(tmp_path))) == ["ok:latest"]
    assert f"skipping {bad}" in warnings(caplog)


def test_ollama_huge_manifest_is_not_read(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    path = manifest(tmp_path, "registry.ollama.ai/library/big/latest", raw=b"")
    with path.open("r+b") as f:
        f.truncate(10 * 1024 * 1024)
    assert list(ollama_models(tmp_path)) == []
    assert "larger than" in warnings(caplog)


def test_ollama_model_layer_problems(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path
    manifest(root, "registry.ollama.ai/library/none/latest", [layer(root, "adapter", GGUF)])
    manifest(root, "registry.ollama.ai/library/two/latest",
             [layer(root, "model", GGUF), layer(root, "model", GGUF + b"2")])
    manifest(root, "registry.ollama.ai/library/missing/latest",
             [{"mediaType": MEDIA + "model", "digest": "sha256:" + "0" * 64, "size": 1}])
    manifest(root, "registry.ollama.ai/library/safetensors/latest",
             [layer(root, "model", b"\x00\x00not gguf")])
    os.mkfifo(root / "blobs" / ("sha256-" + "1" * 64))
    manifest(root, "registry.ollama.ai/library/fifo/latest",
             [{"mediaType": MEDIA + "model", "digest": "sha256:" + "1" * 64, "size": 1}])
    os.mkfifo(root / "manifests" / "registry.ollama.ai" / "library" / "fifo" / "pipe")
    assert list(ollama_models(root)) == []
    text = warnings(caplog)
    assert "none/latest: 0 model layers" in text and "two/latest: 2 model layers" in text
    assert "missing/latest: model layer sha256-0000" in text
    assert "safetensors/latest: model layer" in text and "not a GGUF model layer" in text
    assert "fifo/latest: model layer" in text and "not a regular file" in text
    assert "fifo/pipe: not a regular file" in text


def test_ollama_traversal_digest_builds_no_path(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "models"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_bytes(GGUF)  # what the traversal would reach
    manifest(root, "registry.ollama.ai/library/evil/latest",
             [{"mediaType": MEDIA + "model", "digest": "sha256:../../etc/passwd"}])
    manifest(root, "registry.ollama.ai/library/evil2/latest",
             [layer(root, "model", GGUF),
              {"mediaType": MEDIA + "template", "digest": "sha256:../../etc/passwd"}])
    assert list(ollama_models(root)) == []
    assert warnings(caplog).count("is not sha256:<64 hex digits>") == 2


def test_ollama_only_four_levels_and_visible_names(tmp_path: Path) -> None:
    model = [layer(tmp_path, "model", GGUF)]
    manifest(tmp_path, "registry.ollama.ai/library/ok/latest", model)
    manifest(tmp_path, "registry.ollama.ai/library/shallow", model)
    manifest(tmp_path, "registry.ollama.ai/library/deep/er/latest", model)
    manifest(tmp_path, "registry.ollama.ai/library/.hidden/latest", model)
    manifest(tmp_path, "registry.ollama.ai/library/ok/.tmp-latest", model)
    assert ids(list(ollama_models(tmp_path))) == ["ok:latest"]


def test_ollama_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ollama_root() == tmp_path / ".ollama" / "models"
    monkeypatch.setenv("OLLAMA_MODELS", "/srv/ollama")
    assert ollama_root() == Path("/srv/ollama")


# -- LM Studio ----------------------------------------------------------------------------


def test_lmstudio_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "lmstudio-community" / "gemma-3-4b-it-GGUF"
    repo.mkdir(parents=True)
    (repo / "gemma-3-4b-it-Q4_K_M.gguf").write_bytes(GGUF)
    (repo / "mmproj-model-f16.gguf").write_bytes(GGUF)
    split = tmp_path / "pub" / "big"
    split.mkdir(parents=True)
    for i in (1, 2):
        (split / f"big-0000{i}-of-00002.gguf").write_bytes(GGUF)
    (split / "linked.gguf").symlink_to(repo / "gemma-3-4b-it-Q4_K_M.gguf")
    (split / "notes.txt").write_bytes(b"")
    (tmp_path / "loose.gguf").write_bytes(GGUF)  # not publisher/repo/file
    (tmp_path / "pub" / "loose.gguf").write_bytes(GGUF)
    found = list(lmstudio_models(tmp_path))
    assert found == [
        Found("lmstudio-community/gemma-3-4b-it-GGUF/gemma-3-4b-it-Q4_K_M",
              repo / "gemma-3-4b-it-Q4_K_M.gguf", "lmstudio", repo / "mmproj-model-f16.gguf"),
        Found("pub/big/big", split / "big-00001-of-00002.gguf", "lmstudio"),
        Found("pub/big/linked", split / "linked.gguf", "lmstudio"),
    ]
    assert warnings(caplog) == ""


def test_lmstudio_skips_what_is_not_a_gguf_file(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "pub" / "repo"
    repo.mkdir(parents=True)
    (repo / "ok.gguf").write_bytes(GGUF)
    (repo / "html.gguf").write_bytes(b"<html>")
    (repo / "empty.gguf").write_bytes(b"")
    os.mkfifo(repo / "fifo.gguf")
    (repo / "dir.gguf").mkdir()
    (repo / "loop.gguf").symlink_to("loop.gguf")
    (repo / "dangling.gguf").symlink_to("nowhere")
    (repo / "up").symlink_to("..")  # a directory loop: never followed
    (repo / ".hidden.gguf").write_bytes(GGUF)
    with open(os.path.join(os.fsencode(repo), b"bad-\xff.gguf"), "wb") as f:
        f.write(GGUF)
    assert ids(list(lmstudio_models(tmp_path))) == ["pub/repo/ok"]
    text = warnings(caplog)
    for name in ("html.gguf: not a GGUF file", "empty.gguf: not a GGUF file",
                 "fifo.gguf: not a regular file", "loop.gguf", "dangling.gguf: missing",
                 "not UTF-8"):
        assert name in text
    assert "hidden" not in text


def test_lmstudio_roots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LMSTUDIO_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert lmstudio_roots() == []
    (tmp_path / ".cache" / "lm-studio" / "models").mkdir(parents=True)
    assert lmstudio_roots() == [tmp_path / ".cache" / "lm-studio" / "models"]
    (tmp_path / ".lmstudio" / "models").mkdir(parents=True)
    assert lmstudio_roots() == [tmp_path / ".lmstudio" / "models",
                                tmp_path / ".cache" / "lm-studio" / "models"]
    monkeypatch.setenv("LMSTUDIO_MODELS", "/models")
    assert lmstudio_roots() == [Path("/models")]


# -- all readers --------------------------------------------------------------------------


def test_missing_roots_yield_nothing_quietly(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "nope"
    assert list(hf_cache_models(missing)) == []
    assert list(ollama_models(missing)) == []
    assert list(lmstudio_models(missing)) == []
    assert warnings(caplog) == ""


def test_a_root_that_is_a_file_yields_nothing(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(GGUF)
    assert list(hf_cache_models(tmp_path / "file")) == []
    assert list(lmstudio_models(tmp_path / "file")) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads directories whatever their mode")
def test_unreadable_directories_are_skipped(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    locked = tmp_path / "pub" / "locked"
    locked.mkdir(parents=True)
    (locked / "x.gguf").write_bytes(GGUF)
    (tmp_path / "pub" / "open").mkdir()
    (tmp_path / "pub" / "open" / "y.gguf").write_bytes(GGUF)
    locked.chmod(0)
    try:
        assert ids(list(lmstudio_models(tmp_path))) == ["pub/open/y"]
        assert f"skipping {locked}" in warnings(caplog)
        tmp_path.chmod(0)
        try:
            assert list(hf_cache_models(tmp_path)) == []
            assert list(lmstudio_models(tmp_path)) == []
        finally:
            tmp_path.chmod(0o755)
        assert f"skipping {tmp_path}" in warnings(caplog)
    finally:
        locked.chmod(0o755)


def test_permission_errors_are_skipped_even_as_root(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The same paths as above, for runs as root: scandir refused for chosen directories."""
    hf_repo(tmp_path / "hf", "models--o--locked", {"x.gguf": GGUF})
    hf_repo(tmp_path / "hf", "models--o--open", {"y.gguf": GGUF})
    manifest(tmp_path / "ol", "registry.ollama.ai/library/x/latest",
             [layer(tmp_path / "ol", "model", GGUF)])
    refused = {tmp_path / "hf" / "models--o--locked" / "snapshots", tmp_path / "ol" / "manifests"}
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:
        if Path(path) in refused:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert ids(list(hf_cache_models(tmp_path / "hf"))) == ["o/open:y"]
    assert list(ollama_models(tmp_path / "ol")) == []
    for path in refused:
        assert f"skipping {path}: Permission denied" in warnings(caplog)


def test_walks_stop_at_the_entry_and_depth_bounds(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "pub" / "repo"
    repo.mkdir(parents=True)
    for i in range(10):
        (repo / f"m{i}.gguf").write_bytes(GGUF)
    deep = tmp_path.joinpath("pub", "repo", *"abcdefgh")
    deep.mkdir(parents=True)
    (deep / "deep.gguf").write_bytes(GGUF)
    assert len(list(lmstudio_models(tmp_path))) == 10  # deep.gguf is 10 levels down
    monkeypatch.setattr(sources, "_MAX_ENTRIES", 6)
    assert len(list(lmstudio_models(tmp_path))) < 10
    assert "stopped after 6 entries" in warnings(caplog)


def test_is_projector() -> None:
    assert is_projector(Path("mmproj-model-f16.gguf"))
    assert is_projector(Path("Qwen2-VL-MMPROJ.gguf"))
    assert not is_projector(Path("model.gguf"))
