"""cupyln from PyTorch: differentiable ``layer_norm`` / ``rms_norm`` and drop-in modules.

    import cupyln.torch as ct
    y = ct.layer_norm(x, (1024,), weight, bias)          # torch.nn.functional's signature
    norm = ct.LayerNorm(1024)                             # torch.nn.LayerNorm's arguments
    ct.replace_norms(model)                               # swap a model's norms in place

Under ``torch.compile`` the calls are ``torch.library`` custom ops (``cupyln::layer_norm_fwd``
and friends) with fake implementations and registered autograd, so ``fullgraph=True`` traces
them; in eager mode the same functions run as a ``torch.autograd.Function``, without the custom
op's dispatch cost. CUDA tensors go to the kernels without a copy (their memory wrapped as CuPy
arrays, bfloat16 included), on torch's current stream of the tensor's device, into outputs
allocated by torch (its caching allocator holds them); the forward's mean/rstd are saved for
the backward. CPU tensors run cupyln's NumPy path (the float64 reference, rounded to
the tensor's dtype): the same results, for tests and CPU-only machines, not for speed.

The backward is deterministic when the module or call asks for it (``deterministic=True``) or
``torch.are_deterministic_algorithms_enabled()``; otherwise dgamma/dbeta may differ in the last
bits between runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def _stream(device):
    """torch's current stream of ``device`` as a CuPy stream (one object per stream)."""
    import cupy

    ptr = torch.cuda.current_stream(device).cuda_stream
    s = _STREAMS.get((device.index, ptr))
    if s is None:
        s = _STREAMS[device.index, ptr] = cupy.cuda.ExternalStream(ptr, device.index)
    return s


def _run(device, fn, *args, **kw):
    """``fn`` of the arrays of the tensors ``args`` and ``kw["out"]``, on torch's current stream
    of a CUDA ``device``."""
    if device.type != "cuda":
        return _call(fn, args, kw)
    import cupy

    with cupy.cuda.Device(device.index), _stream(device):
        return _call(fn, args, kw)


def _call(fn, args, kw):
    out = kw.pop("out")
    return fn(*map(_array, args), out=tuple(map(_array, out)), **kw)


# ----------------------------------------------------------------------------- custom ops
#
# The forwards take ``deterministic`` only to hand it to their backward (saved in the autograd
# context). The backwards return 0-element placeholders for gradients not asked for: custom ops
# return tensors, not None.


def _lead(x, normalized_shape):
    return x.shape[: x.dim() - len(normalized_shape)]


def _like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _ln_fwd_impl(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                 normalized_shape: list[int], eps: float,
                 deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    y, mean, rstd = _ln_fwd_fake(x, weight, bias, normalized_shape, eps, deterministic)
    _run(x.device, api.layer_norm_fwd, x, weight, bias, eps=eps,
         normalized_shape=tuple(normalized_shape), out=(y, mean, rstd))
    return y, mean, rstd


def _ln_fwd_fake(x, weight, bias, normalized_shape, eps, deterministic):
    lead = _lead(x, normalized_shape)
    return _like(x), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32)


def _rms_fwd_impl(x: Tensor, weight: Tensor | None, normalized_shape: list[int], eps: float,
                  deterministic: bool) -> tuple[Tensor, Tensor]:
    y, rstd = _rms_fwd_fake(x, weight, normalized_shape, eps, deterministic)
    _run(x.device, api.rms_norm_fwd, x, weight, eps=eps,
         normalized_shape=tuple(normalized_shape), out=(y, rstd))
    return y, rstd


def _rms_fwd_fake(x, weight, normalized_shape, eps, deterministic):
    return _like(x), x.new_empty(_lead(x, normalized_shape), dtype=torch.float32)


def _grads(x, weight, stats, need):
    """Gradient tensors to fill: dx like x, dgamma/dbeta in weight's dtype (x's without a
    weight) and the normalized shape (x's axes after the statistics'); None where not needed."""
    pdt = x.dtype if weight is None else weight.dtype
    norm = x.shape[stats.dim():]
    return (_like(x) if need[0] else None,
            *(x.new_empty(norm, dtype=pdt) if n else None for n in need[1:]))


def _filled(grads, x):
    return tuple(x.new_empty(0) if g is None else g for g in grads)


def _ln_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                 need_dx: bool, need_dweight: bool, need_dbias: bool,
                 deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    need = (need_dx, need_dweight and weight is not None, need_dbias)
    grads = _grads(x, weight, mean, need)
    if any(need):
        _run(x.device, api.layer_norm_bwd, dy, x, weight, mean, rstd, need_dx=need[0],
             need_dgamma=need[1], need_dbeta=need[2], deterministic=deterministic, out=grads)
    return _filled(grads, x)


def _ln_bwd_fake(dy, x, weight, mean, rstd, need_dx, need_dweight, need_dbias, deterministic):
    return _filled(_grads(x, weight, mean, (need_dx, need_dweight and weight is not None,
                                            need_dbias)), x)


