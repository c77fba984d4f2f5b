"""Benchmark `easymats report` on a long 10 Hz log: lines per second and peak RSS.

    .venv/bin/python benchmarks/bench_report.py [--hours 3] [--min-mb 100] [--dir /tmp/easymats-bench-report]

1. Records real sample lines: a real target process (tests/helpers_targets.py) sampled by the real
   agent (`easymats --pid ... --interval 0.1 --output`) for a few seconds.
2. Stretches them into a log of at least --hours at 10 Hz and at least --min-mb (tests/helpers_logs
   .stretch_log: time shifted, counters kept monotonic), rotated into 64 MB files as the agent would.
3. Runs `easymats report` on it in a subprocess, full (plots) and --no-plots, and on a quarter-size
   log, printing wall time, lines/s, MB/s and the child's peak RSS (from wait4). Bounded memory
   means the peak RSS of the full log is about the same as that of the quarter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import helpers_logs as H  # noqa: E402

EASYMATS = [sys.executable, "-c", "from easymats.cli import main; main()"]


def real_samples(workdir: str, seconds: float = 4.0) -> tuple[list[dict], str]:
    """Sample lines from the real agent on a real target; falls back to a constructed run."""
    seg_dir = tempfile.mkdtemp(prefix="easymats-bench-seg-")
    os.chmod(seg_dir, 0o700)
    env = dict(os.environ, EASYMATS_SEGMENT_DIR=seg_dir)
    log = os.path.join(workdir, "source.log")
    try:
        target = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers_targets.py"),
                                   "--name", "decode-0", "--duration", str(seconds + 1)],
                                  stdout=subprocess.PIPE, text=True, env=env)
        line = target.stdout.readline()  # "ready <pid> <path>"
        if not line.startswith("ready"):
            raise RuntimeError(f"target did not start: {line!r}")
        agent = subprocess.run([*EASYMATS, "--pid", str(target.pid), "--interval", "0.1", "--output", log,
                                "--quiet", "--listen", "127.0.0.1:0", "--duration", str(seconds)],
                               env=env, capture_output=True, text=True, timeout=60)
        target.terminate()
        target.wait()
        if agent.returncode != 0:
            raise RuntimeError(agent.stderr.strip())
        samples = H.read_samples(log)
        if len(samples) < 10:
            raise RuntimeError(f"only {len(samples)} samples")
        return samples, f"real agent log ({len(samples)} samples of tests/helpers_targets.py)"
    except Exception as exc:  # keep the benchmark usable where the agent cannot run
        path = os.path.join(workdir, "scenario.log")
        H.write_scenario(path, "healthy", 60.0)
        return H.read_samples(path), f"constructed healthy run (agent unavailable: {exc})"
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)


def run_report(log: str, out_dir: str, *extra: str) -> dict[str, float]:
    """Run the CLI, return wall seconds and the child's peak RSS in bytes."""
    start = time.perf_counter()
    proc = subprocess.Popen([*EASYMATS, "report", log, "--out", os.path.join(out_dir, "report.html"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out = proc.stdout.read().decode()
    err = proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"report failed: {err or out}")
    return {"wall_s": wall, "rss_bytes": usage.ru_maxrss * 1024.0, "stdout": out}  # type: ignore[dict-item]


def log_size(log: str) -> tuple[int, int]:
    files = [p for p in os.listdir(os.path.dirname(log)) if p.startswith(os.path.basename(log))]
    total = lines = 0
    for name in files:
        path = os.path.join(os.path.dirname(log), name)
        total += os.path.getsize(path)
        with open(path, "rb") as f:
            lines += sum(1 for _ in f)
    return total, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=3.0)
    ap.add_argument("--min-mb", type=float, default=100.0)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "easymats-bench-report"))
    ap.add_argument("--keep", action="store_true", help="keep the generated logs")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    samples, source = real_samples(args.dir)
    print(f"source: {source}")
    line_bytes = sum(len(json.dumps(s, separators=(",", ":"))) + 1 for s in samples) / len(samples)
    need_bytes = max(args.min_mb * 1e6, 1.05 * args.hours * 36000 * line_bytes)  # 5 %: t texts vary
    results = []
    for label, size in (("quarter", need_bytes / 4), ("full", need_bytes)):
        sub = os.path.join(args.dir, label)
        os.makedirs(sub)
        log = os.path.join(sub, "run.log")
        t = time.perf_counter()
        info = H.stretch_log(samples, log, min_bytes=int(size))
        H.rotate_file(log, 64 << 20)
        gen = time.perf_counter() - t
        total, lines = log_size(log)
        print(f"\n[{label}] {total / 1e6:.1f} MB, {lines} lines, {info['seconds'] / 3600:.2f} h at 10 Hz, "
              f"{len([p for p in os.listdir(sub) if p.startswith('run.log')])} rotated file(s) "
              f"(generated in {gen:.1f} s)")
        for mode, extra in (("plots + PNGs", ("--png", os.path.join(sub, "png"))), ("--no-plots", ("--no-plots",))):
            r = run_report(log, sub, *extra)
            print(f"  report {mode:13s}: {r['wall_s']:6.1f} s wall, {lines / r['wall_s']:8.0f} lines/s, "
                  f"{total / 1e6 / r['wall_s']:5.1f} MB/s, peak RSS {r['rss_bytes'] / 1e6:6.1f} MB")
            results.append((label, mode, r, lines, total))
        if not args.keep:
            for name in os.listdir(sub):
                if name.startswith("run.log"):
                    os.remove(os.path.join(sub, name))
    q = {m: r for lab, m, r, *_ in results if lab == "quarter"}
    f = {m: r for lab, m, r, *_ in results if lab == "full"}
    for mode in q:
        print(f"\npeak RSS full / quarter ({mode}): {f[mode]['rss_bytes'] / q[mode]['rss_bytes']:.2f} "
              "(1.0 = memory independent of log size)")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
