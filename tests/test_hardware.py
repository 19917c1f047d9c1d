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


def _wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


class Counting:
    name = "counting"

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> list[Reading]:
        self.reads += 1
        return [Reading("reads_total", self.reads)]


def test_the_sampler_outlives_an_interval_no_wait_can_take() -> None:
    """`telemetry.interval_s = 1e10` once ended the thread (a wait past
    threading.TIMEOUT_MAX raises OverflowError): the wait is held to a day, and an interval
    patched back is followed within a second, not after the day."""
    reader = Counting()
    sampler = HardwareSampler([reader], interval_s=0.05)
    sampler.start()
    try:
        assert _wait_for(lambda: reader.reads >= 3, 5)
        sampler.interval_s = 1e10
        time.sleep(0.3)
        sampler.interval_s = 0.05
        reads = reader.reads
        assert _wait_for(lambda: reader.reads >= reads + 3, 5), "sampling did not resume"
        assert sampler.running
        sampler.interval_s = 1e10
        assert sampler.pause_s() == 86400.0
        for odd in (float("nan"), float("inf"), -1.0, 0.0, 10**400):
            sampler.interval_s = odd
            assert sampler.pause_s() == 5.0
    finally:
        sampler.stop()
    assert not sampler.running


def test_a_step_that_raises_is_logged_and_sampling_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    reader = Counting()
    sampler = HardwareSampler([reader], interval_s=0.05)
    calls = [0]
    real = sampler.sample

    def flaky() -> list[Reading]:
        calls[0] += 1
        if calls[0] == 2:  # the thread's first step
            raise RuntimeError("snapshot lost")
        return real()

    sampler.sample = flaky  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="edge_agent.telemetry.hardware"):
        sampler.start()
        try:
            assert _wait_for(lambda: reader.reads >= 3, 5), "sampling stopped after an error"
            assert sampler.running
        finally:
            sampler.stop()
    assert "snapshot lost" in caplog.text and "sampling goes on" in caplog.text
