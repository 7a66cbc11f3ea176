"""cupyln from PyTorch: differentiable ``layer_norm`` / ``rms_norm`` and drop-in modules.

    import cupyln.torch as ct
    y = ct.layer_norm(x, (1024,), weight, bias)          # torch.nn.functional's signature
    norm = ct.LayerNorm(1024)                             # torch.nn.LayerNorm's arguments
    ct.replace_norms(model)                               # swap a model's norms in place
    y, h = ct.add_rms_norm(x, residual, (1024,), weight)  # h = x + residual, y = norm(h)
    norm = ct.RMSNorm(1024, weight_offset=1.0)            # Gemma: scale by (1 + weight)

Under ``torch.compile`` the norms are traced as torch operations computing what the kernels
compute, which Inductor fuses with their neighbours; with ``compiled_kernels(True)`` (or
``deterministic=True``) the calls are ``torch.library`` custom ops (``cupyln::layer_norm_fwd``
and friends) with fake implementations and registered autograd, so ``fullgraph=True`` traces
them; in eager mode the same functions run as a ``torch.autograd.Function``, without the custom
op's dispatch cost. CUDA tensors go to the kernels without a copy (their memory wrapped as CuPy
arrays, bfloat16 included; a signature's later calls launch the first call's prepared pass on
the tensors' addresses), on torch's current stream of the tensor's device, into outputs
allocated by torch (its caching allocator holds them); the forward's mean/rstd are saved for
the backward. CPU tensors run cupyln's NumPy path (the float64 reference, rounded to
the tensor's dtype): the same results, for tests and CPU-only machines, not for speed.

The backward is deterministic when the module or call asks for it (``deterministic=True``) or
``torch.are_deterministic_algorithms_enabled()``; otherwise dgamma/dbeta may differ in the last
bits between runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

from . import api
from ._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- tensors <-> arrays


_DTYPES = {torch.float16: FLOAT16, torch.bfloat16: BFLOAT16, torch.float32: FLOAT32,
           torch.float64: FLOAT64}


def _array(t):
    """A CuPy (CUDA tensors) or NumPy (CPU tensors) array on the same memory; None for None.
    A CUDA tensor's memory is wrapped as it is (zero-copy): DLPack took 18 us per tensor on the
    H200 host, six times a whole cupyln call's budget."""
    if t is None:
        return None
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"cupyln.torch takes float16, bfloat16, float32 and float64 tensors, "
                        f"got {t.dtype}")
    if t.is_cuda:
        return _cuda_array(t, dtype)
    t = t.detach()
    if t.dtype == torch.bfloat16:  # NumPy does not know torch's bfloat16: the same bits
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def _cuda_array(t, dtype):
    import cupy

    size = t.element_size()
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    nbytes = 0 if t.numel() == 0 else span * size
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(mem, 0),
                        tuple(st * size for st in t.stride()))


_STREAMS = {}


class _Protocol:
    """The CUDA stream protocol over a torch stream of a torch that lacks it."""

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return 0, self.stream.cuda_stream


def _stream(device):
    """torch's current stream of ``device`` as a CuPy stream (one object per stream)."""
    import cupy

    current = torch.cuda.current_stream(device)
    key = (device.index, current.cuda_stream)
    s = _STREAMS.get(key)
    if s is None:
        if hasattr(cupy.cuda.Stream, "from_external"):
            with cupy.cuda.Device(device.index):  # from_external takes the current device
                s = cupy.cuda.Stream.from_external(
                    current if hasattr(current, "__cuda_stream__") else _Protocol(current))
        else:  # CuPy before 14 (ExternalStream is deprecated from 14 on)
            s = cupy.cuda.ExternalStream(current.cuda_stream, device.index)
        if len(_STREAMS) >= 256:  # wrappers of streams a program made and dropped: made anew
            _STREAMS.clear()
        _STREAMS[key] = s
    return s


_ALLOCATORS = {}


def _allocator(index):
    """A CuPy allocator on torch's caching allocator (device ``index``, torch's current stream):
    cupyln's scratch then comes from torch, which may allocate while a CUDA graph is being
    captured (a cudaMalloc from CuPy's own pool there fails the capture) and which gives the
    graph's memory back with the graph."""
    alloc = _ALLOCATORS.get(index)
    if alloc is None:
        import cupy

        device = torch.device("cuda", index)

        def alloc(size):
            t = torch.empty(size, dtype=torch.uint8, device=device)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), size, t, index),
                                           0)

        _ALLOCATORS[index] = alloc
    return alloc


