"""GPU utilisation and memory of the device a worker runs on, read through NVML.

Each worker's `check_health` calls `read_gpu_stats(device)` and puts the dict (or None)
in its report under `gpu`; `cluster.control.metrics` turns it into `pdserve_gpu_*` gauges.
Where the worker runs on CPU, nvidia-ml-py is missing or NVML does not initialise
(no driver), the answer is None: the series are absent, never zero, never an error.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)


def read_gpu_stats(device: str) -> dict | None:
    """Called by a worker on every health report; None unless `device` is a CUDA GPU
    that NVML can read."""
    if not device.startswith("cuda"):
        return None
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = _device_handle(nvml, _cuda_index(device))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return {
            "utilization_ratio": nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            "memory_used_bytes": int(memory.used),
            "memory_total_bytes": int(memory.total),
        }
    except (nvml.NVMLError, IndexError, ValueError) as exc:
        logger.debug("NVML read failed for %s: %s", device, exc)
        return None


@functools.cache
def _nvml():
    """The initialised pynvml module, once per process; None where NVML is unusable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors
        logger.info("NVML unavailable, no GPU metrics from this process: %s", exc)
        return None
    return pynvml


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index else 0


def _device_handle(nvml, cuda_index: int):
    # CUDA numbers the devices in CUDA_VISIBLE_DEVICES (set by Ray per actor); NVML
    # numbers all devices on the node, so translate through that list when present.
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [d for d in visible if d]
    if not visible:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)
