from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.telemetry.hardware import (
    HardwareSampler,
    JetsonReader,
    NvmlReader,
    PsutilReader,
    Reading,
)

FIXTURE = Path(__file__).parent / "fixtures" / "jetson"


def _by(readings: list[Reading]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(r.name, r.labels): r.value for r in readings}


def test_jetson_reader_on_a_recorded_sysfs_tree() -> None:
    reader = JetsonReader(FIXTURE)
    assert reader.available
    got = _by(reader.read())
    assert got[("gpu_utilization_ratio", (("gpu", "0"), ("name", "jetson")))] == 0.456
    assert got[("temperature_celsius", (("sensor", "cpu-thermal"),))] == 45.5
    assert got[("temperature_celsius", (("sensor", "gpu-thermal"),))] == 43.0
    assert got[("unified_memory_total_bytes", ())] == 7999000 * 1024
    assert got[("unified_memory_used_bytes", ())] == (7999000 - 5000000) * 1024
    assert got[("power_rail_watts", (("rail", "VDD_IN"),))] == pytest.approx(5.072)
    assert got[("power_rail_watts", (("rail", "VDD_CPU_GPU_CV"),))] == pytest.approx(1.988, 1e-3)


def test_jetson_reader_is_absent_elsewhere(tmp_path: Path) -> None:
    reader = JetsonReader(tmp_path)
    assert not reader.available and reader.read() == []


def test_nvml_degrades_to_absent_without_a_driver() -> None:
    reader = NvmlReader()  # this machine has no NVIDIA driver
    assert not reader.available
    assert reader.read() == []

    class Broken:
        def nvmlInit(self) -> None:
            raise OSError("NVML Shared Library Not Found")

    assert NvmlReader(Broken()).read() == []


class FakeNvml:
    """NVML's calls as pynvml exposes them, for two GPUs (the seam; real path runs on GPUs)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def nvmlInit(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: return "580.65"
    def nvmlSystemGetCudaDriverVersion(self) -> int: return 13000
    def nvmlDeviceGetCount(self) -> int: return 2
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i
    def nvmlDeviceGetName(self, h: int) -> bytes: return f"RTX {h}".encode()

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=40 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=2**30, total=8 * 2**30)

    def nvmlDeviceGetTemperature(self, h: int, kind: int) -> int: return 60
    def nvmlDeviceGetPowerUsage(self, h: int) -> int: return 75000
    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int: return 1500
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int: return 0


def test_nvml_reader_maps_every_gpu() -> None:
    reader = NvmlReader(FakeNvml())
    assert reader.available and reader.driver_version == "580.65"
    assert reader.cuda_version == "13.0" and reader.gpus == ["RTX 0", "RTX 1"]
    got = _by(reader.read())
    assert got[("gpu_utilization_ratio", (("gpu", "1"), ("name", "RTX 1")))] == 0.41
    assert got[("gpu_power_watts", (("gpu", "0"), ("name", "RTX 0")))] == 75.0
    assert got[("gpu_sm_clock_hertz", (("gpu", "0"), ("name", "RTX 0")))] == 1.5e9


@pytest.mark.gpu
def test_nvml_reads_a_real_gpu() -> None:
    reader = NvmlReader()
    if not reader.available:
        pytest.skip("no NVIDIA GPU on this machine")
    names = {r.name for r in reader.read()}
    assert {"gpu_utilization_ratio", "gpu_memory_total_bytes"} <= names


def test_psutil_reader_and_sampler(tmp_path: Path) -> None:
    class Failing:
        name = "failing"

        def read(self) -> list[Reading]:
            raise OSError("sensor gone")

    sampler = HardwareSampler([PsutilReader(tmp_path), Failing()], interval_s=0.05)
    sampler.start()
    try:
        deadline = time.monotonic() + 5
        while sampler.samples < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
    assert sampler.samples >= 3 and sampler.cpu_seconds > 0  # the bench reports the cost
    got = _by(sampler.snapshot)
    assert got[("memory_total_bytes", ())] > 0
    assert 0 <= got[("cpu_utilization_ratio", ())] <= 1
    names = {r.name for r in sampler.snapshot}
    assert {"process_resident_bytes", "state_disk_free_bytes", "load_average"} <= names