def _run(key, fn, *args, out, **kw):
    """``fn`` (``api._fwd`` or ``api._bwd``) on the arrays of the tensors among ``args``,
    ``out`` and ``kw``; for CUDA tensors on torch's current stream of their device, cupyln's
    scratch from torch's allocator, the call's prepared pass kept under ``key``."""
    arrays = [_array(a) if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: _array(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = tuple(map(_array, out))
    device = args[0].device
    if device.type != "cuda":
        return fn(*arrays, out=out, **kw)
    import cupy

    with cupy.cuda.Device(device.index), _stream(device), \
            cupy.cuda.using_allocator(_allocator(device.index)):
        return fn(*arrays, out=out, prepared=lambda hot: _keep(key, hot), **kw)


# ----------------------------------------------------------------------------- prepared calls
#
# A CUDA call whose signature (each tensor's shape, strides, dtype and device, and the call's
# scalars) once went through the CuPy path without a copy keeps that call's prepared pass
# (cupyln._passes): later calls launch it on the tensors' addresses, with no CuPy arrays,
# streams or validation (the CuPy path cost most of a module call's host time).

_PREPARED = {}
_PREPARED_MAX = 4096  # signatures kept; past that the table starts over


def _signature(head, tensors):
    """The key of a call: ``head`` (the op and its scalars), then each tensor's layout."""
    return (head, *[None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                    for t in tensors])


def _keep(key, hot):
    if len(_PREPARED) >= _PREPARED_MAX:
        _PREPARED.clear()
    _PREPARED[key] = hot


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(index):
    """torch's current stream of device ``index``, as an address (torch's own accessor where
    this torch has it: the public one builds a Stream object, 3 us on the H200 host)."""
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def _launched(key, tensors):
    """Whether the prepared pass of ``key`` (if any) ran on ``tensors``: its inputs, then its
    outputs, each allocated here, in the pass's order (see ``_passes.HotFwd.launch_at``)."""
    hot = _PREPARED.get(key)
    if hot is None:
        return False
    from ._passes import _get_device

    if _get_device() != hot.dev:
        return False
    n = hot.scratch_bytes
    scratch = torch.empty(n, dtype=torch.uint8, device=tensors[0].device) if n else None
    return hot.launch_at(_raw_stream(hot.dev),
                         tuple(0 if t is None else t.data_ptr() for t in tensors),
                         0 if scratch is None else scratch.data_ptr())


# ----------------------------------------------------------------------------- the C++ layer
#
# cupyln/_torch_native.cpp runs LayerNorm and RMSNorm of CUDA tensors as C++ autograd functions
# on the prepared passes' recipes: a module call then costs the host about what torch's own norm
# does. It is built with torch.utils.cpp_extension (a C++ compiler and Python's headers; no CUDA
# toolkit) on the first CUDA call, in the background: calls take the Python layer until it is
# ready, and the build is kept on disk for later processes. CUPYLN_TORCH_NATIVE=0 keeps the
# Python layer alone; =wait builds it before the first CUDA call returns.

_NATIVE = None  # the built extension
_NATIVE_BUILD = {}  # "thread": the build's thread; "error": why it failed


def _native_forward(is_ln, x, weight, bias, residual, y, mean, rstd, h, k, eps, weight_offset,
                    residual_dtype):
    """The C++ layer's forward where it has no recipe: run here, the recipe handed back."""
    out = ((y, mean, rstd) if is_ln else (y, rstd)) + ((h,) if residual is not None else ())
    hot = _fwd_into(out, x, weight, bias, residual, x.shape[x.dim() - k:], eps, is_ln,
                    weight_offset, residual_dtype)
    return None if hot is None else hot.native()


def _native_backward(is_ln, dy, x, weight, mean, rstd, dresidual, dx, dweight, dbias,
                     deterministic, weight_offset):
    """The C++ layer's backward where it has no recipe: run here, the recipe handed back."""
    hot = _bwd(dy, x, weight, mean, rstd, dresidual, (dx, dweight, dbias), deterministic,
               weight_offset)
    return None if hot is None else hot.native()


def _build_native():
    global _NATIVE
    try:
        from torch.utils.cpp_extension import load_inline

        src = Path(__file__).with_name("_torch_native.cpp").read_text()
        with _build_folder() as folder:
            mod = load_inline("cupyln_torch_native", cpp_sources=[src], extra_cflags=["-O2"],
                              build_directory=folder)
        mod.set_python(_native_forward, _native_backward)
        mod.register_ops(_OP_IMPLS)  # torch.compile's graphs then call the ops' C++ kernels
        _NATIVE = mod
        _NATIVE_BUILD.pop("error", None)  # a wait that gave up before the build ended
    except Exception as e:  # no compiler, no Python headers: the Python layer stays
        _NATIVE_BUILD["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        warnings.warn(f"cupyln.torch: the C++ layer could not be built, so calls take the "
                      f"Python layer (more host time per call): {_NATIVE_BUILD['error']}",
                      RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def _build_folder():
    """The C++ layer's build folder (under TORCH_EXTENSIONS_DIR, else torch's default root; one
    per Python and torch version), held under an operating-system lock for the build. torch's
    own lock is a file that outlives a process killed mid-build, and later builds then wait on
    it without end: ours ends with its process, so a torch lock found while ours is held is a
    dead build's, and is removed. (Without fcntl, as on Windows, torch's lock alone.)"""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    folder = os.path.join(root, f"cupyln_torch_native_py{sys.version_info[0]}"
                                f"{sys.version_info[1]}_torch{torch.__version__}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cupyln.lock"), "w") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, "lock"))
        yield folder


# The C++ layer reads the current CUDA stream through torch's device interface
# (getStreamNativeHandle, without CUDA headers), which torch has from 2.11.
NATIVE_MIN_TORCH = (2, 11)


def _torch_release():
    """torch's (major, minor) version."""
    return tuple(int(v) for v in torch.__version__.split(".")[:2])


def _start_native():
    """Starts the C++ layer's build, once (CUDA on NVIDIA GPUs, torch 2.11 or later)."""
    if _NATIVE_BUILD:
        return
    mode = os.environ.get("CUPYLN_TORCH_NATIVE", "1")
    if mode == "0" or torch.version.hip is not None:
        _NATIVE_BUILD["error"] = "off" if mode == "0" else "ROCm: the Python layer runs"
        return
    if _torch_release() < NATIVE_MIN_TORCH:
        _NATIVE_BUILD["error"] = (f"torch {torch.__version__}: the C++ layer needs torch "
                                  f"{'.'.join(map(str, NATIVE_MIN_TORCH))} or later")
        warnings.warn(f"cupyln.torch: {_NATIVE_BUILD['error']}, so calls take the Python layer "
                      f"(more host time per call)", RuntimeWarning, stacklevel=3)
        return
    thread = _NATIVE_BUILD["thread"] = threading.Thread(
        target=_build_native, name="cupyln.torch C++ layer build", daemon=True)
    thread.start()
    if mode == "wait":
        _native_wait()


NATIVE_WAIT_S = 900.0  # a build still running then is taken as stuck


