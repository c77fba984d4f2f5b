"""Figures of one target's run: key metrics over time with thresholds, recalibrations and restarts.

matplotlib is optional (the ``report`` extra): it is imported when the first figure is drawn, with
the Agg backend and the object API (no pyplot state), and :class:`PlotsUnavailable` says how to
install it. Each series is drawn from its :class:`~.accum.Downsampler` (a min/max band and the mean),
so a figure costs the same for a minute or a day of samples.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from easymats import thresholds

from .analyse import TargetRun

THRESHOLD_COLOR = "#e8590c"
RESTART_COLOR = "#c92a2a"
RECAL_COLOR = "#2b8a3e"
# Series hues apart from each other and from the marker colours above (blue, purple, grey, brown):
# the KV blocks panel draws four series, and "active" and "pool" once came out as two blues.
SERIES_COLORS = ("#1971c2", "#9c36b5", "#868e96", "#a05a2c")
BACKGROUND = "#ffffff"
INSTALL_HINT = "plots need matplotlib: pip install 'easymats[report]'"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Panel:
    name: str  # file name stem
    title: str
    series: tuple[str, ...]  # derived series keys
    unit: str  # axis unit: "%", "%/s", "blocks", "MiB", "ms", "tokens/s"
    threshold: str = ""  # key in easymats.thresholds drawn as a horizontal line
    recal_markers: bool = False


PANELS = (
    Panel("anchor_hit_rate", "Anchor hit rate", ("anchor_hit_rate",), "%", "anchor_hit_rate", True),
    Panel("prefetch_efficiency", "Prefetch efficiency", ("prefetch_efficiency",), "%", "prefetch_efficiency"),
    Panel("hot_buffer", "Hot buffer hit rate and block density", ("hot_buffer_hit_rate", "block_density"),
          "%", "hot_buffer_hit_rate"),
    Panel("block_recycle_rate", "Block recycle rate (recycles/s per active block)", ("block_recycle_rate",),
          "%/s", "block_recycle_rate"),
    Panel("kv_blocks", "KV blocks: active, pending recycle, pool size and limit",
          ("active_blocks", "pending_blocks", "pool_blocks", "pool_limit_blocks"), "blocks",
          "kv_free_blocks_ratio"),
    Panel("device_memory", "Device KV memory", ("device_data_bytes", "device_metadata_bytes"), "MiB"),
    Panel("throughput", "Decode throughput", ("decode_tokens_per_s",), "tokens/s"),
    Panel("step_latency", "Decode step latency p99", ("step_p99_seconds",), "ms"),
    Panel("quant_error", "Quantization error p99", ("quant_error_p99",), "%", "quant_error_p99"),
    Panel("sample_lag", "Sampling lag p99", ("sample_lag_p99_seconds",), "ms", "sample_lag_p99_seconds"),
)

_SCALE = {"%": 100.0, "%/s": 100.0, "blocks": 1.0, "MiB": 1.0 / (1 << 20), "ms": 1000.0, "tokens/s": 1.0}


@dataclass
class Plot:
    target: str
    name: str
    title: str
    png: bytes


def _matplotlib() -> tuple[Any, Any]:
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg", force=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    return Figure, FigureCanvasAgg


def _time_axis(run: TargetRun) -> tuple[float, float, str]:
    """(origin, divisor, label) so x = (t - origin) / divisor."""
    dur = run.duration_s
    div, unit = (3600.0, "hours") if dur > 3 * 3600 else (60.0, "minutes") if dur > 180 else (1.0, "seconds")
    from .findings import fmt_t
    start = fmt_t(run.first_t or 0.0)
    return run.first_t or 0.0, div, f"{unit} since {start}"


_UNIT_SUFFIXES = ("_seconds", "_bytes")


def series_label(key: str, unit: str) -> str:
    """Legend text of a series in the axis unit: "step p99 (ms)", never the key's own unit
    ("step p99 seconds" on a millisecond axis)."""
    for suffix in _UNIT_SUFFIXES:
        if key.endswith(suffix):
            key = key[:-len(suffix)]
    return f"{key.replace('_', ' ')} ({unit})"


def threshold_label(th: thresholds.Threshold, level: float, unit: str) -> str:
    """Legend text of a threshold line, saying which side is unhealthy."""
    side = "floor: alert below" if th.direction == "min" else "ceiling: alert above"
    return f"{side} {level:g} {unit}"


def render_panel(run: TargetRun, panel: Panel, *, dpi: int = 100) -> bytes | None:
    """PNG bytes of one panel, or None when the run has no data for it."""
    fig = draw_panel(run, panel, dpi=dpi)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor=BACKGROUND)
    return buf.getvalue()


def draw_panel(run: TargetRun, panel: Panel, *, dpi: int = 100) -> Any:
    """The matplotlib Figure of one panel, or None when the run has no data for it."""
    if not any(run.plots[k].buckets for k in panel.series):
        return None
    Figure, Canvas = _matplotlib()
    fig = Figure(figsize=(9.0, 2.8), dpi=dpi, facecolor=BACKGROUND)
    Canvas(fig)
    ax = fig.add_subplot(1, 1, 1)
    origin, div, xlabel = _time_axis(run)
    scale = _SCALE[panel.unit]
    data_max = 0.0
    for i, key in enumerate(panel.series):
        pts = run.plots[key].points()
        if not pts:
            continue
        xs = [(b.t - origin) / div for b in pts]
        data_max = max(data_max, max(b.hi for b in pts) * scale)
        color = SERIES_COLORS[i % len(SERIES_COLORS)]
        ax.fill_between(xs, [b.lo * scale for b in pts], [b.hi * scale for b in pts], color=color,
                        alpha=0.25, linewidth=0, step="post")
        ax.plot(xs, [b.mean * scale for b in pts], color=color, linewidth=1.2, drawstyle="steps-post",
                label=series_label(key, panel.unit))
    th = thresholds.BY_NAME.get(panel.threshold) if panel.threshold else None
    level = None
    if th is not None:
        if panel.threshold == "kv_free_blocks_ratio":
            # Against the limit; a pool that grows on demand has none (no ratio), so no line. Logs
            # from before the limit gauge judged the pool's size: the line is drawn there.
            limit = run.sketches["pool_limit_blocks"]
            pool = limit if limit.count else run.sketches["pool_blocks"]
            if pool.count and run.sketches["kv_free_blocks_ratio"].count:
                level = pool.max * (1 - th.limit)  # active + pending above this line = exhausted
                ax.axhline(level, color=THRESHOLD_COLOR, linewidth=2.0, linestyle="-",
                           label=f"ceiling: {'limit' if limit.count else 'pool'} - {th.limit:.0%} "
                                 "(active + pending above it: exhausted)")
        else:
            level = th.limit * scale
            ax.axhline(level, color=THRESHOLD_COLOR, linewidth=2.0, linestyle="-",
                       label=threshold_label(th, level, panel.unit))
    # Every plotted quantity is >= 0: start at 0 and keep the threshold line inside the frame.
    _, top = ax.get_ylim()
    ax.set_ylim(0, max(top, (level or 0.0) * 1.15, data_max * 1.1) or 1.0)
    if panel.recal_markers:
        for i, r in enumerate(run.recals):
            ax.axvline((r.t - origin) / div, color=RECAL_COLOR, linewidth=1.0, linestyle="--",
                       label="recalibration" if i == 0 else None)
    for i, mark in enumerate(run.restarts):
        ax.axvline((mark.t - origin) / div, color=RESTART_COLOR, linewidth=1.8,
                   label="restart" if i == 0 else None)
    ax.set_title(f"{run.name}: {panel.title}", fontsize=10, loc="left")
    ax.set_ylabel(panel.unit)
    ax.set_xlabel(xlabel, fontsize=8)
    if panel.unit == "%":
        _, hi = ax.get_ylim()
        if hi > 50:
            ax.set_ylim(0, max(105.0, hi))  # ratios: keep values near 100 % off the frame
    ax.grid(True, color="#dee2e6", linewidth=0.6)
    ax.legend(loc="lower left", fontsize=7, framealpha=0.8, ncol=4)
    fig.tight_layout()
    return fig


def render_target(run: TargetRun) -> list[Plot]:
    out = []
    for panel in PANELS:
        png = render_panel(run, panel)
        if png is not None:
            out.append(Plot(run.name, panel.name, panel.title, png))
    return out
