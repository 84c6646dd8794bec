"""LoRA adapters as models of their own: config, catalog, residency's Mount, slots' and
snapshot keys' adapter setting, the llama.cpp adapter. Tiny GGUFs and LoRAs in tmp_path
(the unit layer opens no packaged model), residency's step driven by hand, no worker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from bunkhouse.catalog import CatalogModel, build_catalog
from bunkhouse.catalog.catalog import make_adapter
from bunkhouse.config import EngineOptions, Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.engines.contract import Adapter
from bunkhouse.engines.llamacpp import check_lora, estimate
from bunkhouse.errors import ConfigError, Conflict, InvalidRequest, ModelNotFound
from bunkhouse.gguf.meta import lora_misfit, read_tensor_shapes
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.kvcache.store import SnapshotStore
from bunkhouse.residency import messages as msg
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.slots import Slot, SlotGate
from bunkhouse.residency.state import Phase, ResidencyOptions, Spec, State, initial
from bunkhouse.residency.step import step
from tests.fakes import GIB, INFO
from tests.helpers import write_tiny_gguf
from tests.lora import write_lora

LLAMA = ENGINES["llama.cpp"]


def _load(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "bunkhouse.toml"
    path.write_text(text)
    return load_config_file(path, Settings(include_packaged=False, defaults=EngineOptions(
        engine_keys=(("threads", 1),))))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:  # two LoRAs of the qwen2, one of llama
    qwen = write_tiny_gguf(tmp_path / "qwen.gguf", "qwen2", attention=True)
    return {"qwen": qwen, "gemma": write_tiny_gguf(tmp_path / "gemma.gguf", "gemma3"),
            "a": write_lora(qwen, tmp_path / "a.gguf", 1),
            "b": write_lora(qwen, tmp_path / "b.gguf", 2),
            "llama": write_lora(qwen, tmp_path / "llama.gguf", 3, arch="llama")}


# -- 1. config -------------------------------------------------------------------------

BASE = '[[models]]\nid = "qwen"\npath = "qwen.gguf"\n'


def test_an_adapter_entry_is_parsed_with_scale_one_by_default(tmp_path: Path) -> None:
    """adapter_of, path (relative to the file), aliases and the default scale 1.0."""
    s = _load(tmp_path, BASE + '[[models]]\nid = "a"\nadapter_of = "qwen"\npath = "a.gguf"\n'
              'aliases = ["a2", "a2"]\n[[models]]\nid = "b"\nadapter_of = "qwen"\n'
              'path = "b.gguf"\nscale = 0.5\n')
    a, b = s.entries[1], s.entries[2]
    assert (a.adapter_of, a.path, a.scale, a.aliases, a.refused) == \
        ("qwen", tmp_path / "a.gguf", 1.0, ("a2",), None)
    assert (b.scale, s.entries[0].adapter_of) == (0.5, None)


@pytest.mark.parametrize(("lines", "key"), [
    *((f'path = "a.gguf"\nscale = {v}', "scale") for v in ("-1", "11", '"x"', "nan", "inf",
                                                          "true")),
    ('path = "a.gguf"\ncontext = 4096', "context"),  # an adapter runs with its base's options
    ('path = "a.gguf"\npinned = true', "pinned"), ("", "path"),
    ('path = "a.gguf"\naliases = "x"', "aliases")])
def test_an_adapter_entry_in_error_is_refused_not_raised(tmp_path: Path, lines: str,
                                                         key: str) -> None:
    """A wrong adapter entry is kept with ``refused`` naming the key; the file still loads."""
    s = _load(tmp_path, BASE + f'[[models]]\nid = "a"\nadapter_of = "qwen"\n{lines}\n')
    refused = s.entries[1].refused
    assert refused is not None and key in refused and "adapter 'a'" in refused
    assert s.entries[0].refused is None


@pytest.mark.parametrize("line", ['context = "big"', "embeddings = 3"])
def test_an_adapter_entry_with_a_mistyped_option_is_refused_not_raised(tmp_path: Path,
                                                                      line: str) -> None:
    """A model's option of the wrong type in an adapter's entry is refused with the adapter
    (left out, the other models served), as the same key well typed is: never the whole
    file."""
    s = _load(tmp_path, BASE + f'[[models]]\nid = "a"\nadapter_of = "qwen"\npath = "a.gguf"\n'
              f'{line}\n')
    assert s.entries[1].refused is not None and line.split()[0] in s.entries[1].refused


@pytest.mark.parametrize("value", ["3", "true", '["a"]'])
def test_default_adapter_must_be_a_string(tmp_path: Path, value: str) -> None:
    """A base's default_adapter that is not an id is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match="default_adapter"):
        _load(tmp_path, BASE + f"default_adapter = {value}\n")