def _native_wait(timeout=None):
    """The C++ layer, its build started and awaited here if need be (benchmarks, tests), for at
    most ``timeout`` seconds (NATIVE_WAIT_S); None where it is off, cannot be built, or is
    still building then, with the reason in ``_NATIVE_BUILD["error"]`` and a warning."""
    _start_native()
    thread = _NATIVE_BUILD.get("thread")
    if thread is not None:
        wait = NATIVE_WAIT_S if timeout is None else timeout
        thread.join(wait)
        if thread.is_alive() and "error" not in _NATIVE_BUILD:
            _NATIVE_BUILD["error"] = (
                f"still building after {wait:.0f} s (another process's build holding the lock "
                f"of its folder under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions?)")
            warnings.warn(f"cupyln.torch: the C++ layer is {_NATIVE_BUILD['error']}; calls "
                          f"take the Python layer meanwhile", RuntimeWarning, stacklevel=2)
    return _NATIVE


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = frozenset((*_PLAIN, type(None)))  # a set's test of the types: the cheapest


def _native_takes(x, *params):
    """Whether the C++ layer takes an eager call (its callers test for compiling): built, CUDA
    tensors of torch's own type (no tensor subclass, no functorch transform); starts its build
    on a first CUDA call."""
    if _NATIVE is None:
        if not _NATIVE_BUILD and isinstance(x, torch.Tensor) and x.is_cuda:
            _start_native()
        return False
    return (type(x) in _PLAIN and x.is_cuda and _PLAIN_OR_NONE.issuperset(map(type, params))
            and not _FUNCTORCH_ACTIVE())


# ----------------------------------------------------------------------------- custom ops
#
# The forwards take ``deterministic`` only to hand it to their backward (saved in the autograd
# context). The backwards return 0-element placeholders for gradients not asked for: custom ops
# return tensors, not None.


def _like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fwd_into(out, x, weight, bias, residual, normalized_shape, eps, is_ln, weight_offset,
              residual_dtype=None):
    """The forward into ``out`` (y, the statistics, then h where there is a residual); returns
    the call's prepared pass, None where it has none."""
    key = _signature((is_ln, eps, tuple(normalized_shape), weight_offset, residual_dtype),
                     (x, weight, bias, residual))
    mean, rstd = out[1:3] if is_ln else (None, out[1])
    h = out[-1] if residual is not None else None
    if not _launched(key, (x, weight, bias, residual, out[0], mean, rstd, h)):
        _run(key, api._fwd, x, weight, bias, eps, tuple(normalized_shape), is_ln, out=out,
             config=None, residual=residual, residual_dtype=_DTYPES.get(residual_dtype),
             weight_offset=weight_offset)
    return _PREPARED.get(key)


