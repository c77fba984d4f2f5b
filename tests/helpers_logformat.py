"""Checks a log line against docs/log-format.md (v1): what the agent, report and fault tests use
to prove that every line the agent wrote is one a reader can take."""

from __future__ import annotations

import re
from typing import Any

from easymats.logwriter import LOG_VERSION

SERIES_KEY_RE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*"'
                           r'(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*")*)\})?$')
# Every event the agent writes (docs/log-format.md).
EVENTS = ("attach", "down", "restart", "agent_start", "agent_stop", "log_reopened", "log_truncated",
          "log_recovered", "warning")


def validate_line(obj: Any) -> list[str]:
    """Problems of one parsed log line against docs/log-format.md (v1); [] when it conforms.

    Unknown keys are allowed (readers ignore them); unknown kinds are reported, since the agent
    never writes them."""
    errs: list[str] = []
    if not isinstance(obj, dict):
        return ["line is not a JSON object"]
    if obj.get("v") != LOG_VERSION:
        errs.append(f"v is {obj.get('v')!r}, not {LOG_VERSION}")
    if not isinstance(obj.get("t"), (int, float)):
        errs.append("t is not a number")
    kind = obj.get("kind")

    def need(key: str, types: tuple, nullable: bool = False) -> None:
        if key not in obj:
            errs.append(f"{kind} line lacks {key!r}")
        elif not (isinstance(obj[key], types) or (nullable and obj[key] is None)):
            errs.append(f"{kind}.{key} has type {type(obj[key]).__name__}")

    if kind == "header":
        need("agent_version", (str,))
        need("interval_s", (int, float))
        need("host", (str,))
        need("argv", (list,))
    elif kind == "event":
        need("event", (str,))
        need("target", (str,), nullable=True)
        need("pid", (int,), nullable=True)
        need("detail", (str,))
        if obj.get("event") not in EVENTS:
            errs.append(f"unknown event {obj.get('event')!r}")
    elif kind == "sample":
        need("target", (str,))
        need("pid", (int,))
        need("up", (bool,))
        need("lag_s", (int, float))
        need("metrics", (dict,))
        if obj.get("up") is False and not isinstance(obj.get("error"), str):
            errs.append("a sample with up=false must say why in 'error'")
        if "seq" in obj and not isinstance(obj["seq"], int):
            errs.append("sample.seq is not an integer")
        for key, value in (obj.get("metrics") or {}).items():
            if not SERIES_KEY_RE.match(key):
                errs.append(f"metrics key {key!r} is not a series name")
            if isinstance(value, dict):
                b, c = value.get("bounds"), value.get("counts")
                if not isinstance(b, list) or not isinstance(c, list) or len(c) != len(b) + 1 \
                        or not isinstance(value.get("sum"), (int, float)):
                    errs.append(f"histogram {key} must have bounds, counts (len(bounds)+1) and sum")
            elif value is not None and not isinstance(value, (int, float)):
                errs.append(f"metric {key} has type {type(value).__name__}")
        proc = obj.get("process")
        if proc is not None and not (isinstance(proc, dict) and isinstance(proc.get("cpu_seconds"), (int, float))
                                     and isinstance(proc.get("rss_bytes"), int)):
            errs.append("process must be null or {cpu_seconds, rss_bytes}")
        if "gpu" in obj:
            if not isinstance(obj["gpu"], list) or not all(isinstance(g, dict) and isinstance(g.get("gpu"), str)
                                                           for g in obj["gpu"]):
                errs.append("gpu must be a list of {gpu, memory_bytes, utilization_ratio}")
    else:
        errs.append(f"unknown kind {kind!r}")
    return errs
