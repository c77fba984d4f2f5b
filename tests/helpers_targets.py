"""A tiny real target: a process that publishes realistic, changing HiSparse metrics.

    python tests/helpers_targets.py --name decode-0 --rate 100 --duration 5

It writes its segment through easymats.telemetry exactly as the runtime does, so tests of the
agent, the exporter, the report and the alerts can run against a real process without torch.
Counters only go up; gauges move; a few metric relationships hold (hits <= lookups, used <=
issued) so derived ratios are meaningful. ``--anchor-hit`` sets the audited hit rate, and a
recalibration request on the control file is acknowledged and counted, like the runtime does.
``--full`` publishes every runtime metric and label value of the catalogue (the dashboards' and
the cardinality budget's view of a runtime); with ``--shift-hit R``, SIGUSR1 drops the audited
hit rate to R (a topic shift) until the next recalibration request restores ``--anchor-hit``.
With ``--fork-child NAME`` it also starts a child process that opens its own segment after
``--child-delay`` seconds (a launcher with a tensor-parallel worker).

Prints "ready <pid> <segment path>" on stdout once the first snapshot is published.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from easymats import telemetry  # noqa: E402


def publish_loop(name: str, rate: float, duration: float, anchor_hit: float, seed: int,
                 extra_unknown: bool, full: bool = False, shift_hit: float | None = None) -> None:
    rng = random.Random(seed)
    seg = telemetry.open_segment(name=name, labels={"model": "tiny-random", "role": "test"})
    seg.info("hisparse_runtime_info", version="0.1.0", model="tiny-random", device="cpu")
    seg.info("hisparse_config_info", window_size="64", global_tokens="16", block_size="16",
             top_k="128", device_buffer_tokens="256", host_kv_bits="5")
    tokens = seg.counter("hisparse_tokens_total", phase="decode")
    seg.counter("hisparse_tokens_total", phase="prefill").inc(512)
    lookups, hits = seg.counter("hisparse_anchor_lookups_total"), seg.counter("hisparse_anchor_hits_total")
    hb_lookups = seg.counter("hisparse_hot_buffer_lookups_total")
    hb_hits = seg.counter("hisparse_hot_buffer_hits_total")
    issued, used = seg.counter("hisparse_prefetch_issued_total"), seg.counter("hisparse_prefetch_used_total")
    allocs = seg.counter("hisparse_kv_block_allocations_total")
    recycles = seg.counter("hisparse_kv_block_recycles_total")
    recal = {r: seg.counter("hisparse_recalibrations_total", reason=r) for r in ("schedule", "request", "drift")}
    active = seg.gauge("hisparse_kv_blocks", state="active")
    free = seg.gauge("hisparse_kv_blocks", state="free")
    pending = seg.gauge("hisparse_kv_blocks", state="pending_recycle")
    resident = seg.gauge("hisparse_hot_buffer_resident_tokens")
    seg.gauge("hisparse_hot_buffer_capacity_tokens").set(256)
    dev_data = seg.gauge("hisparse_kv_memory_bytes", tier="device", kind="data")
    dev_meta = seg.gauge("hisparse_kv_memory_bytes", tier="device", kind="metadata")
    seg.gauge("hisparse_kv_memory_bytes", tier="host", kind="data").set(1 << 24)
    seg.gauge("hisparse_sequences").set(1)
    ctx = seg.gauge("hisparse_context_tokens")
    qerr = seg.histogram("hisparse_quant_block_relative_error")
    step = seg.histogram("hisparse_step_duration_seconds")
    quant = seg.counter("hisparse_quant_blocks_total", bits="5")
    total_blocks = 1024
    n_active = 64.0
    extra = _full_catalogue(seg, total_blocks) if full else None
    seg.publish()
    print(f"ready {os.getpid()} {seg.path}", flush=True)

    stop: list[int] = []
    shifted: list[int] = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    if shift_hit is not None:
        signal.signal(signal.SIGUSR1, lambda *a: shifted.append(1))
    hit_now = anchor_hit
    period = 1.0 / rate
    start = time.monotonic()
    k = 0
    while not stop and (duration <= 0 or time.monotonic() - start < duration):
        k += 1
        tokens.inc(1)
        ctx.set(512 + k)
        lookups.inc(32)
        if shifted:
            shifted.clear()
            hit_now = shift_hit if shift_hit is not None else anchor_hit
        hits.inc(sum(rng.random() < hit_now for _ in range(32)))
        hb_lookups.inc(128)
        hb_hits.inc(rng.randint(90, 128))
        issued.inc(16)
        used.inc(rng.randint(14, 16))
        n_active = max(8.0, min(total_blocks - 8.0, n_active + rng.choice((-1, 0, 1, 1))))
        if k % 50 == 0:
            n_active += 40  # a burst the 100 ms samples see and a 15 s scrape would miss
        allocs.inc(1)
        if rng.random() < 0.5:
            recycles.inc(1)
        active.set(n_active)
        pending.set(rng.randint(0, 4))
        free.set(total_blocks - n_active)
        resident.set(min(256, 100 + k % 157))
        dev_data.set(n_active * 4096)
        dev_meta.set(8192)
        if k % 10 == 0:
            qerr.observe(abs(rng.gauss(0.01, 0.005)))
            quant.inc(1)
        step.observe(abs(rng.gauss(0.002, 0.0005)))
        if k % max(1, int(rate * 30)) == 0:
            recal["schedule"].inc()
        req = seg.poll_control(min_interval_s=0.05)
        if req is not None:
            recal["request"].inc()
            hit_now = anchor_hit  # the recalibration re-pins the anchors the shift lost
            seg.ack(req)
        if extra is not None:
            extra(rng, k, n_active)
        seg.publish()
        time.sleep(max(0.0, start + k * period - time.monotonic()))
    seg.close()


def _full_catalogue(seg: telemetry.Segment, total_blocks: int):
    """Create the runtime series the basic loop leaves out; returns the per-step update."""
    anchors, threshold = seg.gauge("hisparse_anchors"), seg.gauge("hisparse_anchor_threshold_ratio")
    seg.gauge("hisparse_kv_blocks_limit").set(total_blocks)
    reclaims = seg.counter("hisparse_kv_block_reclaims_total")
    evictions = seg.counter("hisparse_kv_block_evictions_total")
    loaded, used = seg.counter("hisparse_kv_tokens_loaded_total"), seg.counter("hisparse_kv_tokens_used_total")
    swap_in, backup = seg.counter("hisparse_swap_in_bytes_total"), seg.counter("hisparse_backup_bytes_total")
    quant = [seg.counter("hisparse_quant_blocks_total", bits=b) for b in ("4", "6", "8")]
    host_meta = seg.gauge("hisparse_kv_memory_bytes", tier="host", kind="metadata")

    def step(rng: random.Random, k: int, n_active: float) -> None:
        anchors.set(8 + k % 9)
        threshold.set(0.05 + 0.01 * (k % 5))
        loaded.inc(128)
        used.inc(rng.randint(40, 128))
        swap_in.inc(rng.randint(0, 32) * 256)
        backup.inc(256)
        host_meta.set(n_active * 64)
        if k % 7 == 0:
            reclaims.inc()
        if k % 11 == 0:
            evictions.inc()
        if k % 10 == 0:
            quant[k % 3].inc()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="decode-0")
    ap.add_argument("--rate", type=float, default=100.0, help="publishes per second")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds; <= 0 runs until SIGTERM")
    ap.add_argument("--anchor-hit", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-delay", type=float, default=0.0, help="wait before opening the segment")
    ap.add_argument("--fork-child", default=None, help="also start a child publishing as this name")
    ap.add_argument("--child-delay", type=float, default=0.5)
    ap.add_argument("--extra-unknown", action="store_true")
    ap.add_argument("--full", action="store_true", help="publish every runtime metric of the catalogue")
    ap.add_argument("--shift-hit", type=float, default=None,
                    help="on SIGUSR1 the anchor hit rate drops to this until a recalibration request")
    args = ap.parse_args()
    child = None
    if args.fork_child:
        child = subprocess.Popen([sys.executable, __file__, "--name", args.fork_child, "--rate",
                                  str(args.rate), "--duration", str(args.duration), "--start-delay",
                                  str(args.child_delay), "--seed", str(args.seed + 1)],
                                 stdout=subprocess.DEVNULL)
    if args.start_delay:
        print(f"started {os.getpid()}", flush=True)
        time.sleep(args.start_delay)
    publish_loop(args.name, args.rate, args.duration, args.anchor_hit, args.seed, args.extra_unknown,
                 full=args.full, shift_hit=args.shift_hit)
    if child is not None:
        child.wait()


# ---- helpers for tests (import tests.helpers_targets or put tests/ on sys.path) ---------------

def start_target(name: str = "decode-0", *, rate: float = 100.0, duration: float = 5.0,
                 extra: list[str] | None = None, env: dict | None = None,
                 timeout: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Start a target process and wait for its segment; returns (process, segment path)."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--name", name, "--rate", str(rate),
                             "--duration", str(duration), *(extra or [])],
                            stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ready "):
            return proc, line.split()[2]
        if not line and proc.poll() is not None:
            raise RuntimeError(f"target {name} exited with {proc.returncode} before publishing")
    proc.kill()
    raise RuntimeError(f"target {name} did not publish within {timeout} s")


def private_segment_dir() -> str:
    """A new private segment directory (0700) for a test's processes, never the user's."""
    d = tempfile.mkdtemp(prefix="easymats-test-")
    os.chmod(d, 0o700)
    return d


_PORTS_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A local port to listen on, free now, that no other caller in this process was given.

    Binding port 0 and closing the socket hands out a port from the ephemeral range, which the
    kernel goes on to give to outgoing connections (a Prometheus scraping, a client posting)
    before the test's server binds it: a test with a dozen servers then fails now and again
    with "Address already in use". So the port comes from outside that range, at random, and
    is never given twice.
    """
    import socket

    lo, hi = _ephemeral_range()
    candidates = range(10000, lo) if lo - 10000 >= 2000 else range(hi + 1, 65536)
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(2000):
        port = rng.choice(candidates)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free local port in {candidates.start}-{candidates.stop - 1} after 2000 tries")


if __name__ == "__main__":
    main()