def _ln_fwd_impl(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                 normalized_shape: list[int], eps: float, deterministic: bool,
                 weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    out = _ln_fwd_fake(x, weight, bias, normalized_shape, eps, deterministic)
    _fwd_into(out, x, weight, bias, None, normalized_shape, eps, True, weight_offset)
    return out


def _ln_fwd_fake(x, weight, bias, normalized_shape, eps, deterministic, weight_offset=0.0):
    return _like(x), *_stats(x, normalized_shape, 2)


def _stats(x, normalized_shape, n):
    """``n`` float32 tensors of x's leading shape, given as a tuple: as a torch.Size it cost
    each allocation 2 us more (CPU host)."""
    lead = tuple(x.shape)[: x.dim() - len(normalized_shape)]
    return [x.new_empty(lead, dtype=torch.float32) for _ in range(n)]


def _rms_fwd_impl(x: Tensor, weight: Tensor | None, normalized_shape: list[int], eps: float,
                  deterministic: bool, weight_offset: float = 0.0) -> tuple[Tensor, Tensor]:
    out = _rms_fwd_fake(x, weight, normalized_shape, eps, deterministic)
    _fwd_into(out, x, weight, None, None, normalized_shape, eps, False, weight_offset)
    return out


def _rms_fwd_fake(x, weight, normalized_shape, eps, deterministic, weight_offset=0.0):
    return _like(x), *_stats(x, normalized_shape, 1)


# The fused residual add: h = x + residual in residual_dtype (x's when None), normalized; the
# outputs are (y, statistics, h).


def _h_like(x, residual_dtype):
    return torch.empty_like(x, dtype=residual_dtype or x.dtype,
                            memory_format=torch.contiguous_format)


def _add_ln_fwd_impl(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                     normalized_shape: list[int], eps: float, residual_dtype: torch.dtype | None,
                     weight_offset: float,
                     deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = _add_ln_fwd_fake(x, residual, weight, bias, normalized_shape, eps, residual_dtype,
                           weight_offset, deterministic)
    _fwd_into(out, x, weight, bias, residual, normalized_shape, eps, True, weight_offset,
              residual_dtype)
    return out


def _add_ln_fwd_fake(x, residual, weight, bias, normalized_shape, eps, residual_dtype,
                     weight_offset, deterministic):
    return (_like(x), *_stats(x, normalized_shape, 2), _h_like(x, residual_dtype))


def _add_rms_fwd_impl(x: Tensor, residual: Tensor, weight: Tensor | None,
                      normalized_shape: list[int], eps: float, residual_dtype: torch.dtype | None,
                      weight_offset: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    out = _add_rms_fwd_fake(x, residual, weight, normalized_shape, eps, residual_dtype,
                            weight_offset, deterministic)
    _fwd_into(out, x, weight, None, residual, normalized_shape, eps, False, weight_offset,
              residual_dtype)
    return out


def _add_rms_fwd_fake(x, residual, weight, normalized_shape, eps, residual_dtype, weight_offset,
                      deterministic):
    return (_like(x), *_stats(x, normalized_shape, 1), _h_like(x, residual_dtype))


def _grads(x, weight, stats, need):
    """Gradient tensors to fill: dx like x, dgamma/dbeta like weight (without a weight: in x's
    dtype, of x's axes after the statistics'); None where not needed."""

    def param():  # empty_like where it can: cheaper than new_empty
        return x.new_empty(tuple(x.shape)[stats.dim():]) if weight is None else _like(weight)

    return (_like(x) if need[0] else None, *(param() if n else None for n in need[1:]))


def _filled(grads, x):
    return tuple(x.new_empty(0) if g is None else g for g in grads)


# The backwards take the forward's h as x, with dresidual (the gradient reaching h from the
# residual stream, added to dx) where the forward had a residual.


def _ln_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                 need_dx: bool, need_dweight: bool, need_dbias: bool, deterministic: bool,
                 dresidual: Tensor | None = None,
                 weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    need = (need_dx, need_dweight and weight is not None, need_dbias)
    grads = _grads(x, weight, mean, need)
    _bwd(dy, x, weight, mean, rstd, dresidual, grads, deterministic, weight_offset)
    return _filled(grads, x)


def _bwd(dy, x, weight, mean, rstd, dresidual, grads, deterministic, weight_offset):
    """The backward into ``grads`` (dx, dgamma, dbeta; None where not needed; RMSNorm where
    ``mean`` is None); returns the call's prepared pass, None where it has none."""
    need = tuple(g is not None for g in grads)
    if not any(need):
        return None
    key = _signature(("rms" if mean is None else "ln", *need, deterministic, weight_offset),
                     (dy, x, weight, mean, rstd, dresidual))
    if not _launched(key, (dy, x, weight, mean, rstd, dresidual, *grads)):
        _run(key, api._bwd, dy, x, weight, mean, rstd, *need, deterministic,
             out=grads if mean is not None else grads[:2], config=None, dresidual=dresidual,
             weight_offset=weight_offset)
    return _PREPARED.get(key)


def _ln_bwd_fake(dy, x, weight, mean, rstd, need_dx, need_dweight, need_dbias, deterministic,
                 dresidual=None, weight_offset=0.0):
    return _filled(_grads(x, weight, mean, (need_dx, need_dweight and weight is not None,
                                            need_dbias)), x)


def _rms_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, need_dx: bool,
                  need_dweight: bool, deterministic: bool, dresidual: Tensor | None = None,
                  weight_offset: float = 0.0) -> tuple[Tensor, Tensor]:
    need = (need_dx, need_dweight and weight is not None)
    grads = _grads(x, weight, rstd, need)
    _bwd(dy, x, weight, None, rstd, dresidual, (*grads, None), deterministic, weight_offset)
    return _filled(grads, x)


def _rms_bwd_fake(dy, x, weight, rstd, need_dx, need_dweight, deterministic, dresidual=None,
                  weight_offset=0.0):
    return _filled(_grads(x, weight, rstd, (need_dx, need_dweight and weight is not None)), x)


_LIB = torch.library.Library("cupyln", "DEF")
_OP_IMPLS = {}  # the ops' Python implementations by name (the C++ layer's kernels fall back on)


def _op(name, impl, fake):
    """The torch op ``cupyln::name`` running ``impl`` (its schema from impl's annotations),
    ``fake`` under tracing. Defined through ``torch.library.Library`` rather than
    ``custom_op``: the dispatcher then calls ``impl`` itself, where custom_op's wrapper checks
    the outputs' aliasing on every call (host time that compiled models pay per norm)."""
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=()))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    _OP_IMPLS[name] = impl
    op = getattr(torch.ops.cupyln, name).default
    torch.library.register_fake(op, fake, lib=_LIB)
    return op


_ln_fwd = _op("layer_norm_fwd", _ln_fwd_impl, _ln_fwd_fake)
_rms_fwd = _op("rms_norm_fwd", _rms_fwd_impl, _rms_fwd_fake)
_ln_bwd = _op("layer_norm_bwd", _ln_bwd_impl, _ln_bwd_fake)
_rms_bwd = _op("rms_norm_bwd", _rms_bwd_impl, _rms_bwd_fake)
_add_ln_fwd = _op("add_layer_norm_fwd", _add_ln_fwd_impl, _add_ln_fwd_fake)
_add_rms_fwd = _op("add_rms_norm_fwd", _add_rms_fwd_impl, _add_rms_fwd_fake)


# ----------------------------------------------------------------------------- autograd


def _eager(*tensors):
    """Whether real tensors run (no tracing: a traced backward must call the custom op)."""
    return not torch.compiler.is_compiling() and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _deterministic(ctx):
    return ctx.deterministic or torch.are_deterministic_algorithms_enabled()


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _, _, deterministic, weight_offset = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.has_bias, ctx.deterministic, ctx.weight_offset = bias is not None, deterministic, \
        weight_offset


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_w, need_b = need[1] and weight is not None, need[2] and ctx.has_bias
    bwd = _ln_bwd_impl if _eager(dy, x) else _ln_bwd
    dx, dw, db = bwd(dy, x, weight, mean, rstd, need[0], need_w, need_b, _deterministic(ctx),
                     None, ctx.weight_offset)
    return (dx if need[0] else None, dw if need_w else None, db if need_b else None,
            None, None, None, None)


def _rms_setup(ctx, inputs, output):
    x, weight, _, _, deterministic, weight_offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.deterministic, ctx.weight_offset = deterministic, weight_offset


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_w = need[1] and weight is not None
    bwd = _rms_bwd_impl if _eager(dy, x) else _rms_bwd
    dx, dw = bwd(dy, x, weight, rstd, need[0], need_w, _deterministic(ctx), None,
                 ctx.weight_offset)
    return dx if need[0] else None, dw if need_w else None, None, None, None, None


def _add_setup(ctx, inputs, output):
    """The fused add (inputs x, residual, weight[, bias], ...; outputs y, statistics, h): the
    backward reads h, the weight and the statistics."""
    x, residual, weight = inputs[:3]
    ctx.is_ln = len(output) == 4
    ctx.has_bias = ctx.is_ln and inputs[3] is not None
    ctx.weight_offset, ctx.deterministic = inputs[-2], inputs[-1]
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(output[-1], weight, *output[1:-1])


