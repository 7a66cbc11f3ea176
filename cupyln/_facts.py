"""A device's facts for the planner: its attributes, and what it says of compiled kernels.

The planner (``cupyln._plan``) is pure; this layer gathers what it reads from CuPy, the
compiler and the driver, one :class:`~cupyln._plan.DeviceInfo` per device.
"""

from __future__ import annotations

import functools

from . import _compile, _driver
from ._plan import DeviceInfo


@functools.cache  # one entry per device
def device_info(dev_id):
    import cupy as cp

    dev = cp.cuda.Device(dev_id)
    a = dev.attributes
    cuda = not cp.cuda.runtime.is_hip
    return DeviceInfo(
        sms=a.get("MultiProcessorCount", 1),
        warp=a.get("WarpSize", 32),
        threads_per_sm=a.get("MaxThreadsPerMultiProcessor", 2048),
        regs_per_sm=a.get("MaxRegistersPerMultiprocessor", 65536),
        smem_per_sm=a.get("MaxSharedMemoryPerMultiprocessor", 65536),
        smem_per_block=a.get("MaxSharedMemoryPerBlockOptin", 49152),
        async_copy=cuda and int(dev.compute_capability) >= 80,
        clusters=cuda and int(dev.compute_capability) >= 90,
        hip=not cuda,
        max_grid=(a.get("MaxGridDimX", 2**31 - 1), a.get("MaxGridDimY", 65535),
                  a.get("MaxGridDimZ", 65535)),
        device=dev_id,
        kernels=_compile.kernels,
        active_clusters=_driver.max_active_clusters,
        resident_blocks=_driver.resident_blocks,
    )


@functools.lru_cache(maxsize=4096)  # about two launches per cached plan
def launcher(launch):
    """The ``_driver.Launcher`` of a plan's :class:`~cupyln._plan.Launch`."""
    return _driver.Launcher(*launch)
