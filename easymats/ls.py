"""``easymats ls``: the telemetry segments on this machine, live and stale; with ``--engines``,
what easymats maps from each serving engine and what that engine cannot provide."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import click

from .segment import SegmentError, SegmentReader, control_path, pid_of_path, segment_dir, segment_paths

STALE_KINDS = ("dead_pid", "pid_reused", "empty")


@dataclass(frozen=True, slots=True)
class SegmentRow:
    path: str
    pid: int | None
    name: str
    age_s: float | None
    heartbeat_age_s: float | None
    state: str  # live | stale | invalid
    detail: str = ""


def scan(directory: str) -> list[SegmentRow]:
    """One row per ``*.seg`` file: live ones read, stale ones (dead or reused pid) said so."""
    rows = []
    now_ns = time.time_ns()
    for path in segment_paths(directory):
        pid = pid_of_path(path)
        try:
            with SegmentReader(path, max_retries=16) as r:
                snap = r.read()
        except SegmentError as exc:
            state = "stale" if exc.kind in STALE_KINDS else "invalid"
            rows.append(SegmentRow(path, pid, "", None, None, state, str(exc).split(": ", 1)[-1]))
            continue
        rows.append(SegmentRow(path, snap.pid, snap.name, (now_ns - snap.created_unix_ns) / 1e9,
                               (now_ns - snap.heartbeat_unix_ns) / 1e9, "live"))
    return rows


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def engines_text() -> str:
    """Per engine and naming revision: the catalogue series it maps, and those it cannot provide."""
    from .sources import maps

    out = []
    for m in maps.ENGINE_MAPS:
        out.append(f"{m.key}: {m.title}")
        out.append(f"  names from {m.source}")
        for r in m.rules:
            ways = " | ".join(" ".join(("+ " if t.sign > 0 else "- ") + t.sample + (
                "{" + ",".join(f'{k}="{v}"' for k, v in t.match) + "}" if t.match else "") for t in way)[2:]
                for way in r.ways)
            out.append(f"  provides {r.series} = {ways}" + (f"  ({r.note})" if r.note else ""))
        for metric in m.not_provided():
            out.append(f"  NOT PROVIDED {metric}: {maps.why_not(m, metric)}")
        out.append("")
    out.append("Unmapped engine series pass through under the engine's names; see docs/engines.md.")
    return "\n".join(out)


@click.command("ls")
@click.option("--clean", is_flag=True, help="Remove stale segments (dead or reused pid) and their control files.")
@click.option("--dir", "directory", default=None, help="Segment directory (default: $EASYMATS_SEGMENT_DIR "
              "or /dev/shm/easymats-<uid>).")
@click.option("--engines", is_flag=True, help="Show what easymats maps from vLLM and SGLang (per naming "
              "revision) and which catalogue metrics each cannot provide.")
def ls(clean: bool, directory: str | None, engines: bool) -> None:
    """List live and stale telemetry segments on this machine (--engines: what each serving
    engine provides)."""
    if engines:
        click.echo(engines_text())
        return
    d = directory or segment_dir()
    if not os.path.isdir(d):
        click.echo(f"no segment directory {d}: no process has published telemetry as this user")
        return
    rows = scan(d)
    if not rows:
        click.echo(f"no segments in {d}")
        return
    click.echo(f"{'PID':>8}  {'NAME':<20} {'AGE':>7} {'HEARTBEAT':>9}  {'STATE':<8} PATH")
    for r in rows:
        click.echo(f"{r.pid if r.pid is not None else '-':>8}  {r.name[:20]:<20} {_age(r.age_s):>7} "
                   f"{_age(r.heartbeat_age_s):>9}  {r.state:<8} {os.path.basename(r.path)}"
                   + (f"  ({r.detail})" if r.detail else ""))
    stale = [r for r in rows if r.state == "stale"]
    if clean:
        for r in stale:
            for p in (r.path, control_path(r.path)):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        click.echo(f"removed {len(stale)} stale segment(s)")
    elif stale:
        click.echo(f"{len(stale)} stale segment(s): remove them with 'easymats ls --clean'")