# -- 2. catalog ------------------------------------------------------------------------

def test_a_catalog_serves_adapters_on_their_base(tmp_path: Path, files: dict[str, Path]) -> None:
    """Both adapters are listed, mounted on the base in order; a request for an adapter runs
    on its base with it, one for the base with its default adapter; bases() has no adapter."""
    s = _load(tmp_path, BASE + 'default_adapter = "b"\n[[models]]\nid = "a"\nadapter_of = '
              '"qwen"\npath = "a.gguf"\nscale = 0.5\naliases = ["a-alias"]\n[[models]]\n'
              'id = "b"\nadapter_of = "qwen"\npath = "b.gguf"\n')
    catalog = build_catalog(s, engines=ENGINES)
    base, a, b = catalog.get("qwen"), catalog.get("a-alias"), catalog.get("b")
    assert catalog.ids() == ["qwen", "a", "b"] and catalog.default_id == "qwen"
    assert a.adapter == Adapter("a", files["a"], files["a"].stat().st_size, 0.5)
    assert base.adapters == (a.adapter, b.adapter) and base.default_adapter == "b"
    assert (a.adapter_of, a.scale, a.options, base.adapter) == ("qwen", 0.5, base.options, None)
    assert catalog.served(a) == (base, a) and catalog.served(base) == (base, b)
    assert [m.id for m in catalog.bases()] == ["qwen"]
    assert [m.id for m in catalog.adapters_of("qwen")] == ["a", "b"]


def test_a_reloaded_catalog_gives_an_adapter_its_new_scale_at_once(
        tmp_path: Path, files: dict[str, Path]) -> None:
    """A configuration reload (Catalog.adopt) takes an adapter's new entry at once, where a
    model keeps its running settings until residency takes the new ones."""
    entry = '[[models]]\nid = "a"\nadapter_of = "qwen"\npath = "a.gguf"\n'
    running = build_catalog(_load(tmp_path, BASE + entry + "scale = 2.5\n"), engines=ENGINES)
    fresh = build_catalog(_load(tmp_path, BASE + entry + "scale = 1.0\n"), engines=ENGINES)
    old_base = running.get("qwen")
    running.adopt(fresh, keep=())
    assert running.get("a").scale == 1.0 and running.get("qwen") is old_base


