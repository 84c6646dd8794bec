"""The server's log on stderr: text lines or one JSON object a line (``--log-format``)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from bunkhouse.cli.output import printable


def setup_logging(level: str, fmt: str) -> None:
    """Log at ``level`` (``--log-level``) in ``fmt`` (``--log-format``: text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else TextLogFormatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":  # the front's own polling of its workers: debug only
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, the record's
    ``output`` (a failed load's last lines) and the exception's traceback if any
    (``--log-format json``)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        output = getattr(record, "output", None)  # a failed load's last lines, say
        if isinstance(output, str) and output.strip():
            out["output"] = output
        fields = getattr(record, "fields", None)  # an access line's figures, one by one
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextLogFormatter(logging.Formatter):
    """The text log: one line a message, its control characters escaped; a record's
    ``output`` (``extra={"output": text}``: a failed load's last lines) follows it, each
    line indented under it, escaped too, so that none reads as a line of its own (a
    traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        output = getattr(record, "output", None)
        if isinstance(output, str) and output.strip():
            record.message += "".join(f"\n    {printable(line.rstrip())}"
                                      for line in output.strip("\n").split("\n"))
        return super().formatMessage(record)