def _add_backward(ctx, dy, *grads):
    """dx of the norm of h plus dh (the gradient reaching h from the residual stream): the
    gradient of both x and residual, each in its own dtype."""
    h, weight, *stats = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_h = need[0] or need[1]
    need_w = need[2] and weight is not None
    need_b = ctx.has_bias and need[3]
    dh = grads[-1] if need_h else None
    dy = dy.to(h.dtype)  # dy in h's dtype: the backward's rule
    # parameters in h's dtype or float32 (16-bit weights of a float32 h: widened)
    w = weight if weight is None or weight.dtype in (h.dtype, torch.float32) else weight.float()
    det = _deterministic(ctx)
    if ctx.is_ln:
        bwd = _ln_bwd_impl if _eager(dy, h) else _ln_bwd
        dxh, dw, db = bwd(dy, h, w, *stats, need_h, need_w, need_b, det, dh,
                          ctx.weight_offset)
    else:
        bwd = _rms_bwd_impl if _eager(dy, h) else _rms_bwd
        (dxh, dw), db = bwd(dy, h, w, *stats, need_h, need_w, det, dh, ctx.weight_offset), None
    pdt = h.dtype if weight is None else weight.dtype
    grads = [dxh.to(ctx.dtypes[0]) if need[0] else None,
             dxh.to(ctx.dtypes[1]) if need[1] else None, dw.to(pdt) if need_w else None]
    if ctx.is_ln:
        grads.append(db.to(pdt) if need_b else None)
    return (*grads, *(None,) * (ctx.n_inputs - len(grads)))


for _fwd, _backward, _setup in ((_ln_fwd, _ln_backward, _ln_setup),
                                (_rms_fwd, _rms_backward, _rms_setup),
                                (_add_ln_fwd, _add_backward, _add_setup),
                                (_add_rms_fwd, _add_backward, _add_setup)):
    torch.library.register_autograd(_fwd, _backward, setup_context=_setup, lib=_LIB)


def _eager_function(impl, setup, bwd, n_stats):
    """The eager path of one op: the same forward, setup and backward as the custom op without
    its dispatch (50 us per call on the H200 host). forward takes ctx itself: with a separate
    setup_context torch binds the arguments through inspect.signature on every call. It returns
    y (and h for the fused add), not the ``n_stats`` statistics: they are saved, not outputs,
    so the backward is not handed zero-filled gradients for them (20 us a call)."""

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            out = impl(*inputs)
            setup(ctx, inputs, out)
            return Eager.outputs(out)

        @staticmethod
        def outputs(out):
            return out[0] if len(out) == 1 + n_stats else (out[0], out[-1])

        @staticmethod
        def without_grad(*inputs):  # no graph to record: apply's own cost saved
            return Eager.outputs(impl(*inputs))

        @staticmethod
        def backward(ctx, dy, *dh):
            return bwd(ctx, dy, *(None,) * n_stats, *dh)

    # apply's C++ part, without torch's Python wrapper (see _call)
    Eager.recorded = super(torch.autograd.Function, Eager).apply
    return Eager


_LayerNorm = _eager_function(_ln_fwd_impl, _ln_setup, _ln_backward, 2)
_RMSNorm = _eager_function(_rms_fwd_impl, _rms_setup, _rms_backward, 1)
_AddLayerNorm = _eager_function(_add_ln_fwd_impl, _add_setup, _add_backward, 2)
_AddRMSNorm = _eager_function(_add_rms_fwd_impl, _add_setup, _add_backward, 1)


# ----------------------------------------------------------------------------- functions


def _tensors(**named):
    """TypeError naming the first argument that is neither a tensor nor (where optional) None."""
    for name, t in named.items():
        if not isinstance(t, Tensor) and (t is not None or name in ("x", "residual")):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _shape(normalized_shape):
    """normalized_shape as the ops' list of ints, checked as the array API checks it (a
    module's tuple of ints passes at once)."""
    if type(normalized_shape) is tuple and normalized_shape and all(
            type(s) is int for s in normalized_shape):
        return list(normalized_shape)
    return list(api._shape_arg(normalized_shape))


# torch's own test for functorch transforms (private); where a torch lacks it, every call takes
# the public path (``apply``, the Python layer), which is right under any transform.
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


_FORWARD_AD = torch.autograd.forward_ad


def _dual_level():
    """Whether a forward-mode AD level is open (torch's private level, -1 when none; where a
    torch lacks it, taken as open): a call then takes ``apply`` even without grad, which
    refuses a tangent it cannot carry rather than dropping it."""
    return getattr(_FORWARD_AD, "_current_level", 0) >= 0


def _call(op, eager, *args):
    """The custom op under ``torch.compile`` (outputs: y, the statistics, then h for the fused
    add), the eager Function where gradients are recorded, its forward alone under
    ``torch.no_grad()`` / ``inference_mode()``; either way y, or (y, h) for the fused add.
    Outside functorch transforms the Function is applied without torch's Python wrapper
    around ``apply``, whose checks for them and pass over the arguments (to unwrap tensors
    left from a finished transform, which the forward takes as they are, as without grad)
    cost as much as the rest of ``apply`` (CPU host, no-op forward: 38-53 against 22-27 us)."""
    if not torch.compiler.is_compiling():
        if not torch.is_grad_enabled() and not _dual_level():
            return eager.without_grad(*args)
        return eager.apply(*args) if _FUNCTORCH_ACTIVE() else eager.recorded(*args)
    out = op(*args)
    return (out[0], out[-1]) if op in (_add_ln_fwd, _add_rms_fwd) else out[0]


_OFFSET_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
               torch.float32: torch.float32, torch.float64: torch.float64}