def test_bad_adapters_are_logged_and_left_out(tmp_path: Path, files: dict[str, Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Each adapter in error is logged naming it and the key, and left out; the bases and the
    good adapter serve; a default_adapter naming another base's adapter is ignored."""
    bad = {"ghost": ('"nobody"', "a.gguf", "adapter_of: no model 'nobody'"),
           "nested": ('"ok"', "a.gguf", "adapter_of: 'ok' is an adapter itself"),
           "cross": ('"gemma"', "a.gguf", "adapter_of: the adapter a.gguf is for 'qwen2'"),
           "llama": ('"qwen"', "llama.gguf", "adapter_of: the adapter llama.gguf is for 'llama'"),
           "notlora": ('"qwen"', "gemma.gguf", "path: gemma.gguf is not a LoRA adapter"),
           "missing": ('"qwen"', "none.gguf", "path: no file at"),
           "cachey": ('"cached"', "a.gguf", "adapter_of: model 'cached' cannot mount adapters"),
           "scaled": ('"qwen"\nscale = 11', "a.gguf", "scale must be a number from 0 to 10")}
    text = BASE + ('[[models]]\nid = "gemma"\npath = "gemma.gguf"\ndefault_adapter = "ok"\n'
                   '[[models]]\nid = "cached"\npath = "qwen.gguf"\ncache_ram_mib = 64\n'
                   '[[models]]\nid = "ok"\nadapter_of = "qwen"\npath = "a.gguf"\n')
    text += "".join(f'[[models]]\nid = "{i}"\nadapter_of = {of}\npath = "{p}"\n'
                    for i, (of, p, _) in bad.items())
    caplog.set_level(logging.ERROR)
    catalog = build_catalog(_load(tmp_path, text), engines=ENGINES)
    assert catalog.ids() == ["qwen", "gemma", "cached", "ok"]
    assert catalog.get("qwen").adapters == (catalog.get("ok").adapter,)
    assert catalog.get("gemma").default_adapter is None
    assert catalog.served(catalog.get("gemma")) == (catalog.get("gemma"), None)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for model_id, (_, _, why) in bad.items():
        assert any(f"adapter {model_id!r}" in e and why in e for e in errors), (model_id, errors)
    assert any("default_adapter 'ok' is not an adapter of it" in e for e in errors)


def test_make_adapter_names_the_key_it_refuses(tmp_path: Path, files: dict[str, Path]) -> None:
    """make_adapter's ConfigErrors start with the key to fix: ``adapter_of:`` or ``path:``."""
    catalog = build_catalog(_load(tmp_path, BASE + '[[models]]\nid = "a"\nadapter_of = "qwen"\n'
                                  'path = "a.gguf"\n'), engines=ENGINES)
    qwen, a = catalog.get("qwen"), catalog.get("a")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    for path, base, key in [(files["b"], a, "adapter_of:"),
                            (files["llama"], qwen, "adapter_of:"), (files["gemma"], qwen, "path:"),
                            (tmp_path / "junk.gguf", qwen, "path:"),
                            (tmp_path / "gone.gguf", qwen, "path:")]:
        with pytest.raises(ConfigError) as e:
            make_adapter("x", path, base, 1.0, "runtime")
        assert e.value.message.startswith(key), e.value.message
    made = make_adapter("x", files["b"], qwen, 2.0, "runtime", ("y",))
    assert (made.adapter_of, made.scale, made.aliases) == ("qwen", 2.0, ("y",))


def test_a_lora_whose_shapes_do_not_fit_its_base_is_refused_before_any_load(
        tmp_path: Path, files: dict[str, Path]) -> None:
    """B matrices of another rank than the A ones (llama.cpp's load would refuse it), or a
    LoRA of a model with other widths: refused naming ``path`` and the tensor, from the two
    files' tensor infos; a LoRA file named as a model is refused as one."""
    catalog = build_catalog(_load(tmp_path, BASE), engines=ENGINES)
    qwen = catalog.get("qwen")
    broken = write_lora(files["qwen"], tmp_path / "broken.gguf", 5, broken=True)
    wide = write_tiny_gguf(tmp_path / "wide.gguf", "qwen2", attention=True)
    with pytest.raises(ConfigError, match=r"^path: broken.gguf does not fit model 'qwen': "
                                          r"blk.0.attn_q.weight: lora_a \[64, 8\]"):
        make_adapter("x", broken, qwen, 1.0, "runtime")
    assert lora_misfit(read_tensor_shapes(wide), read_tensor_shapes(files["a"])) is None
    assert "no tensor blk.0.attn_q.weight" in str(
        lora_misfit(read_tensor_shapes(files["gemma"]), read_tensor_shapes(files["a"])))
    (tmp_path / "lora.toml").write_text(f'[[models]]\nid = "m"\npath = "{files["a"]}"\n')
    with pytest.raises(ConfigError, match="a LoRA adapter, not a model"):
        build_catalog(load_config_file(tmp_path / "lora.toml", Settings(
            include_packaged=False)), engines=ENGINES)


def test_an_adapter_alias_taken_by_a_model_leaves_only_the_adapter_out(
        tmp_path: Path, files: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """An adapter whose alias already names a model is logged and left out; the catalog is
    built and the models serve (an alias clash between models fails the whole file)."""
    s = _load(tmp_path, BASE + '[[models]]\nid = "gemma"\npath = "gemma.gguf"\n[[models]]\n'
              'id = "a"\nadapter_of = "qwen"\npath = "a.gguf"\naliases = ["gemma"]\n')
    caplog.set_level(logging.ERROR)
    catalog = build_catalog(s, engines=ENGINES)
    assert catalog.ids() == ["qwen", "gemma"] and "adapter 'a'" in caplog.text


# -- 3. residency ----------------------------------------------------------------------

def _model(model_id: str, size: int = GIB, **kw: object) -> CatalogModel:
    return CatalogModel(model_id, Path(f"/models/{model_id}.gguf"), "config", INFO,
                        EngineOptions(context=4096, parallel=1), size, **kw)  # type: ignore[arg-type]


A1, A2 = (_model(i, 1000 * n, adapter_of="b") for n, i in ((1, "a1"), (2, "a2")))


def _state(*adapters: CatalogModel) -> State:
    base = _model("b", adapters=tuple(a.adapter for a in adapters))
    spec = Spec(base, GIB + sum(a.size_bytes for a in adapters), "llama", True)
    return initial(ResidencyOptions(budget_bytes=8 * GIB), [spec])


def _answer(fx: tuple[msg.Effect, ...], reply: int) -> object:
    found = [e.value for e in fx if isinstance(e, msg.Resolve) and e.id == reply]
    assert len(found) == 1, fx
    return found[0]


def _ready(s: State, *wants: msg.Want) -> tuple[State, tuple[msg.Effect, ...]]:
    """``wants`` sent to the absent base, its worker spawned and made ready."""
    for want in wants:
        s, fx = step(s, want, 0.0)
    spawn = next(e for e in fx if isinstance(e, msg.Spawn))
    return step(s, msg.WorkerReady("b", spawn.worker, 42, "pid 42", None), 1.0)


def test_a_base_removed_takes_its_adapters_with_it() -> None:
    """Deleting a base with adapters removes their catalog entries too: none is left naming
    a base that is gone."""
    s, fx = step(_state(A1, A2), msg.Unload("b", 9, "deleted", 0.0, forget=True), 0.0)
    assert "b" not in s.models
    assert [e.model for e in fx if isinstance(e, msg.CatalogRemove)] == ["b", "a1", "a2"]


def test_mounting_on_an_absent_base_takes_the_spec_at_once() -> None:
    """The spec gains the adapter, its estimate grows by the adapter's bytes, the catalog
    is told of the adapter and of the base's new settings; no load starts."""
    s = _state(A1)
    s2, fx = step(s, msg.Mount("b", 7, added=A2), 0.0)
    m = s2.models["b"]
    assert _answer(fx, 7) is None and m.phase is Phase.ABSENT and m.pending is None
    assert m.spec.model.adapters == (A1.adapter, A2.adapter)
    assert m.spec.estimate == s.models["b"].spec.estimate + 2000
    assert msg.CatalogAdd(A2) in fx and msg.CatalogAdd(m.spec.model) in fx
    assert not any(isinstance(e, msg.Spawn) for e in fx)


def test_mount_refuses_an_unknown_base_a_taken_id_and_an_unknown_adapter() -> None:
    """404 for a base not there (param adapter_of), 409 for an id in use, 404 for removing
    an adapter the base does not mount; the state does not change."""
    s, named_b = _state(A1), _model("b", adapter_of="b")  # the base's own id
    for event, kind, param in [(msg.Mount("x", 1, added=A2), ModelNotFound, "adapter_of"),
                               (msg.Mount("b", 1, added=A1), Conflict, "id"),
                               (msg.Mount("b", 1, added=named_b), Conflict, "id"),
                               (msg.Mount("b", 1, removed="a2"), ModelNotFound, "model")]:
        s2, fx = step(s, event, 0.0)
        error = _answer(fx, 1)
        assert isinstance(error, kind) and error.param == param and s2.models == s.models


def test_mounting_on_a_ready_base_drains_it_to_respawn_with_the_new_set() -> None:
    """A ready base goes draining with respawn and the new spec pending; a request for the
    adapter to come is let wait; once stopped, the next worker mounts the new set."""
    s, fx = _ready(_state(A1), msg.Want("b", 10))
    lease = _answer(fx, 10)
    assert isinstance(lease, msg.Granted)
    s, _ = step(s, msg.Release("b", lease.lease), 2.0)
    s, fx = step(s, msg.Mount("b", 7, added=A2), 3.0)
    m = s.models["b"]
    assert _answer(fx, 7) is None and m.phase is Phase.DRAINING and m.respawn
    assert m.pending is not None and m.pending.model.adapters == (A1.adapter, A2.adapter)
    assert m.spec.model.adapters == (A1.adapter,) and m.worker is not None
    assert any(isinstance(e, msg.Publish) and e.kind == "remounting" for e in fx)
    s, fx = step(s, msg.Want("b", 11, adapter="a2"), 4.0)
    assert not any(isinstance(e, msg.Resolve) for e in fx) and s.models["b"].waiters
    s, fx = step(s, msg.WorkerStopped("b", m.worker.id), 5.0)
    spawn = next(e for e in fx if isinstance(e, msg.Spawn))
    assert spawn.spec.adapters == (A1.adapter, A2.adapter)


def test_an_adapter_held_by_a_lease_is_not_removed_until_it_is_released() -> None:
    """Removing an adapter a granted lease runs with is a 409 naming the adapter; after the
    release it is removed: catalog told, the base re-mounted without it."""
    s, fx = _ready(_state(A1, A2), msg.Want("b", 10, adapter="a1"))
    lease = _answer(fx, 10)
    assert isinstance(lease, msg.Granted)
    assert s.models["b"].adapter_leases == {(lease.lease, "a1")}
    s2, fx = step(s, msg.Mount("b", 7, removed="a1"), 2.0)
    error = _answer(fx, 7)
    assert isinstance(error, Conflict) and "a1" in error.message and s2.models == s.models
    s, _ = step(s, msg.Release("b", lease.lease), 3.0)
    assert s.models["b"].adapter_leases == frozenset()
    s, fx = step(s, msg.Mount("b", 8, removed="a1"), 4.0)
    m = s.models["b"]
    assert _answer(fx, 8) is None and msg.CatalogRemove("a1") in fx
    assert m.pending is not None and m.pending.model.adapters == (A2.adapter,)
    assert m.pending.estimate == m.spec.estimate - 1000 and m.phase is Phase.DRAINING


def test_removing_an_adapter_refuses_its_waiters_and_restarts_a_load() -> None:
    """While the base loads, removing an adapter answers its waiters 404 and keeps the
    others; the spawn is cancelled and the next one mounts the set left."""
    s = _state(A1, A2)
    for want in (msg.Want("b", 10, adapter="a1"), msg.Want("b", 11, adapter="a2"),
                 msg.Want("b", 12)):
        s, fx = step(s, want, 0.0)
    worker = s.models["b"].worker
    assert worker is not None and s.models["b"].phase is Phase.LOADING
    s, fx = step(s, msg.Mount("b", 7, removed="a1"), 1.0)
    assert isinstance(_answer(fx, 10), ModelNotFound) and _answer(fx, 7) is None
    assert [w.id for w in s.models["b"].waiters] == [11, 12] and s.models["b"].respawn
    assert msg.CancelSpawn("b", worker.id) in fx
    s, fx = step(s, msg.LoadFailed("b", worker.id, None), 2.0)
    spawn = next(e for e in fx if isinstance(e, msg.Spawn))
    assert spawn.spec.adapters == (A2.adapter,) and spawn.worker != worker.id


def test_a_request_for_an_adapter_not_mounted_is_not_found() -> None:
    """A Want naming an adapter the base does not mount is a 404 at once; it waits for
    nothing and starts no load."""
    s, fx = step(_state(A1), msg.Want("b", 10, adapter="a9"), 0.0)
    error = _answer(fx, 10)
    assert isinstance(error, ModelNotFound) and error.param == "model" and "a9" in error.message
    assert not s.models["b"].waiters and s.models["b"].phase is Phase.ABSENT


# -- 4. slots --------------------------------------------------------------------------

def test_a_slot_continues_only_under_the_same_adapter_setting() -> None:
    """KV state computed under one setting is never continued under another ("" the base)."""
    slot = Slot(0, held=(1, 2, 3, 4), setting="a")
    assert slot.continues([1, 2, 3, 4, 5], "a") == 4
    assert slot.continues([1, 2, 3, 4, 5], "b") == slot.continues([1, 2, 3, 4, 5]) == 0
    plain = Slot(1, held=(1, 2, 3, 4), setting=None)  # the base alone
    assert plain.continues([1, 2, 3, 4, 5]) == 4 and plain.continues([1, 2, 3, 4, 5], "a") == 0


def test_the_gate_picks_the_slot_of_the_setting_and_forgets_idle_slots() -> None:
    """enter() picks the slot holding the prompt under the request's setting; unknown()
    forgets what idle slots hold and under which setting, not the busy one's."""
    async def go() -> None:
        gate = SlotGate("m", slots=3, queue=0)
        for slot, setting in zip(gate.table, ("a", "b", "a"), strict=True):
            slot.held, slot.setting = (1, 2, 3), setting
        busy = await gate.enter([1, 2, 3, 4], setting="b")
        assert busy is gate.table[1]
        gate.unknown()
        assert [(s.held, s.setting) for s in gate.table] == \
            [(None, None), ((1, 2, 3), "b"), (None, None)]

    asyncio.run(asyncio.wait_for(go(), 5))


# -- 5. snapshot keys ------------------------------------------------------------------

def test_snapshot_keys_differ_by_adapter_setting(tmp_path: Path) -> None:
    """Each setting has its own key; "" is the key of the base alone, with no "adapter"."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    model = CatalogModel("m", path, "config", INFO, EngineOptions(context=4096, parallel=2), 4)
    keeper = SnapshotKeeper(SnapshotStore(tmp_path / "kv", 1 << 30), EventLog())
    plain, a, b = keeper.key(model), keeper.key(model, "a|1|1.0"), keeper.key(model, "b|1|1.0")
    assert plain is not None and a is not None and b is not None
    assert keeper.key(model, "") == plain and len({plain, a, b}) == 3
    assert "adapter" not in dict(plain.layout) and dict(a.layout)["adapter"] == "a|1|1.0"
    assert {k: v for k, v in a.layout if k != "adapter"} == dict(plain.layout)


# -- 6. the llama.cpp engine adapter ---------------------------------------------------

def _engine_model(cache_ram_mib: int = 0, adapters: tuple[Adapter, ...] = ()) -> CatalogModel:
    options = EngineOptions(context=4096, parallel=2,
                            engine_keys=(("threads", 1), ("cache_ram_mib", cache_ram_mib)))
    return CatalogModel("m", Path("/m.gguf"), "config", INFO, options, 300 * 2**20,
                        adapters=adapters)


@pytest.mark.parametrize("lora", [[], [{"id": 0, "scale": 1.0}], "x"])
def test_a_request_may_not_set_lora(lora: object) -> None:
    """Adapters are chosen by model id: any ``lora`` field is a 400 naming it."""
    with pytest.raises(InvalidRequest) as e:
        check_lora({"lora": lora})
    assert e.value.param == "lora"
    check_lora({"prompt": "hi"})
    with pytest.raises(InvalidRequest):
        LLAMA.check_request("/v1/completions", {"prompt": "hi", "lora": []})


def test_adapters_in_the_estimate_the_args_and_the_prompt_cache() -> None:
    """A RAM prompt cache refuses adapters; the estimate counts their bytes in the weights;
    the worker is given --adapter PATH for each, in order."""
    adapters = (Adapter("a", Path("/a.gguf"), 5000), Adapter("b", Path("/b.gguf"), 7000, 0.5))
    plain, mounted = _engine_model(), _engine_model(adapters=adapters)
    assert LLAMA.adapters_refused(plain) is None
    refused = LLAMA.adapters_refused(_engine_model(cache_ram_mib=64))
    assert refused is not None and "cache_ram_mib" in refused
    assert estimate(mounted).weights == estimate(plain).weights + 12000
    assert estimate(mounted).total == estimate(plain).total + 12000
    args = LLAMA.worker_args(mounted)
    at = [i for i, arg in enumerate(args) if arg == "--adapter"]
    assert [args[i + 1] for i in at] == ["/a.gguf", "/b.gguf"]
    assert "--adapter" not in LLAMA.worker_args(plain)
    assert LLAMA.capabilities(mounted).adapters and not LLAMA.capabilities(
        _engine_model(cache_ram_mib=64)).adapters



def test_another_adapters_snapshot_is_no_fault_to_report() -> None:
    """A snapshot that differs from the wanted key in its adapter setting alone is another
    adapter's (or the base's) conversation: not restored, and not logged as skipped; any
    other difference still is."""
    from bunkhouse.kvcache.store import _other_adapter

    want = {"model": "m", "engine": "e", "layout": {"slot_context": 1024}}
    other = {**want, "layout": {"slot_context": 1024, "adapter": "a.gguf|1|2|1.0"}}
    assert _other_adapter(other, want) and _other_adapter(want, other)
    assert not _other_adapter({**other, "layout": {"slot_context": 512, "adapter": "x"}}, want)
    assert not _other_adapter({**other, "model": "n"}, want) and not _other_adapter(None, want)
