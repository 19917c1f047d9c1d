"""Hardware readings behind one Protocol: psutil, NVIDIA's NVML, and Jetson sysfs.

Each reader returns `Reading`s (name, labels, value); whatever a box lacks (no NVIDIA
driver, no Jetson sysfs, no temperature sensors) is simply absent from the readings,
never an exception or a hang. A background `HardwareSampler` reads them at an interval
and keeps the latest snapshot, so a scrape never waits on hardware. Its thread never
ends before `stop()`: a step that fails is logged and the next one comes, and whatever
interval it is handed (the settings bound it; a live patch sets it) is held to
`SAMPLER_MIN_S` … `SAMPLER_MAX_S`, since a wait past `threading.TIMEOUT_MAX` raises and a
wait of nothing spins a core.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)
SAMPLER_MIN_S = 0.01
SAMPLER_MAX_S = 86400.0
# How often the sampler's thread looks at `interval_s` while it waits: a patch from a day
# back to seconds is followed within this long, not after the day.
SAMPLER_RECHECK_S = 1.0


@dataclass(frozen=True)
class Reading:
    name: str  # metric name without the edge_agent_ prefix, e.g. "gpu_utilization_ratio"
    value: float
    labels: tuple[tuple[str, str], ...] = ()
    help: str = ""


class HardwareReader(Protocol):
    name: str

    def read(self) -> list[Reading]: ...


class PsutilReader:
    """CPU, load, memory, swap, the state dir's disk, temperatures and this process's RSS."""

    name = "psutil"

    def __init__(self, state_dir: Path) -> None:
        import psutil

        self._psutil = psutil
        self._state_dir = state_dir
        self._process = psutil.Process()
        psutil.cpu_percent(None)  # first call primes the counter

    def read(self) -> list[Reading]:
        ps = self._psutil
        out = [Reading("cpu_utilization_ratio", ps.cpu_percent(None) / 100,
                       help="CPU busy fraction since the last sample")]
        for period, value in zip(("1m", "5m", "15m"), os.getloadavg(), strict=True):
            out.append(Reading("load_average", value, (("period", period),), "Load average"))
        vm, sw = ps.virtual_memory(), ps.swap_memory()
        out += [Reading("memory_used_bytes", vm.total - vm.available, help="RAM in use"),
                Reading("memory_total_bytes", vm.total, help="RAM"),
                Reading("swap_used_bytes", sw.used, help="Swap in use"),
                Reading("process_resident_bytes", self._process.memory_info().rss,
                        help="This process's resident memory")]
        try:
            disk = ps.disk_usage(str(self._state_dir))
            out += [Reading("state_disk_free_bytes", disk.free, help="Free space of state dir"),
                    Reading("state_disk_total_bytes", disk.total, help="Size of state dir's fs")]
        except OSError:
            pass
        temps = getattr(ps, "sensors_temperatures", None)
        for chip, entries in (temps() if temps else {}).items():
            for i, entry in enumerate(entries):
                out.append(Reading("temperature_celsius", entry.current,
                                   (("sensor", f"{chip}/{entry.label or i}"),),
                                   "Temperature by sensor"))
        return out


class NvmlReader:
    """NVIDIA GPUs through NVML (nvidia-ml-py). Absent without a driver."""

    name = "nvml"

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml
        self.available = False
        self.driver_version = ""
        self.cuda_version = ""
        self.gpus: list[str] = []
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self.available = True
            self.driver_version = _text(self._nvml.nvmlSystemGetDriverVersion())
            cuda = int(self._nvml.nvmlSystemGetCudaDriverVersion())
            self.cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
            self.gpus = [
                _text(self._nvml.nvmlDeviceGetName(self._nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(self._nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no library, no driver, no GPU: all mean "absent"
            log.debug("NVML absent: %s", exc)
            self.available = False

    def read(self) -> list[Reading]:
        if not self.available:
            return []
        nv = self._nvml
        assert nv is not None
        out: list[Reading] = []
        for i, name in enumerate(self.gpus):
            labels = (("gpu", str(i)), ("name", name))
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out += [
                    Reading("gpu_utilization_ratio", util.gpu / 100, labels, "GPU busy"),
                    Reading("gpu_memory_used_bytes", mem.used, labels, "GPU memory in use"),
                    Reading("gpu_memory_total_bytes", mem.total, labels, "GPU memory"),
                    Reading("gpu_temperature_celsius",
                            nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), labels,
                            "GPU temperature"),
                    Reading("gpu_power_watts", nv.nvmlDeviceGetPowerUsage(h) / 1000, labels,
                            "GPU power draw"),
                    Reading("gpu_sm_clock_hertz",
                            nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) * 1e6, labels,
                            "GPU SM clock"),
                    Reading("gpu_throttle_reasons",
                            float(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)), labels,
                            "NVML throttle-reason bit mask (0: not throttled)"),
                ]
            except Exception as exc:  # one bad query must not lose the others
                log.debug("NVML read of GPU %d failed: %s", i, exc)
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class JetsonReader:
    """NVIDIA Jetson (no NVML there): GPU load from sysfs, thermal zones, unified memory
    from /proc/meminfo and INA3221 power rails where exposed. `root` lets tests point it
    at a recorded sysfs tree."""

    name = "jetson"
    _GPU_LOAD = ("sys/devices/platform/gpu.0/load", "sys/devices/gpu.0/load",
                 "sys/devices/platform/17000000.gpu/load",
                 "sys/devices/platform/bus@0/17000000.gpu/load")

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._load = next((root / p for p in self._GPU_LOAD if (root / p).is_file()), None)
        self.available = self._load is not None

    def read(self) -> list[Reading]:
        if not self.available:
            return []
        out: list[Reading] = []
        load = _read_number(self._load)
        if load is not None:  # per mille
            out.append(Reading("gpu_utilization_ratio", load / 1000,
                               (("gpu", "0"), ("name", "jetson")), "GPU busy"))
        for zone in sorted((self.root / "sys/class/thermal").glob("thermal_zone*")):
            kind = _read_text(zone / "type")
            temp = _read_number(zone / "temp")
            if kind and temp is not None:
                out.append(Reading("temperature_celsius", temp / 1000, (("sensor", kind),),
                                   "Temperature by sensor"))
        mem = _meminfo(self.root / "proc/meminfo")
        if "MemTotal" in mem and "MemAvailable" in mem:
            out += [Reading("unified_memory_total_bytes", mem["MemTotal"],
                            help="Unified CPU/GPU memory"),
                    Reading("unified_memory_used_bytes", mem["MemTotal"] - mem["MemAvailable"],
                            help="Unified CPU/GPU memory in use")]
        for rail, watts in _power_rails(self.root):
            out.append(Reading("power_rail_watts", watts, (("rail", rail),), "Power by rail"))
        return out


def _read_text(path: Path | None) -> str | None:
    try:
        return path.read_text().strip() if path else None
    except OSError:
        return None


def _read_number(path: Path | None) -> float | None:
    text = _read_text(path)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _meminfo(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (_read_text(path) or "").splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            out[m.group(1)] = float(m.group(2)) * 1024
    return out


def _power_rails(root: Path) -> list[tuple[str, float]]:
    rails = []
    for dev in sorted(root.glob("sys/bus/i2c/drivers/ina3221*/*/hwmon/hwmon*")):
        for label in sorted(dev.glob("in*_label")):
            idx = label.name[2:].split("_")[0]
            volts = _read_number(dev / f"in{idx}_input")
            amps = _read_number(dev / f"curr{idx}_input")
            name = _read_text(label)
            if name and volts is not None and amps is not None:
                rails.append((name, volts * amps / 1e6))  # mV x mA
    return rails


@dataclass
class HardwareSampler:
    """Reads every reader each `interval_s` in a daemon thread; `snapshot` is the latest."""

    readers: Sequence[HardwareReader]
    interval_s: float = 5.0
    snapshot: list[Reading] = field(default_factory=list)
    cpu_seconds: float = 0.0  # this sampler's own cost, for the bench
    samples: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> list[Reading]:
        start = time.thread_time()
        readings: list[Reading] = []
        for reader in self.readers:
            try:
                readings += reader.read()
            except Exception as exc:
                log.warning("hardware reader %s failed: %s", reader.name, exc)
        self.snapshot = readings
        self.samples += 1
        self.cpu_seconds += time.thread_time() - start
        return readings

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="hardware", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pause_s(self) -> float:
        """The wait between samples: `interval_s` held to SAMPLER_MIN_S … SAMPLER_MAX_S
        (anything not a positive finite number: the default 5 s)."""
        try:
            value = float(self.interval_s)
        except (TypeError, ValueError, OverflowError):
            return 5.0
        if not math.isfinite(value) or value <= 0:
            return 5.0
        return min(max(value, SAMPLER_MIN_S), SAMPLER_MAX_S)

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            try:
                left = last + self.pause_s() - time.monotonic()
                if self._stop.wait(min(max(left, 0.0), SAMPLER_RECHECK_S)):
                    return
                if time.monotonic() - last >= self.pause_s():
                    self.sample()
                    last = time.monotonic()
            except Exception:  # one bad step never ends the sampling
                log.exception("hardware sampler: a step failed; sampling goes on")
                if self._stop.wait(SAMPLER_RECHECK_S):  # no busy loop if it fails again
                    return
                last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def default_readers(state_dir: Path) -> list[HardwareReader]:
    readers: list[HardwareReader] = [PsutilReader(state_dir)]
    nvml = NvmlReader()
    if nvml.available:
        readers.append(nvml)
    jetson = JetsonReader()
    if jetson.available:
        readers.append(jetson)
    return readers
