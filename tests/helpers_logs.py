"""Synthesised easymats logs for the report tests and benchmark (docs/log-format.md, v1).

Two kinds:

- :func:`write_scenario`: a constructed run. A small simulation of one HiSparse process advances
  every counter of the catalogue tick by tick from health parameters (hit rates, recycle speed,
  pool pressure, ...) that a scenario bends, so each scenario plants exactly one problem.
- :func:`stretch_log`: a long log made from real sample lines (e.g. from an agent run): the lines
  are replayed again and again with time shifted and every cumulative value offset, so counters
  stay monotonic and rates stay what the real run had.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from easymats import catalogue
from easymats.report.reader import series_key

T0 = 1795990000.0
HEADER = {"v": 1, "kind": "header", "agent_version": "0.1.0", "interval_s": 0.1, "host": "testhost",
          "argv": ["easymats", "--pid", "4242", "--output", "run.log"]}
SCENARIOS = ("healthy", "slow_recycle", "poor_prefetch", "anchor_decay", "metadata_growth",
             "pool_exhaustion", "target_restart")


def header(t: float, interval_s: float = 0.1) -> dict[str, Any]:
    return dict(HEADER, t=t, interval_s=interval_s)


@dataclass
class Health:
    """Health parameters of the simulated runtime as functions of (t since start, document fraction)."""

    anchor_hit_rate: Callable[[float, float], float] = lambda t, f: 0.86
    prefetch_efficiency: Callable[[float, float], float] = lambda t, f: 0.93
    hot_buffer_hit_rate: Callable[[float, float], float] = lambda t, f: 0.9
    recycle_per_active_s: Callable[[float, float], float] = lambda t, f: 0.25
    pending_blocks: Callable[[float, float], float] = lambda t, f: 3.0
    active_blocks: Callable[[float, float], float] = lambda t, f: 40.0 + 10 * f
    pool_blocks: Callable[[float, float], float] = lambda t, f: 400.0
    # hisparse_kv_blocks_limit: 0 like the runtime's default pool, which grows on demand
    pool_limit: Callable[[float, float], float] = lambda t, f: 0.0
    device_metadata_bytes: Callable[[float, float], float] = lambda t, f: 0.0
    doc_seconds: float = 60.0  # each document grows its context over this long, then a new one starts
    doc_tokens: float = 32768.0
    restarts_at: tuple[float, ...] = ()
    restart_down_s: float = 3.0


def scenario_health(name: str, duration_s: float) -> Health:
    h = Health()
    if name == "healthy":
        pass
    elif name == "slow_recycle":
        h.recycle_per_active_s = lambda t, f: 0.01
        h.pending_blocks = lambda t, f: 30.0
    elif name == "poor_prefetch":
        h.prefetch_efficiency = lambda t, f: 0.6 + 0.05 * math.sin(t / 7)
    elif name == "anchor_decay":
        h.doc_seconds = duration_s / 2
        h.doc_tokens = 131072.0
        h.anchor_hit_rate = lambda t, f: 0.9 if f < 0.5 else max(0.3, 0.9 - 1.6 * (f - 0.5))
    elif name == "metadata_growth":
        h.device_metadata_bytes = lambda t, f: (2 << 20) + (6 << 20) * t / duration_s
    elif name == "pool_exhaustion":
        h.active_blocks = lambda t, f: min(392.0, 40.0 + 352.0 * t / (0.4 * duration_s))
        h.pending_blocks = lambda t, f: 2.0
        h.pool_limit = lambda t, f: 400.0  # a bounded pool (host_pool_blocks=400) filling up
    elif name == "target_restart":
        h.restarts_at = (duration_s / 2,)
    else:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")
    return h


class SimRuntime:
    """Cumulative counters of one simulated process, advanced one tick at a time."""

    def __init__(self, pid: int, rng: random.Random):
        self.pid = pid
        self.rng = rng
        self.c: dict[str, float] = {}
        self.hist: dict[str, tuple[tuple[float, ...], list[float], list[float]]] = {}
        for spec in catalogue.runtime_metrics():
            if spec.type == catalogue.HISTOGRAM:
                self.hist[spec.name] = (spec.buckets, [0.0] * (len(spec.buckets) + 1), [0.0])
        self.seq = 0

    def inc(self, key: str, v: float) -> None:
        self.c[key] = self.c.get(key, 0.0) + max(0.0, v)

    def observe(self, name: str, v: float) -> None:
        bounds, counts, total = self.hist[name]
        i = next((k for k, b in enumerate(bounds) if v <= b), len(bounds))
        counts[i] += 1
        total[0] += v

    def tick(self, h: Health, t: float, f: float, dt: float) -> None:
        r = self.rng
        decode = 30 * dt
        self.inc(series_key("hisparse_tokens_total", {"phase": "decode"}), decode)
        self.inc(series_key("hisparse_tokens_total", {"phase": "prefill"}), 0.0)
        lookups = 200 * dt
        self.inc("hisparse_anchor_lookups_total", lookups)
        self.inc("hisparse_anchor_hits_total", lookups * h.anchor_hit_rate(t, f))
        issued = 500 * dt
        self.inc("hisparse_prefetch_issued_total", issued)
        self.inc("hisparse_prefetch_used_total", issued * h.prefetch_efficiency(t, f))
        hb = 2048 * 30 * dt
        self.inc("hisparse_hot_buffer_lookups_total", hb)
        self.inc("hisparse_hot_buffer_hits_total", hb * h.hot_buffer_hit_rate(t, f))
        self.inc("hisparse_kv_tokens_loaded_total", hb * 1.6)
        self.inc("hisparse_kv_tokens_used_total", hb)
        active = h.active_blocks(t, f)
        rec = h.recycle_per_active_s(t, f) * active * dt
        self.inc("hisparse_kv_block_recycles_total", rec)
        self.inc("hisparse_kv_block_allocations_total", rec + 0.5 * dt)
        self.inc("hisparse_kv_block_reclaims_total", 0.1 * dt)
        self.inc("hisparse_kv_block_evictions_total", 0.0)
        self.inc("hisparse_swap_in_bytes_total", hb * 0.1 * 1152)
        self.inc("hisparse_backup_bytes_total", decode * 1152)
        for bits, share in (("4", 0.3), ("5", 0.4), ("6", 0.2), ("8", 0.1)):
            self.inc(series_key("hisparse_quant_blocks_total", {"bits": bits}), share * 2 * dt)
        for _ in range(2):
            self.observe("hisparse_quant_block_relative_error", abs(r.gauss(0.01, 0.004)))
        for _ in range(3):
            self.observe("hisparse_step_duration_seconds", abs(r.gauss(0.006, 0.001)))
        self.seq += 2

    def metrics(self, h: Health, t: float, f: float, ctx: float) -> dict[str, Any]:
        m: dict[str, Any] = {}
        for key in sorted(self.c):
            m[key] = round(self.c[key], 3)
        for reason in ("schedule", "request", "drift"):
            m.setdefault(series_key("hisparse_recalibrations_total", {"reason": reason}), 0.0)
        for key, v in sorted(self.c.items()):
            if key.startswith("hisparse_recalibrations_total"):
                m[key] = v
        active, pending, pool = h.active_blocks(t, f), h.pending_blocks(t, f), h.pool_blocks(t, f)
        m[series_key("hisparse_kv_blocks", {"state": "active"})] = round(active)
        m[series_key("hisparse_kv_blocks", {"state": "pending_recycle"})] = round(pending)
        m[series_key("hisparse_kv_blocks", {"state": "free"})] = max(0, round(pool - active - pending))
        m["hisparse_kv_blocks_limit"] = float(h.pool_limit(t, f))
        m["hisparse_sequences"] = 1.0
        m["hisparse_context_tokens"] = round(ctx)
        m["hisparse_anchors"] = 16.0
        m["hisparse_anchor_threshold_ratio"] = 0.32
        m["hisparse_hot_buffer_resident_tokens"] = 4096.0
        m["hisparse_hot_buffer_capacity_tokens"] = 4096.0
        m[series_key("hisparse_kv_memory_bytes", {"kind": "data", "tier": "device"})] = 4096 * 1152.0
        m[series_key("hisparse_kv_memory_bytes", {"kind": "metadata", "tier": "device"})] = \
            round(h.device_metadata_bytes(t, f))
        m[series_key("hisparse_kv_memory_bytes", {"kind": "data", "tier": "host"})] = ctx * 1152.0
        m[series_key("hisparse_kv_memory_bytes", {"kind": "metadata", "tier": "host"})] = ctx * 2.0
        for name, (bounds, counts, total) in self.hist.items():
            m[name] = {"bounds": list(bounds), "counts": list(counts), "sum": round(total[0], 6)}
        m[series_key("hisparse_runtime_info", {"device": "cuda:0", "model": "llama-tiny", "version": "0.1.0"})] = 1.0
        m[series_key("hisparse_config_info", {
            "block_size": "512", "device_buffer_tokens": "4096", "global_tokens": "16",
            "host_kv_bits": "5", "top_k": "2048", "window_size": "1024"})] = 1.0
        return m


def scenario_records(name: str, duration_s: float = 300.0, *, interval_s: float = 0.1,
                     target: str = "decode-0", pid: int = 4242, t0: float = T0,
                     seed: int = 1) -> Iterable[dict[str, Any]]:
    """Header, events and samples of a constructed run, in time order."""
    h = scenario_health(name, duration_s)
    rng = random.Random(seed)
    yield header(t0, interval_s)
    yield {"v": 1, "kind": "event", "t": t0, "target": target, "pid": pid, "event": "attach",
           "detail": f"/dev/shm/easymats-0/{pid}.seg"}
    sim = SimRuntime(pid, rng)
    restarts = list(h.restarts_at)
    down_until = None
    n = int(round(duration_s / interval_s))
    prev_frac = 0.0
    recal_key = series_key("hisparse_recalibrations_total", {"reason": "schedule"})
    for i in range(1, n + 1):
        t_rel = i * interval_s
        t = t0 + t_rel
        if restarts and t_rel >= restarts[0]:
            restarts.pop(0)
            yield {"v": 1, "kind": "event", "t": t, "target": target, "pid": sim.pid, "event": "down",
                   "detail": f"writer pid {sim.pid} is not running"}
            down_until = t_rel + h.restart_down_s
            sim = SimRuntime(sim.pid + 1000, rng)
        if down_until is not None:
            if t_rel < down_until:
                yield {"v": 1, "kind": "sample", "t": round(t, 4), "target": target, "pid": sim.pid - 1000,
                       "up": False, "lag_s": 0.0, "error": "dead_pid", "metrics": {}}
                continue
            down_until = None
            yield {"v": 1, "kind": "event", "t": t, "target": target, "pid": sim.pid, "event": "restart",
                   "detail": f"{target} is back under pid {sim.pid}"}
        doc_t = t_rel % h.doc_seconds
        frac = doc_t / h.doc_seconds
        if frac < prev_frac:
            sim.inc(recal_key, 1.0)  # a new document: the runtime recalibrates on schedule
        prev_frac = frac
        sim.tick(h, t_rel, frac, interval_s)
        ctx = 2048 + frac * h.doc_tokens
        lag = abs(rng.gauss(0.0004, 0.0002))
        yield {"v": 1, "kind": "sample", "t": round(t, 4), "target": target, "pid": sim.pid, "up": True,
               "heartbeat_t": round(t - 0.003, 4), "seq": sim.seq, "lag_s": round(lag, 6),
               "metrics": sim.metrics(h, t_rel, frac, ctx),
               "process": {"cpu_seconds": round(t_rel * 0.9, 2), "rss_bytes": 512 << 20}}
    yield {"v": 1, "kind": "event", "t": t0 + duration_s + interval_s, "target": target, "pid": sim.pid,
           "event": "agent_stop", "detail": "duration reached"}


def write_lines(path: str, records: Iterable[dict[str, Any]]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
            n += 1
    return n


def write_scenario(path: str, name: str, duration_s: float = 300.0, **kw: Any) -> str:
    write_lines(path, scenario_records(name, duration_s, **kw))
    return path


# -- long logs from real samples ---------------------------------------------------------------------

def _is_cumulative(key: str) -> bool:
    base = key.split("{", 1)[0]
    return base.endswith("_total") or base.endswith("_seconds_total")


def read_samples(path: str, target: str | None = None) -> list[dict[str, Any]]:
    """The up sample lines of a (small, real) log."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "sample" and rec.get("up", True) and rec.get("metrics") and \
                    (target is None or rec.get("target") == target):
                out.append(rec)
    return out


