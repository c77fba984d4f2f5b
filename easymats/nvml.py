"""NVML, through one chokepoint: lazy init, never raises, absent without a GPU.

Every NVML call in easymats goes through :class:`Nvml`. Without the NVIDIA driver (CI, laptops)
pynvml is not even imported (no driver device or procfs entry: see DRIVER_PATHS), and where the
driver shows but ``nvmlInit`` fails, :meth:`available` answers False just the same: for good,
and GPU metrics are simply absent (never zero). A function the
driver does not implement is remembered and not called again.

Readings are small NamedTuples in base units: bytes and 0..1 ratios (NVML speaks MiB-free bytes
and percent; the conversion happens here, once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Iterable, NamedTuple

log = logging.getLogger("easymats.nvml")

# Where an NVIDIA driver shows itself: the control device (bare metal, containers given GPUs),
# the driver's procfs directory, and WSL's GPU paravirtualisation device. With none of them,
# NVML cannot find a GPU and pynvml is not even imported.
DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")


class GpuReading(NamedTuple):
    gpu: str  # device index as a label value ("0", "1", ...); not `index`, which is tuple.index
    uuid: str
    utilization_ratio: float | None  # 0..1 over NVML's last sample period
    memory_used_bytes: float | None
    memory_total_bytes: float | None


class ProcessGpuReading(NamedTuple):
    gpu: str  # device index
    pid: int
    memory_bytes: float | None  # None where NVML does not say (e.g. some vGPU/MIG setups)
    utilization_ratio: float | None  # SM utilization of the process, 0..1


class NvmlSnapshot(NamedTuple):
    t: float  # unix time of the reading
    gpus: tuple[GpuReading, ...]
    processes: tuple[ProcessGpuReading, ...]

    def for_pid(self, pid: int) -> list[ProcessGpuReading]:
        return [p for p in self.processes if p.pid == pid]


class Nvml:
    """A lazily initialised NVML session. Thread-safe; no method raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mod: Any = None
        self._state = "new"  # new | ok | unavailable
        self._why = ""
        self._missing: set[str] = set()
        self._handles: list[tuple[str, str, Any]] = []  # (index, uuid, handle)
        self._last_util_ts: dict[str, int] = {}

    # -- initialisation ------------------------------------------------------------------------
    def _init(self) -> bool:
        if self._state != "new":
            return self._state == "ok"
        if not any(os.path.exists(p) for p in DRIVER_PATHS):
            # No NVIDIA driver here: do not even import pynvml (~4 MB of resident memory).
            self._state, self._why = "unavailable", "no NVIDIA driver (none of " + ", ".join(DRIVER_PATHS) + " exists)"
            log.info("NVML unavailable (%s): GPU metrics are absent", self._why)
            return False
        try:
            import pynvml  # from nvidia-ml-py; imported here so a machine without it still works

            pynvml.nvmlInit()
            handles = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                handles.append((str(i), uuid.decode() if isinstance(uuid, bytes) else str(uuid), h))
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError ...
            self._state, self._why = "unavailable", f"{type(exc).__name__}: {exc}"
            log.info("NVML unavailable (%s): GPU metrics are absent", self._why)
            return False
        self._mod, self._handles, self._state = pynvml, handles, "ok"
        return True

    def available(self) -> bool:
        """True when NVML initialised and found the driver. Never raises."""
        with self._lock:
            return self._init()

    @property
    def why_unavailable(self) -> str:
        return self._why

    def _call(self, fn_name: str, *args: Any, default: Any = None) -> Any:
        if fn_name in self._missing:
            return default
        fn = getattr(self._mod, fn_name, None)
        if fn is None:
            self._missing.add(fn_name)
            return default
        try:
            return fn(*args)
        except self._mod.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in (self._mod.NVML_ERROR_FUNCTION_NOT_FOUND, self._mod.NVML_ERROR_NOT_SUPPORTED):
                self._missing.add(fn_name)
                log.info("NVML %s not supported here: %s", fn_name, exc)
            return default
        except Exception:  # a driver hiccup must never take the agent down
            return default

    # -- readings ------------------------------------------------------------------------------
    def read(self, per_process_utilization: bool | Iterable[int] = True) -> NvmlSnapshot | None:
        """Every device and every compute process on it; None without NVML.

        ``per_process_utilization``: True for every device, False for none, or the pids of
        interest: the costly per-process utilization query then runs only on devices where one
        of them holds a context."""
        wanted = None if isinstance(per_process_utilization, bool) else set(per_process_utilization)
        with self._lock:
            if not self._init():
                return None
            gpus: list[GpuReading] = []
            procs: dict[tuple[str, int], ProcessGpuReading] = {}
            for index, uuid, h in self._handles:
                util = self._call("nvmlDeviceGetUtilizationRates", h)
                mem = self._call("nvmlDeviceGetMemoryInfo", h)
                gpus.append(GpuReading(index, uuid, util.gpu / 100.0 if util is not None else None,
                                       float(mem.used) if mem is not None else None,
                                       float(mem.total) if mem is not None else None))
                for p in self._call("nvmlDeviceGetComputeRunningProcesses", h, default=[]) or []:
                    used = getattr(p, "usedGpuMemory", None)
                    procs[(index, int(p.pid))] = ProcessGpuReading(index, int(p.pid),
                                                                   float(used) if used is not None else None,
                                                                   None)
                on_device = {pid for (i, pid) in procs if i == index}
                if per_process_utilization if wanted is None else bool(wanted & on_device):
                    # Costly (~1.4 ms on an H200): the caller runs this at the NVML cadence only.
                    last = self._last_util_ts.get(index, 0)
                    samples = self._call("nvmlDeviceGetProcessUtilization", h, last, default=[]) or []
                    newest: dict[int, Any] = {}
                    for s in samples:
                        if s.pid not in newest or s.timeStamp > newest[s.pid].timeStamp:
                            newest[s.pid] = s
                    for pid, s in newest.items():
                        self._last_util_ts[index] = max(self._last_util_ts.get(index, 0), int(s.timeStamp))
                        old = procs.get((index, int(pid)))
                        procs[(index, int(pid))] = ProcessGpuReading(
                            index, int(pid), old.memory_bytes if old else None, s.smUtil / 100.0)
            return NvmlSnapshot(time.time(), tuple(gpus), tuple(procs.values()))

    def close(self) -> None:
        with self._lock:
            if self._state == "ok":
                self._call("nvmlShutdown")
            self._state = "new"
            self._handles = []
