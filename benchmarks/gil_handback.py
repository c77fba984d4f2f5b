"""How late a decode step gets the GIL back from a busy side thread (side_threads.py), on the CPU:
a stand-in step gives the GIL up while it "waits for the device" (a sleep of --wait ms, as a graph
replay or a read-back does) and then runs --host ms of Python (its host side), while another
thread runs Python without pause (a recalibration worker's launches, a capture ahead). Prints the
median and the slowest steps with no side thread, with one under the interpreter's 5 ms switch
interval, and with one under side_threads.SWITCH_INTERVAL.

    python benchmarks/gil_handback.py [--steps 400] [--wait 3] [--host 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from hi_sparse import side_threads


def busy(until: threading.Event) -> None:
    with side_threads.beside_the_steps():
        x = 0
        while not until.is_set():
            for i in range(1000):
                x += i * i


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def steps(n: int, wait: float, host: float) -> list[float]:
    took = []
    for _ in range(n):
        t = time.perf_counter()
        time.sleep(wait)
        spin(host)
        took.append(time.perf_counter() - t)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--wait", type=float, default=3.0, help="ms the step gives the GIL up")
    ap.add_argument("--host", type=float, default=0.5, help="ms of Python after it")
    args = ap.parse_args()
    short = side_threads.SWITCH_INTERVAL
    sys.setswitchinterval(0.005)
    for label, interval in (("no side thread", None), ("a busy side thread, 5 ms interval", 0.005),
                            (f"a busy side thread, {short * 1e3:g} ms interval", short)):
        stop = threading.Event()
        side = None
        if interval is not None:
            side_threads.SWITCH_INTERVAL = interval
            side = threading.Thread(target=busy, args=(stop,))
            side.start()
        took = sorted(t * 1e3 for t in steps(args.steps, args.wait / 1e3, args.host / 1e3))
        stop.set()
        if side is not None:
            side.join()
        print(f"{label}: median step {statistics.median(took):.2f} ms, 90th percentile "
              f"{took[int(0.9 * len(took))]:.2f} ms, slowest {took[-1]:.2f} ms "
              f"(it waits {args.wait:g} ms and computes {args.host:g} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
