"""``easymats report`` and ``easymats doctor`` (loaded lazily by :mod:`easymats.cli`).

Exit status: 0 done (report) / no findings (doctor); 1 doctor found problems; 2 a mistake the user
can fix (one line on stderr, never a traceback).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import click

from . import reader
from .analyse import Analysis, TargetRun
from .derive import RATE_WINDOW_S
from .findings import RuleConfig, diagnose_all, fmt_s, fmt_t, format_findings


class Usage(click.ClickException):
    """One line on stderr and exit status 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"easymats: {self.format_message()}", err=True)


def unjudged_lines(targets: dict) -> list[str]:
    """Per target, the judged quantities the log holds no value of (a serving engine that does not
    provide them, or no traffic): "no findings" says nothing about those."""
    from easymats import thresholds

    from .derive import SPECS

    out = []
    for name in sorted(targets):
        run = targets[name]
        missing = [SPECS[t.name].title.lower() for t in thresholds.THRESHOLDS
                   if t.name in SPECS and not run.sketches[t.name].count
                   # a pool that grows on demand has blocks but no limit: no ratio, by design
                   and not (t.name == "kv_free_blocks_ratio" and run.sketches["active_blocks"].count)]
        if missing:
            out.append(f"{name}: not judged (no values in the log: not provided by its engine, or no "
                       f"traffic): {', '.join(missing)}")
    return out


def _targets_present(files: list[str]) -> list[str]:
    names: set[str] = set()
    st = reader.ReadStats()
    for rec in reader.iter_records(files, st):
        names.add(rec["target"])
        if len(names) > 100:
            break
    return sorted(names)


def _plots_module() -> ModuleType:
    """The plotting module, once matplotlib is known to work; Usage naming the fix otherwise."""
    try:
        from . import plots
        plots._matplotlib()
    except ImportError:
        raise Usage("plots need matplotlib: pip install 'easymats[report]' (or pass --no-plots)") from None
    except Exception as exc:  # PlotsUnavailable
        raise Usage(f"{exc} (or pass --no-plots)") from None
    return plots


def _time_range(files: list[str], t_from: str | None, t_to: str | None) -> tuple[float | None, float | None]:
    """--from/--to as unix seconds (offsets like +5m count from the log's first record)."""
    start = reader.first_time(files) if (t_from or t_to) and any(
        x and x.strip().startswith("+") for x in (t_from, t_to)) else None
    try:
        lo = reader.parse_time(t_from, start) if t_from else None
        hi = reader.parse_time(t_to, start) if t_to else None
    except ValueError as exc:
        raise Usage(f"--from/--to: {exc}") from None
    if lo is not None and hi is not None and lo >= hi:
        raise Usage(f"--from ({fmt_t(lo)}) must be before --to ({fmt_t(hi)})")
    return lo, hi


@click.command("report")
@click.argument("log", metavar="RUN.log", type=click.Path(dir_okay=True))
@click.option("--out", "out_path", default="report.html", show_default=True, type=click.Path(dir_okay=False),
              help="The HTML report to write (self-contained: images embedded).")
@click.option("--png", "png_dir", default=None, type=click.Path(file_okay=False),
              help="Also write each plot as a PNG into this directory.")
@click.option("--target", default=None, help="Only this target (its declared name).")
@click.option("--from", "t_from", default=None, metavar="T",
              help="Start: unix seconds, ISO time (2026-11-29T22:00:00Z) or offset from the log's start (+5m).")
@click.option("--to", "t_to", default=None, metavar="T", help="End, in the same forms as --from.")
@click.option("--window", "window_s", type=click.FloatRange(min=0.5, max=3600), default=RATE_WINDOW_S,
              show_default=True, help="Seconds over which rates and ratios are computed.")
