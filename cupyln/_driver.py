"""Kernel launch with little host time: the driver's launch call (``cuLaunchKernel``, or
``hipModuleLaunchKernel`` on ROCm, through CuPy's own binding) with an argument buffer built once
per launch configuration, instead of a CuPy RawKernel call (which converts every argument on
every call).

Arguments are described by one letter each: ``p`` pointer (an int address, 0 for NULL),
``i`` 64-bit integer, ``f`` float32, ``d`` float64.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

from ._spec import PORTABLE_CLUSTER

try:
    from cupy_backends.cuda.api import driver as _drv
    from cupy_backends.cuda.api import runtime as _rt
except ImportError:  # no CuPy: the planner and its tests still import this module; nothing launches
    _drv = _rt = None

_STRUCT = {"p": "Q", "i": "q", "f": "f", "d": "d"}  # native-aligned C layout of each argument
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute (cuda.h)
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT (cuda.h)


def param_layout(kinds):
    """struct format of the argument buffer (C alignment) and each argument's byte offset: the
    size of the arguments before it, padded to its own alignment."""
    fmt = "@" + "".join(_STRUCT[k] for k in kinds)
    offs = [struct.calcsize(fmt[: i + 2]) - struct.calcsize("@" + _STRUCT[k])
            for i, k in enumerate(kinds)]
    return fmt, offs


def allow_smem(kern, smem):
    """Let ``kern`` use ``smem`` bytes of dynamic shared memory. Every kernel gets 48 KiB less
    its static shared memory; more needs an opt-in (asked only near that size)."""
    if smem > 40 * 1024 and smem > kern.max_dynamic_shared_size_bytes:
        kern.max_dynamic_shared_size_bytes = smem


def allow_cluster(kern, blocks):
    """Let ``kern`` run in clusters of ``blocks`` blocks: past the portable size (8 on sm_90)
    the driver launches, and counts, such clusters only for a kernel that opted in."""
    if blocks > PORTABLE_CLUSTER:
        _drv.funcSetAttribute(kern.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=4096)  # asked once per plan and grid (the planner asks again)
def max_active_clusters(kern, cluster, block, smem):
    """How many clusters of ``kern`` (whose cluster shape, ``cluster`` = (blocks along x, along
    y), is fixed at compile time) can run at once on its device (``cuOccupancyMaxActiveClusters``;
    a cluster's blocks share one GPC, so this is not the resident blocks over the cluster size).
    0 where the driver cannot tell. Clusters past the portable size are allowed here, before
    the planner can choose them."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    except (OSError, AttributeError):
        return 0
    allow_smem(kern, smem)
    try:
        allow_cluster(kern, cluster[0] * cluster[1])
    except _drv.CUDADriverError:
        return 0  # a driver without the opt-in runs no larger cluster
    cfg = _LaunchConfig((*cluster, 1), (*block, 1, 1)[:3], smem, None, None, 0)
    n = ctypes.c_int(0)
    err = fn(ctypes.byref(n), ctypes.c_void_p(kern.kernel.ptr), ctypes.byref(cfg))
    return n.value if err == 0 else 0


def resident_blocks(kern, block, smem):
    """Blocks of ``kern`` (``block`` threads, ``smem`` bytes of dynamic shared memory) that one
    multiprocessor runs at once, as the driver counts them: a cooperative grid of at most that
    many per multiprocessor is accepted."""
    allow_smem(kern, smem)
    return _drv.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, block, smem)


class Launcher:
    """One kernel with a fixed grid, block and dynamic shared memory, on the device whose
    RawKernel it was made from. ``launcher(stream_ptr, *args)`` launches on that stream;
    ``cooperative``: every block resident at once (the driver refuses a grid that cannot be)."""

    __slots__ = ("kern", "dev", "grid", "block", "smem", "kinds", "cooperative", "_dims", "_buf",
                 "_params", "_params_ptr", "_pack", "_lock", "_launch")

    def __init__(self, kern, grid, block, smem, kinds, cooperative=False):
        self.kern, self.kinds, self.cooperative = kern, kinds, cooperative
        self._launch = _cooperative if cooperative else _drv.launchKernel
        self.dev = _rt.getDevice()  # plans are made with their device current
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.smem = smem
        allow_smem(kern, smem)
        self._dims = (kern.kernel.ptr, *self.grid, *self.block, smem)
        fmt, offs = param_layout(kinds)
        self._pack = struct.Struct(fmt).pack_into
        self._buf = ctypes.create_string_buffer(max(struct.calcsize(fmt), 8))
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * len(kinds))(*(base + o for o in offs))
        self._params_ptr = ctypes.addressof(self._params)
        # One buffer per launcher: the lock keeps two threads from filling it at once (the
        # driver copies the arguments before the launch call returns).
        self._lock = threading.Lock()

    def __call__(self, stream, *args):
        with self._lock:
            self._pack(self._buf, 0, *args)
            try:
                self._launch(*self._dims, stream, self._params_ptr, 0)
            except _drv.CUDADriverError as e:
                self._relaunch(e, stream)

    def _relaunch(self, err, stream):
        """A thread on which no context is current yet (the autograd engine's device thread,
        whose first CUDA work may be this launch): the device's primary context made current
        and the launch made again. Any other failure is raised with the launch's geometry."""
        if err.status == _INVALID_CONTEXT and not _drv.ctxGetCurrent():
            _rt.setDevice(self.dev)  # CUDA 12+: makes the primary context current
            try:
                self._launch(*self._dims, stream, self._params_ptr, 0)
                return
            except _drv.CUDADriverError as e:
                err = e
        raise RuntimeError(
            f"cupyln: kernel launch failed: {err} (grid {self.grid}, block {self.block}, "
            f"{self.smem} bytes of dynamic shared memory)"
        ) from err


def _cooperative(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """cuLaunchCooperativeKernel with cuLaunchKernel's arguments (it takes no ``extra``)."""
    _drv.launchCooperativeKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params)
