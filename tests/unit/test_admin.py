"""Runtime control endpoints: every status code and every path escape, with fake workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from bunkhouse.catalog import CatalogModel, build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.errors import WorkerLoadFailed
from bunkhouse.front.admin import AdminOptions
from bunkhouse.front.auth import Keys
from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions
from tests.fakes import FakeWorker
from tests.helpers import front_app, write_tiny_gguf

ADMIN = {"authorization": "Bearer admin-key"}
CLIENT = {"authorization": "Bearer client-key"}


@dataclass
class Setup:
    client: TestClient
    root: Path
    outside: Path
    starts: list[str] = field(default_factory=list)
    failing: set[str] = field(default_factory=set)
    residency: ResidencyManager | None = None


def _make(tmp_path: Path, allow: bool) -> Iterator[Setup]:
    root, outside, models = tmp_path / "root", tmp_path / "outside", tmp_path / "models"
    write_tiny_gguf(root / "ok.gguf")
    write_tiny_gguf(root / "bad.gguf")
    write_tiny_gguf(outside / "secret.gguf")
    write_tiny_gguf(models / "conf.gguf")
    (root / "notes.txt").write_text("not a model")
    (root / "subdir").mkdir()
    os.symlink(outside / "secret.gguf", root / "link.gguf")
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'include_packaged = false\n[[models]]\nid = "conf"\n'
                      f'path = "{models / "conf.gguf"}"\npinned = true\n')
    catalog = build_catalog(load_config_file(config, Settings()), engines=ENGINES)
    starts: list[str] = []
    failing: set[str] = set()

    async def start(model: CatalogModel) -> Any:
        starts.append(model.id)
        if model.path.name in failing:
            raise WorkerLoadFailed("model failed to load: llama_model_load: bad tensor data")
        return FakeWorker(model)

    residency = ResidencyManager(catalog, ResidencyOptions(budget_bytes=2**34), start)
    app = front_app(catalog, residency, keys=Keys(["client-key"], ["admin-key"]),
                    admin_options=AdminOptions(allow_runtime_load=allow, roots=(root,)))
    with TestClient(app, base_url="http://localhost") as client:
        yield Setup(client, root, outside, starts, failing, residency)


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[Setup]:
    yield from _make(tmp_path, allow=True)


def _register(s: Setup, path: object, model_id: str = "rt", headers: dict[str, str] = ADMIN,
              **extra: Any) -> Any:
    return s.client.post("/v1/models", json={"id": model_id, "path": path, **extra},
                         headers=headers)


def test_register_list_delete(admin: Setup) -> None:
    resp = _register(admin, str(admin.root / "ok.gguf"), context=1024, pinned=True)
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "ready" and resp.json()["pinned"] is True
    ids = [m["id"] for m in admin.client.get("/v1/models", headers=CLIENT).json()["data"]]
    assert ids == ["conf", "rt"]
    assert admin.client.delete("/v1/models/rt", headers=ADMIN).status_code == 204
    ids = [m["id"] for m in admin.client.get("/v1/models", headers=CLIENT).json()["data"]]
    assert ids == ["conf"]  # runtime models leave the catalog
    assert admin.client.get("/v1/models/rt", headers=CLIENT).status_code == 404


def test_duplicate_id_is_409(admin: Setup) -> None:
    assert _register(admin, str(admin.root / "ok.gguf")).status_code == 200
    resp = _register(admin, str(admin.root / "ok.gguf"))
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "conflict"
    assert _register(admin, str(admin.root / "ok.gguf"), model_id="conf").status_code == 409


def test_load_failure_is_400_with_the_engines_reason(admin: Setup) -> None:
    admin.failing.add("bad.gguf")
    resp = _register(admin, str(admin.root / "bad.gguf"))
    assert resp.status_code == 400 and "bad tensor data" in resp.json()["error"]["message"]
    assert admin.client.get("/v1/models/rt", headers=CLIENT).status_code == 404


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("{outside}/secret.gguf", 403),  # absolute path outside the roots
        ("{root}/../outside/secret.gguf", 403),  # .. escape
        ("{root}/link.gguf", 403),  # a symlink inside a root pointing outside
        ("/etc/passwd", 403),
        ("{root}/ok\u0000.gguf", 400),  # NUL
        ("{root}/subdir", 400),  # a directory
        ("{root}/notes.txt", 400),  # not a GGUF
        ("{root}/missing.gguf", 400),
    ],
)
def test_path_escapes_and_bad_files_load_nothing(admin: Setup, path: str, status: int) -> None:
    resp = _register(admin, path.format(root=admin.root, outside=admin.outside))
    assert resp.status_code == status, resp.text
    assert admin.starts == []


@pytest.mark.parametrize(
    ("headers", "status"), [({}, 401), ({"authorization": "Bearer nope"}, 401), (CLIENT, 403)])
def test_control_needs_the_admin_key(admin: Setup, headers: dict[str, str],
                                     status: int) -> None:
    assert _register(admin, str(admin.root / "ok.gguf"), headers=headers).status_code == status
    for method, url in (("POST", "/v1/models/conf/load"), ("POST", "/v1/models/conf/pin"),
                        ("DELETE", "/v1/models/conf")):
        assert admin.client.request(method, url, headers=headers).status_code == status
    assert admin.starts == []


def test_disabled_runtime_loading_is_403(tmp_path: Path) -> None:
    for setup in _make(tmp_path, allow=False):
        resp = _register(setup, str(setup.root / "ok.gguf"))
        assert resp.status_code == 403 and "--allow-runtime-load" in resp.text
        assert setup.starts == []


def test_bad_bodies_are_400(admin: Setup) -> None:
    assert _register(admin, str(admin.root / "ok.gguf"), colour="red").status_code == 400
    assert _register(admin, 42).status_code == 400
    assert _register(admin, str(admin.root / "ok.gguf"), model_id="bad id!").status_code == 400
    for unreachable in ("abc\n", "a/../b", "a//b", "a/."):  # no URL reaches these ids
        resp = _register(admin, str(admin.root / "ok.gguf"), model_id=unreachable)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "id", resp.text
    assert _register(admin, str(admin.root / "ok.gguf"), parallel=0).status_code == 400


def test_catalog_models_load_pin_unpin_unload(admin: Setup) -> None:
    c = admin.client
    assert c.delete("/v1/models/nope", headers=ADMIN).status_code == 404
    assert c.delete("/v1/models/conf", headers=ADMIN).status_code == 409  # pinned by config
    loaded = c.post("/v1/models/conf/load", headers=ADMIN)
    assert loaded.status_code == 200 and loaded.json()["state"] == "ready"
    assert c.post("/v1/models/conf/unpin", headers=ADMIN).json()["pinned"] is False
    assert c.post("/v1/models/conf/pin", headers=ADMIN).json()["pinned"] is True
    assert c.post("/v1/models/conf/unload", headers=ADMIN).status_code == 204
    assert c.get("/v1/models/conf", headers=CLIENT).json()["state"] == "absent"
    assert c.post("/v1/models/conf/explode", headers=ADMIN).status_code == 404


def test_a_failed_registration_leaves_no_ghost_and_a_new_one_gets_a_fresh_slot_gate(
        admin: Setup) -> None:
    admin.failing.add("bad.gguf")
    assert _register(admin, str(admin.root / "bad.gguf"), parallel=1).status_code == 400
    assert "rt" not in admin.client.get("/health", headers=CLIENT).json()["models"]
    stats = admin.client.get("/stats", headers=CLIENT).json()
    assert "rt" not in [m["id"] for m in stats["models"]]
    resp = _register(admin, str(admin.root / "ok.gguf"), parallel=3, queue=5)
    assert resp.status_code == 200, resp.text
    assert resp.json()["parallel"] == 3 and resp.json()["queue"] == 5
    assert admin.client.get("/health", headers=CLIENT).json()["models"]["rt"] == "ready"
    assert admin.client.delete("/v1/models/rt", headers=ADMIN).status_code == 204
    assert _register(admin, str(admin.root / "ok.gguf"), parallel=2).status_code == 200
    assert admin.residency is not None and admin.residency.slots("rt").slots == 2


def test_a_config_pinned_model_can_be_deleted_once_unpinned(admin: Setup) -> None:
    resp = admin.client.delete("/v1/models/conf", headers=ADMIN)
    assert resp.status_code == 409 and "unpin it first" in resp.json()["error"]["message"]
    assert admin.client.post("/v1/models/conf/unpin", headers=ADMIN).status_code == 200
    assert admin.client.delete("/v1/models/conf", headers=ADMIN).status_code == 204


def test_a_registration_s_engine_must_serve_gguf_files(admin: Setup) -> None:
    for engine in ("whisper", "nope", ""):
        resp = _register(admin, str(admin.root / "ok.gguf"), engine=engine)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "engine", resp.text
    resp = _register(admin, str(admin.root / "ok.gguf"), adapter_of="conf",
                     engine="llama-server")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "engine", resp.text
    resp = _register(admin, str(admin.root / "ok.gguf"), engine="llama-server",
                     args=["--lookup-cache-dynamic", "/tmp/x"])
    assert resp.status_code == 400 and "args" in resp.text, resp.text  # the config file's only
    assert admin.starts == []
