"""Swapping a model's norm modules for cupyln's (``cupyln.torch.patch``): torch.nn.LayerNorm and
RMSNorm, and the norm classes of other libraries (Hugging Face transformers: Llama, Mistral,
Qwen2/3, Gemma 1/2/3, Phi-3, OLMo/OLMo2, T5, ...), each matched by what it computes.

A module is a candidate where its class name says LayerNorm or RMSNorm and it holds no other
module. It is swapped only where one of cupyln's formulas gives what its own forward gives on a
probe: its forward run (``torch.func.functional_call``, on the CPU, the module untouched) with
random parameters on random rows at two scales (the second near sqrt(eps), where eps shows),
against cupyln's, within a few roundings of the parameters' dtype. The swap changes the module's
class to a subclass whose forward runs cupyln where x and the parameters share a dtype (the
output dtype is then x's, as the module's own) and the module's own forward elsewhere; the
parameters, their state_dict keys and every attribute stay. A candidate that matches no formula
is left alone and reported.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import torch as ct

EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")


class Formula(NamedTuple):
    """What a norm module computes, in cupyln's terms."""

    is_ln: bool  # LayerNorm (else RMSNorm)
    offset: float  # scale by weight + offset (Gemma: 1)
    eps: str | float  # the attribute that holds eps, or the constant the forward uses

    def describe(self):
        scale = "weight + 1" if self.offset else "weight"
        return f"{'LayerNorm' if self.is_ln else 'RMSNorm'} ({scale})"


FORMULAS = ([Formula(False, off, a) for off in (0.0, 1.0) for a in EPS_ATTRS]
            + [Formula(True, 0.0, a) for a in EPS_ATTRS] + [Formula(True, 0.0, 1e-5)])


class Patched(NamedTuple):
    """What :func:`patch` did: the modules it swapped (name -> what they now compute) and the
    norm-like modules it left alone (name -> why)."""

    swapped: dict[str, str]
    left: dict[str, str]


def patch(model: torch.nn.Module, deterministic: bool = False) -> Patched:
    """Swap every norm module of ``model`` that cupyln computes the same, in place."""
    swapped, left = {}, {}
    for name, parent, child in list(_modules(model)):
        if type(child) in (torch.nn.LayerNorm, torch.nn.RMSNorm):
            setattr(parent, name.rsplit(".", 1)[-1], _torch_nn(child, deterministic))
            swapped[name] = type(child).__name__
        elif _candidate(child):
            found = _formula(child)
            if isinstance(found, Formula):
                _swap(child, found, deterministic)
                swapped[name] = found.describe()
            else:
                left[name] = found
    return Patched(swapped, left)


def _modules(model):
    """(qualified name, parent, module) of every module below ``model``."""
    for pname, parent in model.named_modules():
        for cname, child in parent.named_children():
            yield (f"{pname}.{cname}" if pname else cname), parent, child


def _torch_nn(child, deterministic):
    """torch.nn's LayerNorm / RMSNorm as cupyln's class, sharing its parameters."""
    cls = ct.LayerNorm if isinstance(child, torch.nn.LayerNorm) else ct.RMSNorm
    new = cls.__new__(cls)
    new.__dict__.update(child.__dict__)
    new.deterministic = deterministic
    if cls is ct.RMSNorm:
        new.weight_offset = 0.0
    return new


def _candidate(m):
    name = type(m).__name__.lower()
    return (("layernorm" in name or "rmsnorm" in name) and not getattr(m, "_cupyln", None)
            and not isinstance(m, (ct.LayerNorm, ct.RMSNorm)) and not any(m.children()))


def _size(m):
    """The normalized length: the weight's, else a normalized_shape attribute's; None."""
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        return w.numel()
    shape = getattr(m, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int):
        return shape[0]
    return None


def _formula(m):
    """The first formula the probe matches, or why none can be."""
    N = _size(m)
    params = dict(m.named_parameters(recurse=False))
    if N is None:
        return "no 1-d weight or normalized_shape to size the rows by"
    if any(True for _ in m.named_buffers(recurse=False)):
        return "holds buffers"
    if set(params) - {"weight", "bias"} or any(p.shape != (N,) for p in params.values()):
        return "parameters other than a weight and a bias of the row's length"
    dtype = next(iter(params.values())).dtype if params else torch.float32
    if dtype not in ct._DTYPES:
        return f"parameters of dtype {dtype}, which cupyln does not take"
    for f in FORMULAS:
        if ("bias" in params and not f.is_ln) or (f.offset and "weight" not in params):
            continue
        eps = getattr(m, f.eps, None) if isinstance(f.eps, str) else f.eps
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0 and \
                _probe(m, f, float(eps), N, dtype, params):
            return f
    return "computes differently from cupyln's LayerNorm and RMSNorm (probe)"


def _probe(m, f, eps, N, dtype, params):
    """Whether ``m``'s forward and formula ``f`` agree on random rows and parameters."""
    g = torch.Generator().manual_seed(0)
    probe = {k: ((1 if k == "weight" else 0) + 0.4 * torch.randn(N, generator=g)).to(dtype)
             for k in params}
    tol = max(8 * torch.finfo(dtype).eps, 1e-5)
    for scale in (1.0, math.sqrt(eps) or 1e-3):
        x = (scale * (torch.randn(4, N, generator=g) + 0.5)).to(dtype)
        try:
            with torch.no_grad():
                want = torch.func.functional_call(m, probe, (x,))
                got = ct._norm(x, probe.get("weight"), probe.get("bias"), (N,), eps, f.is_ln,
                               f.offset, False)
        except Exception:
            return False
        if not isinstance(want, torch.Tensor) or want.dtype != got.dtype or \
                want.shape != got.shape:
            return False
        err = (want.double() - got.double()).abs().max() / want.double().abs().max()
        if not err <= tol:
            return False
    return True


_CLASSES = {}


def _patched_class(cls):
    """``cls`` with cupyln's forward where it applies (its own forward elsewhere)."""
    new = _CLASSES.get(cls)
    if new is not None:
        return new

    def forward(self, x, *args, **kwargs):
        f, det, shape = self._cupyln
        w, b = getattr(self, "weight", None), getattr(self, "bias", None)
        if (args or kwargs or type(x) not in ct._PLAIN or x.device.type not in ("cpu", "cuda")
                or x.dtype not in ct._DTYPES or any(p is not None and p.dtype != x.dtype
                                                    for p in (w, b))):
            return cls.forward(self, x, *args, **kwargs)
        eps = getattr(self, f.eps) if isinstance(f.eps, str) else f.eps
        return ct._norm(x, w, b, shape, float(eps), f.is_ln, f.offset, det)

    def _get_name(self):
        return f"cupyln.torch({cls.__name__})"

    new = _CLASSES[cls] = type(cls.__name__, (cls,), {
        "forward": forward, "_get_name": _get_name, "__module__": cls.__module__,
        "__doc__": f"{cls.__name__} on cupyln's kernels (cupyln.torch.patch)."})
    return new


def _swap(m, f, deterministic):
    m._cupyln = (f, deterministic, (_size(m),))
    m.__class__ = _patched_class(type(m))