@click.option("--no-plots", is_flag=True, help="Write the page without plots (no matplotlib needed).")
def report(log: str, out_path: str, png_dir: str | None, target: str | None, t_from: str | None,
           t_to: str | None, window_s: float, no_plots: bool) -> None:
    """Plots, a summary and findings from an easymats log RUN.log (and its rotated files)."""
    plots_mod = None if no_plots else _plots_module()
    try:
        files = reader.log_files(log)
    except reader.LogError as exc:
        raise Usage(str(exc)) from None
    lo, hi = _time_range(files, t_from, t_to)
    stats = reader.ReadStats()
    head = reader.peek_header(files) or {}
    logged = head.get("interval_s")
    interval = min(max(float(logged), 0.001), 60.0) if isinstance(logged, (int, float)) else 0.1
    analysis = Analysis(window_s=window_s, interval_s=interval)
    try:
        analysis.feed_all(reader.iter_records(files, stats, target=target, t_from=lo, t_to=hi))
    except OSError as exc:
        raise Usage(f"cannot read {log}: {exc.strerror or exc}") from None
    analysis.finish()
    if stats.samples == 0:
        if target is not None:
            present = _targets_present(files)
            raise Usage(f"no samples for target {target!r} in {log}; targets in the log: "
                        f"{', '.join(present) or 'none'}")
        if lo is not None or hi is not None:
            raise Usage(f"no samples between {fmt_t(lo)} and {fmt_t(hi)} in {log}")
        raise Usage(f"{log} has no sample lines ({stats.lines} lines, {stats.skipped} unreadable): "
                    "is it a log written by `easymats --output`?")
    findings = diagnose_all(analysis.targets)
    rendered: list[Any] = []  # plots.Plot; plots imports matplotlib
    if plots_mod is not None:
        for name in sorted(analysis.targets):
            rendered.extend(plots_mod.render_target(analysis.targets[name]))
    if png_dir:
        try:
            os.makedirs(png_dir, exist_ok=True)
            for p in rendered:
                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in p.target)
                with open(os.path.join(png_dir, f"{safe}-{p.name}.png"), "wb") as f:
                    f.write(p.png)
        except OSError as exc:
            raise Usage(f"cannot write PNGs into {png_dir}: {exc.strerror}") from None
    from . import html
    page = html.render(title=f"easymats report: {os.path.basename(log)}", stats=stats,
                       targets=analysis.targets, findings=findings, plots=rendered, window_s=window_s,
                       plots_note="" if plots_mod is not None else "Plots left out (--no-plots).")
    try:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        raise Usage(f"cannot write {out_path}: {exc.strerror}") from None
    span = (stats.last_t or 0.0) - (stats.first_t or 0.0)
    outside = f" ({len(stats.skipped_files)} outside --from/--to not read)" if stats.skipped_files else ""
    click.echo(f"{stats.samples} samples of {len(analysis.targets)} target(s) over {fmt_s(span)} "
               f"from {len(files)} file(s){outside}; {stats.skipped} unreadable line(s) skipped.")
    click.echo(format_findings(findings))
    for line in unjudged_lines(analysis.targets):  # e.g. an engine target: see `easymats ls --engines`
        click.echo(line)
    click.echo(f"wrote {out_path}" + (f" and {len(rendered)} PNG(s) in {png_dir}" if png_dir else ""))


@click.command("doctor")
@click.option("--pid", type=int, default=None, help="The HiSparse process (or SGLang server) to check.")
@click.option("--scrape", "scrape_url", default=None, metavar="URL",
              help="Instead of --pid: a vLLM or SGLang metrics endpoint (docs/engines.md).")
@click.option("--window", "window_s", type=click.FloatRange(min=1, max=600), default=10.0, show_default=True,
              help="Seconds to sample before judging.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.01, max=5), default=0.1,
              show_default=True, help="Seconds between samples.")
def doctor(pid: int | None, scrape_url: str | None, window_s: float, interval_s: float) -> None:
    """Sample a live HiSparse process for a short window and print findings (exit 1 if any)."""
    from . import live
    if (pid is None) == (scrape_url is None):
        raise Usage("give one of --pid PID and --scrape URL")
    try:
        readers: list[tuple[str, live.SnapshotReader]]
        if scrape_url is not None:
            from easymats.sources.target import LiveReader, scrape_target

            try:
                tg = scrape_target(scrape_url, name=None, peak_window_s=15.0, timeout_s=0.8 * interval_s)
            except ValueError as exc:
                raise Usage(str(exc)) from None
            tg.reader.wait_first(0.8 * interval_s)
            readers = [(tg.name, LiveReader(tg))]
        else:
            assert pid is not None  # exactly one of --pid and --scrape, checked above
            readers = live.open_readers(pid)
    except live.LiveError as exc:
        raise Usage(str(exc)) from None
    names = ", ".join(n for n, _ in readers)
    what = f"pid {pid}" if pid is not None else scrape_url
    click.echo(f"sampling {what} ({names}) for {window_s:g} s ...", err=True)
    # Short window: ratios over a quarter of it; a problem must hold for half of it to count.
    analysis = Analysis(window_s=max(1.0, window_s / 4), interval_s=interval_s)
    try:
        analysis.feed_all(live.sample(readers, window_s, interval_s))
    except KeyboardInterrupt:
        click.echo("interrupted: judging what was sampled so far", err=True)
    finally:
        for _, r in readers:
            r.close()
    analysis.finish()
    findings = diagnose_all(analysis.targets, RuleConfig(min_duration_s=window_s / 2))
    runs: list[TargetRun] = list(analysis.targets.values())
    n = sum(r.samples for r in runs)
    click.echo(f"{n} samples over {fmt_s(max((r.duration_s for r in runs), default=0.0))}")
    click.echo(format_findings(findings))
    for line in unjudged_lines(analysis.targets):
        click.echo(line)
    gone = [(r.name, r.downs[0]) for r in runs if r.downs]
    for name, (t, detail) in gone:
        click.echo(f"{name} went down during the window at {fmt_t(t)}: {detail}")
    sys.exit(1 if findings or gone else 0)
