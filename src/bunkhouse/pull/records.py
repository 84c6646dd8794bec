"""What `bunkhouse pull` recorded: a JSON file in the data directory naming each pulled
model, the hub repo, commit and file it is, and the names it was pulled by. The catalog
serves every recorded model (whatever ``hf_cache`` says) under those names too."""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bunkhouse.pull.hub import Plan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pulled:
    """A pull's record: the model it made servable (even with ``hf_cache = false``) and
    the names it answers to besides its id."""

    model_id: str
    repo: str
    commit: str
    model: str  # its first file, as a path in the repo
    names: tuple[str, ...]
    when: float


def records_path(data_dir: Path) -> Path:
    return data_dir / "pulled.json"


def read_records(data_dir: Path) -> list[Pulled]:
    """The pulls on record: none when there is no record, and none, with a warning, when
    it cannot be read (never an error: the other models serve)."""
    path = records_path(data_dir)
    try:
        raw = json.loads(path.read_text())
        return [Pulled(r["model_id"], r["repo"], r["commit"], r["model"], tuple(r["names"]),
                       float(r["when"])) for r in raw]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s cannot be read (%s): the models pulled are served only where the "
                    "hf_cache source lists them; `bunkhouse pull` them again to record "
                    "them", path, e)
        return []


def record(data_dir: Path, plan: Plan) -> None:
    """Add (or renew) the plan's record: under a lock (two pulls may end at once), written
    whole to a temporary file, then renamed."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "pulled.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = records_path(data_dir)
        records = read_records(data_dir)
        if not records and path.exists() and path.read_text().strip() != "[]":
            kept_aside = path.with_name(f"pulled.json.unreadable-{int(time.time())}")
            path.replace(kept_aside)  # not overwritten: its records may still be read by hand
            log.warning("the unreadable %s is kept as %s", path, kept_aside)
        kept = [r for r in records if r.model_id != plan.model_id]
        kept.append(Pulled(plan.model_id, plan.repo, plan.commit, plan.choice.model,
                           plan.names, time.time()))
        tmp = records_path(data_dir).with_suffix(".tmp")
        tmp.write_text(json.dumps([{**asdict(r), "names": list(r.names)} for r in kept],
                                  indent=1))
        tmp.replace(records_path(data_dir))