def _with_offset(x, weight, weight_offset):
    """(weight + weight_offset, 0.0) in the kernels' accumulation dtype, by torch ops: autograd
    carries dgamma back to weight's dtype, torch.compile fuses the add, and the C++ layer keeps
    its recipes (a call with an offset has none). The same values as the array API's offset.
    Inputs the kernels do not take are left as they are, for the checks to name."""
    acc = _OFFSET_ACC.get(getattr(x, "dtype", None))
    if not weight_offset or acc is None or not isinstance(weight, Tensor) \
            or weight.dtype not in _OFFSET_ACC:
        return weight, weight_offset
    return weight.to(acc) + weight_offset, 0.0


# ----------------------------------------------------------------------------- under compile
#
# Inductor fuses a norm written as torch operations with what surrounds it (casts, the residual
# add, the weight offset, the next operation's loads); cupyln's kernels are opaque to it. Whole
# training steps compiled with torch's norms were as fast or faster than with cupyln's kernels
# as custom ops on every model measured, so compiled code traces cupyln's norms as torch
# operations unless kernels are asked for (compiled_kernels) or the call is deterministic (a
# guarantee of cupyln's kernels).
_COMPILED = {"kernels": False}


def compiled_kernels(on: bool | None = None) -> bool:
    """Whether code under ``torch.compile`` calls cupyln's kernels (custom ops) rather than
    tracing the norms as torch operations that Inductor fuses with their neighbours (the
    default; ``deterministic=True`` calls keep the kernels). ``on``: set it (graphs compiled
    before recompile). Returns the setting in force."""
    if on is not None:
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool or None, got {type(on).__name__}")
        _COMPILED["kernels"] = on
    return _COMPILED["kernels"]


def _traced(x, residual, weight, bias, shape, eps, is_ln, weight_offset, residual_dtype):
    """cupyln's norm as torch operations: statistics, scale and shift in float32 (float64 for
    float64 x), one rounding to x's dtype; with a residual, (y, h) of h = x + residual rounded
    to its dtype and normalized as stored."""
    _traced_check(x, residual, weight, bias, shape, eps, weight_offset, residual_dtype)
    acc = _OFFSET_ACC[x.dtype]
    h = None if residual is None else (x.to(acc) + residual.to(acc)).to(residual_dtype or x.dtype)
    v = (x if h is None else h).to(acc)
    axes = tuple(range(-len(shape), 0))
    if is_ln:  # one pass for both statistics where Inductor can (its Welford reduction)
        var, mean = torch.var_mean(v, axes, correction=0, keepdim=True)
        v = (v - mean) * torch.rsqrt(var + eps)
    else:
        v = v * torch.rsqrt(v.square().mean(axes, keepdim=True) + eps)
    if weight is not None:
        v = v * (weight.to(acc) + weight_offset if weight_offset else weight.to(acc))
    if bias is not None:
        v = v + bias.to(acc)
    return v.to(x.dtype) if h is None else (v.to(x.dtype), h)


def _traced_check(x, residual, weight, bias, shape, eps, weight_offset, residual_dtype):
    """The checks of the kernels' calls that a traced norm would otherwise pass over: types,
    dtypes and shapes (at trace time: they are constants of the graph)."""
    _tensors(x=x, weight=weight, bias=bias, **({} if residual is None else {"residual": residual}))
    if x.dtype not in _OFFSET_ACC:
        raise TypeError(f"x has dtype {x.dtype}; expected float16, bfloat16, float32 or float64")
    k = len(shape)
    if k > x.dim() or list(x.shape[x.dim() - k:]) != list(shape) or 0 in shape:
        raise ValueError(f"normalized_shape {tuple(shape)} is not the trailing shape of x "
                         f"{tuple(x.shape)} (or has an empty axis)")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{name} has dtype {p.dtype}; expected x's dtype or float32")
        if p is not None and list(p.shape) != list(shape):
            raise ValueError(f"{name} has shape {tuple(p.shape)}; expected {tuple(shape)}")
    if not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if weight_offset and weight is None:
        raise ValueError(f"weight_offset={weight_offset} needs a weight to offset")
    if residual is not None:
        h = residual_dtype or x.dtype
        if h not in (x.dtype, torch.float32) or h != x.dtype and x.dtype == torch.float64:
            raise TypeError(f"residual_dtype is {h}; expected x's dtype, or float32 for 16-bit x")
        if residual.dtype not in (x.dtype, h):
            raise TypeError(f"residual has dtype {residual.dtype}; expected x's dtype or {h}")
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}; expected x's shape "
                             f"{tuple(x.shape)}")


def _norm(x, weight, bias, shape, eps, is_ln, weight_offset, deterministic):
    """y of LayerNorm (``is_ln``) or RMSNorm: the C++ layer's where it takes the call, else the
    Python layer's (``eps`` None: x's machine epsilon); traced as torch operations under
    torch.compile (see compiled_kernels)."""
    compiling = torch.compiler.is_compiling()
    if compiling and not (deterministic or _COMPILED["kernels"]):
        return _traced(x, None, weight, bias, shape, _eps(eps, x), is_ln, weight_offset, None)
    weight, weight_offset = _with_offset(x, weight, weight_offset)
    if not compiling and _native_takes(x, weight, bias):
        y = _NATIVE.norm(x, weight, bias, shape, _eps(eps, x), is_ln, weight_offset,
                         deterministic)
        if y is not None:  # None: x does not end in shape, which the Python layer reports
            return y
    _tensors(x=x, weight=weight, bias=bias)
    if is_ln:
        return _call(_ln_fwd, _LayerNorm, x, weight, bias, _shape(shape), eps, deterministic,
                     weight_offset)
    return _call(_rms_fwd, _RMSNorm, x, weight, _shape(shape), _eps(eps, x), deterministic,
                 weight_offset)