def stretch_log(samples: list[dict[str, Any]], path: str, *, min_bytes: int, interval_s: float = 0.1,
                t0: float = T0) -> dict[str, float]:
    """Write a log of at least ``min_bytes`` at ``interval_s`` by replaying ``samples`` (real lines).

    Each replay shifts time and adds, to every cumulative value (``*_total`` counters and histogram
    counts and sums), what the previous replays accumulated, so counters never go backwards.
    Returns {"bytes", "lines", "seconds"}.
    """
    if len(samples) < 2:
        raise ValueError("need at least two sample lines to replay")
    first, last = samples[0]["metrics"], samples[-1]["metrics"]

    def span(key: str) -> Any:
        a, b = first.get(key), last.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            return {"counts": [y - x for x, y in zip(a["counts"], b["counts"])], "sum": b["sum"] - a["sum"]}
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and _is_cumulative(key):
            return b - a
        return None

    spans = {k: span(k) for k in last}
    written = lines = 0
    offset: dict[str, Any] = {}
    rep = 0
    t = t0
    with open(path, "w", encoding="utf-8") as f:
        line = json.dumps(header(t0, interval_s)) + "\n"
        f.write(line)
        written += len(line)
        while written < min_bytes:
            for rec in samples:
                m_out = {}
                for key, value in rec["metrics"].items():
                    off = offset.get(key)
                    if off is None:
                        m_out[key] = value
                    elif isinstance(value, dict):
                        m_out[key] = {"bounds": value.get("bounds"),
                                      "counts": [c + o for c, o in zip(value["counts"], off["counts"])],
                                      "sum": value["sum"] + off["sum"]}
                    else:
                        m_out[key] = value + off
                t += interval_s
                out = dict(rec, t=round(t, 4), heartbeat_t=round(t - 0.002, 4), metrics=m_out)
                line = json.dumps(out, separators=(",", ":")) + "\n"  # compact, as the agent writes
                f.write(line)
                written += len(line)
                lines += 1
            rep += 1
            for key, sp in spans.items():
                if sp is None:
                    continue
                if isinstance(sp, dict):
                    old = offset.get(key) or {"counts": [0.0] * len(sp["counts"]), "sum": 0.0}
                    # the next replay starts where this one ended: add the span plus one tick's worth
                    offset[key] = {"counts": [o + s for o, s in zip(old["counts"], sp["counts"])],
                                   "sum": old["sum"] + sp["sum"]}
                else:
                    offset[key] = (offset.get(key) or 0.0) + sp
    return {"bytes": float(written), "lines": float(lines), "seconds": t - t0}


def rotate_file(path: str, max_bytes: int) -> list[str]:
    """Split ``path`` as the agent's rotation would have: ``path.N`` (oldest) ... ``path``, each
    at most about ``max_bytes`` and each starting with a header line. Returns the files, oldest first."""
    import os

    chunks: list[str] = []
    head = None
    out = None
    size = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if head is None:
                head = line
                continue
            if out is None or size + len(line) > max_bytes:
                if out is not None:
                    out.close()
                chunks.append(f"{path}.part{len(chunks)}")
                out = open(chunks[-1], "w", encoding="utf-8")
                # the agent writes a fresh header, stamped at the rotation, at the top of each file
                fresh = json.dumps(dict(json.loads(head), t=json.loads(line).get("t")), separators=(",", ":")) + "\n"
                out.write(fresh)
                size = len(fresh)
            out.write(line)
            size += len(line)
    if out is not None:
        out.close()
    os.remove(path)
    names = []
    for i, part in enumerate(chunks):
        n = len(chunks) - 1 - i  # the newest is path itself, the oldest has the highest number
        dest = f"{path}.{n}" if n else path
        os.replace(part, dest)
        names.append(dest)
    return names
