"""The report's PNGs are real plots: decoded and inspected pixel by pixel."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import helpers_logs as H  # noqa: E402

from easymats.report import plots, reader  # noqa: E402
from easymats.report.analyse import Analysis  # noqa: E402

mpimg = pytest.importorskip("matplotlib.image")  # the `report` extra; installed in dev and CI


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def decode(png: bytes, tmp_path, name: str):
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    path = tmp_path / f"{name}.png"
    path.write_bytes(png)
    img = mpimg.imread(str(path))  # H x W x 4 floats in 0..1
    return (img[:, :, :3] * 255).round().astype(int)


def count_colour(rgb, hex_colour: str, tol: int = 2) -> int:
    r, g, b = _rgb(hex_colour)
    return int(((abs(rgb[:, :, 0] - r) <= tol) & (abs(rgb[:, :, 1] - g) <= tol)
                & (abs(rgb[:, :, 2] - b) <= tol)).sum())


def plot_area(rgb):
    """The middle of the figure, inside the axes (margins hold only titles and tick labels)."""
    h, w, _ = rgb.shape
    return rgb[int(h * 0.08):int(h * 0.8), int(w * 0.1):int(w * 0.97)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name in ("healthy", "target_restart"):
        path = str(tmp_path_factory.mktemp("plots") / f"{name}.log")
        H.write_scenario(path, name, 240.0)
        a = Analysis().feed_all(reader.iter_records([path], reader.ReadStats())).finish()
        out[name] = a.targets["decode-0"]
    return out


def test_anchor_panel_has_data_threshold_and_recalibrations(runs, tmp_path):
    run = runs["healthy"]
    png = plots.render_panel(run, plots.PANELS[0])
    rgb = decode(png, tmp_path, "anchor")
    area = plot_area(rgb)
    non_white = int((area.sum(axis=2) < 3 * 250).sum())
    assert non_white > 0.02 * area.shape[0] * area.shape[1]  # something is drawn, not an empty frame
    # the 65 % threshold: a 2 px horizontal line across most of the axes width
    assert count_colour(area, plots.THRESHOLD_COLOR) > 0.8 * area.shape[1]
    rows = [y for y in range(area.shape[0])
            if count_colour(area[y:y + 1], plots.THRESHOLD_COLOR) > 0.5 * area.shape[1]]
    assert rows and max(rows) - min(rows) <= 3  # one straight line ...
    series_rows = [y for y in range(area.shape[0]) if count_colour(area[y:y + 1], plots.SERIES_COLORS[0]) > 20]
    assert series_rows and max(series_rows) < min(rows)  # ... with the 86 % hit rate drawn above it
    assert count_colour(area, plots.RECAL_COLOR) > 20  # schedule recalibrations at each new document
    assert count_colour(rgb, plots.RESTART_COLOR) == 0  # no restart in a healthy run


def test_restart_is_marked_on_every_panel(runs, tmp_path):
    run = runs["target_restart"]
    drawn = plots.render_target(run)
    assert {p.name for p in drawn} >= {"anchor_hit_rate", "prefetch_efficiency", "kv_blocks", "block_recycle_rate"}
    for p in drawn:
        rgb = decode(p.png, tmp_path, p.name)
        area = plot_area(rgb)
        cols = [x for x in range(area.shape[1])
                if count_colour(area[:, x:x + 1], plots.RESTART_COLOR) > 0.5 * area.shape[0]]
        assert cols, p.name  # a full-height vertical line ...
        # ... in the middle of the time axis, where the scenario restarts (120 s of 240 s)
        assert 0.35 < cols[0] / area.shape[1] < 0.6, (p.name, cols[0] / area.shape[1])


def test_panel_without_data_is_left_out(runs):
    run = runs["healthy"]
    empty = plots.Panel("nothing", "Nothing", ("rss_bytes",), "MiB")
    run.plots["rss_bytes"].buckets.clear()
    assert plots.render_panel(run, empty) is None


def _legend(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_legends_use_the_axis_unit_and_say_whether_a_threshold_is_a_floor_or_a_ceiling(runs):
    """The step-latency legend said "step p99 seconds" on a millisecond axis, and a threshold
    line only said "threshold"."""
    run = runs["healthy"]
    by_name = {p.name: p for p in plots.PANELS}
    latency = _legend(plots.draw_panel(run, by_name["step_latency"]))
    assert latency == ["step p99 (ms)"]
    anchor = _legend(plots.draw_panel(run, by_name["anchor_hit_rate"]))
    assert "floor: alert below 65 %" in anchor
    lag = _legend(plots.draw_panel(run, by_name["sample_lag"]))
    assert any(t.startswith("ceiling: alert above 50 ms") for t in lag), lag
    blocks = _legend(plots.draw_panel(run, by_name["kv_blocks"]))
    assert not any("seconds" in t or "bytes" in t for t in latency + anchor + lag + blocks)


def test_every_series_of_a_panel_has_its_own_colour(runs):
    """"active" and "pool" blocks were drawn in two near-identical blues."""
    def rgb(line) -> tuple[int, ...]:
        return _rgb(line.get_color())

    fig = plots.draw_panel(runs["healthy"], next(p for p in plots.PANELS if p.name == "kv_blocks"))
    series = [ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith(("ceiling", "_"))]
    assert len(series) >= 3
    colours = [rgb(ln) for ln in series]
    markers = [_rgb(c) for c in (plots.THRESHOLD_COLOR, plots.RECAL_COLOR, plots.RESTART_COLOR)]
    dist = lambda a, b: sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5  # noqa: E731
    for i, a in enumerate(colours):
        for b in colours[i + 1:] + markers:
            assert dist(a, b) > 80, (a, b)