def _add_norm(x, residual, weight, bias, shape, eps, is_ln, weight_offset, residual_dtype,
              deterministic):
    """(y, h) of the fused residual add, as :func:`_norm`."""
    compiling = torch.compiler.is_compiling()
    if compiling and not (deterministic or _COMPILED["kernels"]):
        return _traced(x, residual, weight, bias, shape, _eps(eps, x), is_ln, weight_offset,
                       residual_dtype)
    weight, weight_offset = _with_offset(x, weight, weight_offset)
    if not compiling and _native_takes(x, residual, weight, bias):
        out = _NATIVE.add_norm(x, residual, weight, bias, shape, _eps(eps, x), is_ln,
                               weight_offset, residual_dtype, deterministic)
        if out:  # (): x does not end in shape, which the Python layer reports
            return out
    _tensors(x=x, residual=residual, weight=weight, bias=bias)
    if is_ln:
        return _call(_add_ln_fwd, _AddLayerNorm, x, residual, weight, bias, _shape(shape), eps,
                     residual_dtype, weight_offset, deterministic)
    return _call(_add_rms_fwd, _AddRMSNorm, x, residual, weight, _shape(shape), _eps(eps, x),
                 residual_dtype, weight_offset, deterministic)


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, *, weight_offset: float = 0.0,
               deterministic: bool = False) -> Tensor:
    """``torch.nn.functional.layer_norm`` through cupyln's kernels; differentiable in x, weight
    and bias. Output in x's dtype (float32 weights with 16-bit x are fine). ``weight_offset``:
    scale by ``weight + weight_offset``. Errors as ``cupyln.layer_norm_fwd``."""
    return _norm(x, weight, bias, _shape(normalized_shape), float(eps), True,
                 float(weight_offset), deterministic)


def rms_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None, *, weight_offset: float = 0.0,
             deterministic: bool = False) -> Tensor:
    """``torch.nn.functional.rms_norm`` through cupyln's kernels (``eps=None``: the machine
    epsilon of x's dtype, as torch). ``weight_offset=1.0``: Gemma's ``(1 + weight)``."""
    return _norm(x, weight, None, _shape(normalized_shape), _float(eps), False,
                 float(weight_offset), deterministic)


def _float(eps):
    return None if eps is None else float(eps)