def _rms_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, need_dx: bool,
                  need_dweight: bool, deterministic: bool) -> tuple[Tensor, Tensor]:
    need = (need_dx, need_dweight and weight is not None)
    grads = _grads(x, weight, rstd, need)
    if any(need):
        _run(x.device, api.rms_norm_bwd, dy, x, weight, rstd, need_dx=need[0],
             need_dgamma=need[1], deterministic=deterministic, out=grads)
    return _filled(grads, x)


def _rms_bwd_fake(dy, x, weight, rstd, need_dx, need_dweight, deterministic):
    return _filled(_grads(x, weight, rstd, (need_dx, need_dweight and weight is not None)), x)


def _op(name, impl, fake):
    op = torch.library.custom_op(f"cupyln::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


_ln_fwd = _op("layer_norm_fwd", _ln_fwd_impl, _ln_fwd_fake)
_rms_fwd = _op("rms_norm_fwd", _rms_fwd_impl, _rms_fwd_fake)
_ln_bwd = _op("layer_norm_bwd", _ln_bwd_impl, _ln_bwd_fake)
_rms_bwd = _op("rms_norm_bwd", _rms_bwd_impl, _rms_bwd_fake)


# ----------------------------------------------------------------------------- autograd


def _eager(*tensors):
    """Whether real tensors run (no tracing: a traced backward must call the custom op)."""
    return not torch.compiler.is_compiling() and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _deterministic(ctx):
    return ctx.deterministic or torch.are_deterministic_algorithms_enabled()


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _, _, deterministic = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.has_bias, ctx.deterministic = bias is not None, deterministic


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_w, need_b = need[1] and weight is not None, need[2] and ctx.has_bias
    bwd = _ln_bwd_impl if _eager(dy, x) else _ln_bwd
    dx, dw, db = bwd(dy, x, weight, mean, rstd, need[0], need_w, need_b, _deterministic(ctx))
    return (dx if need[0] else None, dw if need_w else None, db if need_b else None,
            None, None, None)


def _rms_setup(ctx, inputs, output):
    x, weight, _, _, deterministic = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.deterministic = deterministic


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_w = need[1] and weight is not None
    bwd = _rms_bwd_impl if _eager(dy, x) else _rms_bwd
    dx, dw = bwd(dy, x, weight, rstd, need[0], need_w, _deterministic(ctx))
    return dx if need[0] else None, dw if need_w else None, None, None, None


_ln_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)
_rms_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


class _LayerNorm(torch.autograd.Function):
    """The eager path: the same forward, setup and backward without the custom op's dispatch
    (50 us per call on the H200 host). forward takes ctx itself: with a separate setup_context
    torch binds the arguments through inspect.signature on every call."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _ln_fwd_impl(*inputs)
        _ln_setup(ctx, inputs, out)
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    backward = staticmethod(_ln_backward)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        out = _rms_fwd_impl(*inputs)
        _rms_setup(ctx, inputs, out)
        ctx.mark_non_differentiable(out[1])
        return out

    backward = staticmethod(_rms_backward)


# ----------------------------------------------------------------------------- functions


def _shape(normalized_shape):
    """normalized_shape as the ops' list of ints, checked as the array API checks it."""
    return list(api._shape_arg(normalized_shape))


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, *,
               deterministic: bool = False) -> Tensor:
    """``torch.nn.functional.layer_norm`` through cupyln's kernels; differentiable in x, weight
    and bias. Output in x's dtype (float32 weights with 16-bit x are fine). Errors as
    ``cupyln.layer_norm_fwd``."""
    fn = _ln_fwd if torch.compiler.is_compiling() else _LayerNorm.apply
    return fn(x, weight, bias, _shape(normalized_shape), float(eps), deterministic)[0]


def rms_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None, *, deterministic: bool = False) -> Tensor:
    """``torch.nn.functional.rms_norm`` through cupyln's kernels (``eps=None``: the machine
    epsilon of x's dtype, as torch)."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    fn = _rms_fwd if torch.compiler.is_compiling() else _RMSNorm.apply
    return fn(x, weight, _shape(normalized_shape), float(eps), deterministic)[0]


# ----------------------------------------------------------------------------- modules


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same arguments, parameters and state_dict keys) on cupyln.
    ``deterministic=True``: bitwise repeatable weight and bias gradients."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, deterministic=False):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.deterministic = deterministic

    def forward(self, x):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                          deterministic=self.deterministic)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same arguments, parameters and state_dict keys) on cupyln."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, deterministic=False):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.deterministic = deterministic

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps,
                        deterministic=self.deterministic)


def replace_norms(model: torch.nn.Module, *, deterministic: bool = False) -> torch.nn.Module:
    """Swap every ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` of ``model`` for cupyln's, in
    place, keeping their parameters (the same tensors). Returns ``model``."""
    for name, child in list(model.named_children()):
        if type(child) is torch.nn.LayerNorm:
            new = LayerNorm.__new__(LayerNorm)
        elif type(child) is torch.nn.RMSNorm:
            new = RMSNorm.__new__(RMSNorm)
        else:
            replace_norms(child, deterministic=deterministic)
            continue
        new.__dict__.update(child.__dict__)
        new.deterministic = deterministic
        setattr(model, name, new)
    return model


__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "replace_norms", "rms_norm"]
