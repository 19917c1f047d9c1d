"""This box as an agent release sees it (`protocol.agent_release.BoxPlatform`): the wheel
tags its Python installs (pip's own list, `packaging.tags`), its CPU flags
(/proc/cpuinfo) and its NVIDIA GPUs' compute capabilities (NVML, where the library and a
GPU are there; none otherwise — the hardware seam a box without a GPU lacks)."""

from __future__ import annotations

from pathlib import Path

from packaging import tags

from edge_agent.fleet.protocol.agent_release import BoxPlatform


def box_platform(cpuinfo: Path = Path("/proc/cpuinfo")) -> BoxPlatform:
    return BoxPlatform(
        tuple((t.interpreter, t.abi, t.platform) for t in tags.sys_tags()),
        cpu_flags(cpuinfo), cuda_capabilities())


def cpu_flags(cpuinfo: Path) -> frozenset[str]:
    try:
        with cpuinfo.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cuda_capabilities() -> frozenset[str]:
    try:
        import pynvml
    except ImportError:
        return frozenset()
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU: a CPU box
        return frozenset()
    try:
        out = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(
                pynvml.nvmlDeviceGetHandleByIndex(i))
            out.add(f"{major}{minor}")
        return frozenset(out)
    except Exception:
        return frozenset()
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