def _eps(eps, x):
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def add_layer_norm(x: Tensor, residual: Tensor, normalized_shape: int | Sequence[int],
                   weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
                   *, residual_dtype: torch.dtype | None = None, weight_offset: float = 0.0,
                   deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` (in ``residual_dtype``, x's by default; torch.float32 keeps the
    residual stream in float32) and ``y = layer_norm(h)`` in one kernel each way. Returns
    ``(y, h)``, both differentiable; x's and residual's gradients come from one backward
    kernel."""
    return _add_norm(x, residual, weight, bias, _shape(normalized_shape), float(eps), True,
                     float(weight_offset), residual_dtype, deterministic)


def add_rms_norm(x: Tensor, residual: Tensor, normalized_shape: int | Sequence[int],
                 weight: Tensor | None = None, eps: float | None = None, *,
                 residual_dtype: torch.dtype | None = None, weight_offset: float = 0.0,
                 deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """The fused residual add of :func:`add_layer_norm`, for RMSNorm. Returns ``(y, h)``."""
    return _add_norm(x, residual, weight, None, _shape(normalized_shape), _float(eps), False,
                     float(weight_offset), residual_dtype, deterministic)


# ----------------------------------------------------------------------------- float8 outputs

_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def _float8_out(t, name):
    """A float8 tensor's memory as the array cupyln writes y_q into: uint8 bits on CUDA, the
    ml_dtypes float8 dtype on the CPU."""
    from ._dtypes import FLOAT8_DTYPES

    if t.is_cuda:
        import numpy as np

        return _cuda_array(t, np.dtype(np.uint8))
    return t.view(torch.uint8).numpy().view(FLOAT8_DTYPES[_FLOAT8[t.dtype]])


def _norm_float8(x, residual, weight, bias, shape, eps, is_ln, weight_offset, y_dtype,
                 y_scale, residual_dtype):
    """(y_q, scale or amax), then h with a residual: the array API's float8 forward into
    tensors allocated by torch, on torch's current stream. No gradient flows through it."""
    if y_dtype not in _FLOAT8:
        raise TypeError(f"y_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                        f"{y_dtype}")
    _tensors(x=x, weight=weight, bias=bias, y_scale=y_scale)
    if residual is not None:
        _tensors(residual=residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, residual, weight, bias)):
        raise RuntimeError("float8 outputs carry no gradient: call under torch.no_grad() or "
                           "with inputs that do not require grad")
    shape = _shape(shape)
    lead = x.shape[: x.dim() - len(shape)]
    new = dict(device=x.device, dtype=torch.float32)
    stats = [torch.empty(lead, **new) for _ in range(2 if is_ln else 1)]
    scale = torch.empty(lead if y_scale is None else y_scale.shape, **new)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=residual_dtype or x.dtype,
                                                  device=x.device)
    out = (_float8_out(y, _FLOAT8[y_dtype]), *map(_array, stats), _array(scale),
           *(() if h is None else (_array(h),)))
    args = [_array(t) for t in (x, weight, bias)]
    kw = dict(residual=_array(residual), residual_dtype=_DTYPES.get(residual_dtype),
              weight_offset=weight_offset, y_dtype=_FLOAT8[y_dtype], y_scale=_array(y_scale))
    if x.is_cuda:
        import cupy

        with cupy.cuda.Device(x.device.index), _stream(x.device), \
                cupy.cuda.using_allocator(_allocator(x.device.index)):
            api._fwd(*args, eps, shape, is_ln, out, None, **kw)
    else:
        api._fwd(*args, eps, shape, is_ln, out, None, **kw)
    return (y, scale) if h is None else (y, scale, h)


def layer_norm_fp8(x: Tensor, normalized_shape: int | Sequence[int],
                   weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
                   *, y_dtype: torch.dtype = torch.float8_e4m3fn, y_scale: Tensor | None = None,
                   residual: Tensor | None = None, residual_dtype: torch.dtype | None = None,
                   weight_offset: float = 0.0) -> tuple[Tensor, ...]:
    """LayerNorm with y quantized to float8 in the same pass: ``(y_q, scale)``, y_q in
    ``y_dtype`` and ``scale`` each row's dequantization scale (float32, x's leading shape; y ~
    y_q * scale, as ``torch._scaled_mm`` takes it); with ``y_scale`` (float32, one element)
    one static scale, and the second output is the amax of y. With ``residual``: the fused
    add, h last. Not differentiable (the call raises where gradients are recorded)."""
    return _norm_float8(x, residual, weight, bias, normalized_shape, float(eps), True,
                        float(weight_offset), y_dtype, y_scale, residual_dtype)


def rms_norm_fp8(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
                 eps: float | None = None, *, y_dtype: torch.dtype = torch.float8_e4m3fn,
                 y_scale: Tensor | None = None, residual: Tensor | None = None,
                 residual_dtype: torch.dtype | None = None,
                 weight_offset: float = 0.0) -> tuple[Tensor, ...]:
    """RMSNorm with y quantized to float8, as :func:`layer_norm_fp8`."""
    return _norm_float8(x, residual, weight, None, normalized_shape, _eps(eps, x), False,
                        float(weight_offset), y_dtype, y_scale, residual_dtype)


# ----------------------------------------------------------------------------- modules


def _qualified_name(self):
    """The name a module prints as: cupyln's, so that a swapped model shows the swap."""
    return f"cupyln.torch.{type(self).__name__}"


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same arguments, parameters and state_dict keys) on cupyln.
    ``deterministic=True``: bitwise repeatable weight and bias gradients."""

    _get_name = _qualified_name

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, deterministic=False):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.deterministic = deterministic

    def forward(self, x):
        return _norm(x, self.weight, self.bias, self.normalized_shape, self.eps, True, 0.0,
                     self.deterministic)

    def forward_fp8(self, x, residual=None, *, y_dtype=torch.float8_e4m3fn, y_scale=None):
        """This norm with y in float8, as :func:`layer_norm_fp8` (under ``torch.no_grad()``);
        ``residual``: of the fused add, h last."""
        return _norm_float8(x, residual, self.weight, self.bias, self.normalized_shape,
                            self.eps, True, 0.0, y_dtype, y_scale,
                            getattr(self, "residual_dtype", None))


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same arguments, parameters and state_dict keys) on cupyln.
    ``weight_offset``: scale by ``weight + weight_offset``, the weight starting at
    ``1 - weight_offset`` (Gemma: ``weight_offset=1.0``, weights from zero)."""

    _get_name = _qualified_name

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, weight_offset=0.0, deterministic=False):
        self.weight_offset = float(weight_offset)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.deterministic = deterministic

    def reset_parameters(self):
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - getattr(self, "weight_offset", 0.0))

    def forward(self, x):
        return _norm(x, self.weight, None, self.normalized_shape, self.eps, False,
                     self.weight_offset, self.deterministic)

    def forward_fp8(self, x, residual=None, *, y_dtype=torch.float8_e4m3fn, y_scale=None):
        """This norm with y in float8, as :func:`rms_norm_fp8` (under ``torch.no_grad()``)."""
        return _norm_float8(x, residual, self.weight, None, self.normalized_shape,
                            _eps(self.eps, x), False, self.weight_offset, y_dtype, y_scale,
                            getattr(self, "residual_dtype", None))


class FusedAddLayerNorm(LayerNorm):
    """:class:`LayerNorm` of ``h = x + residual``: ``forward(x, residual) -> (y, h)``, the add
    fused into the kernels (``residual_dtype=torch.float32``: a float32 residual stream)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, residual_dtype=None, deterministic=False):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         deterministic=deterministic)
        self.residual_dtype = residual_dtype

    def forward(self, x, residual):
        return _add_norm(x, residual, self.weight, self.bias, self.normalized_shape, self.eps,
                         True, 0.0, self.residual_dtype, self.deterministic)


class FusedAddRMSNorm(RMSNorm):
    """:class:`RMSNorm` of ``h = x + residual``: ``forward(x, residual) -> (y, h)``."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, residual_dtype=None, weight_offset=0.0, deterministic=False):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype,
                         weight_offset=weight_offset, deterministic=deterministic)
        self.residual_dtype = residual_dtype

    def forward(self, x, residual):
        return _add_norm(x, residual, self.weight, None, self.normalized_shape, self.eps,
                         False, self.weight_offset, self.residual_dtype, self.deterministic)


def patch(model: torch.nn.Module, *, deterministic: bool = False):
    """Swap, in place, every norm module of ``model`` that cupyln computes the same:
    ``torch.nn.LayerNorm`` / ``RMSNorm`` for this module's classes, and the norm classes of
    other libraries (Hugging Face transformers' Llama, Mistral, Qwen2/3 with q_norm/k_norm,
    Gemma 1/2/3, Phi-3, OLMo/OLMo2, T5, ...) by a subclass that runs cupyln. Each is matched by
    what its forward computes on a probe, not by name; one that matches none of cupyln's
    formulas is left alone. Parameters (the same tensors), state_dict keys and attributes stay;
    works before or after ``.to(device, dtype)`` and on the meta device. Returns what it did:
    ``.swapped`` (name -> what the module now computes) and ``.left`` (name -> why not)."""
    from ._patch import patch as _patch

    return _patch(model, deterministic)


def replace_norms(model: torch.nn.Module, *, deterministic: bool = False) -> torch.nn.Module:
    """:func:`patch` ``model`` and return it."""
    patch(model, deterministic=deterministic)
    return model


__all__ = ["FusedAddLayerNorm", "FusedAddRMSNorm", "LayerNorm", "RMSNorm", "add_layer_norm",
           "add_rms_norm", "compiled_kernels", "layer_norm", "patch", "replace_norms",
           "rms_norm"]
