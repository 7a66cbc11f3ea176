"""Where cupyln.torch's host time goes: time per call of each layer of a LayerNorm forward at
32x512 float16 (the CuPy call, DLPack views, the custom op, the module), then cProfile's top
functions of the module call.

    python benchmarks/torch_hostprof.py
"""

import cProfile
import pstats

import cupy as cp
import torch

import cupyln
import cupyln.torch as ct
from cupyln.bench import host_us_per_call

x = torch.randn(32, 512, device="cuda", dtype=torch.float16)
w = torch.ones(512, device="cuda", dtype=torch.float16)
b = torch.zeros(512, device="cuda", dtype=torch.float16)
cx, cw, cb = (cp.from_dlpack(t) for t in (x, w, b))
module = ct.LayerNorm(512).to("cuda", torch.float16)
xg = x.clone().requires_grad_()
tmod = torch.nn.LayerNorm(512).to("cuda", torch.float16)
y, mean, rstd = ct._ln_fwd_impl(x, w, b, [512], 1e-5, False)
key = ct._signature(("ln", 1e-5, (512,), 0.0), (x, w, b))
hot = ct._PREPARED[key]
ptrs = tuple(0 if t is None else t.data_ptr() for t in (x, w, b, None, y, mean, rstd, None))
dy = torch.randn_like(x)
ym, ytm = module(xg), tmod(xg)
wg, bg = (t.detach().clone().requires_grad_() for t in (w, b))


class Floor(torch.autograd.Function):
    """The autograd layer alone: torch's outputs, saved tensors, no launch."""

    @staticmethod
    def forward(ctx, x, w, b, shape, eps, det, off):
        out = torch.empty_like(x), x.new_empty(32, dtype=torch.float32), \
            x.new_empty(32, dtype=torch.float32)
        ctx.save_for_backward(x, w, out[1], out[2])
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, dy, _dm, _dr):
        return dy, None, None, None, None, None, None


steps = {
    "cupyln.layer_norm_fwd (CuPy arrays)": lambda: cupyln.layer_norm_fwd(cx, cw, cb),
    "cupy.from_dlpack x3": lambda: [cp.from_dlpack(t) for t in (x, w, b)],
    "torch.empty_like + 2 empty": lambda: (torch.empty_like(x), torch.empty(32, device="cuda"),
                                           torch.empty(32, device="cuda")),
    "torch.ops.cupyln.layer_norm_fwd": lambda: torch.ops.cupyln.layer_norm_fwd(x, w, b, [512],
                                                                               1e-5, False, 0.0),
    "ct._array(x)": lambda: ct._array(x),
    "x.device": lambda: x.device,
    "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(x.device),
    "ct._stream(dev)": lambda: ct._stream(x.device),
    "ct._raw_stream(dev)": lambda: ct._raw_stream(0),
    "ct._signature (3 tensors)": lambda: ct._signature(("ln", 1e-5, (512,), 0.0), (x, w, b)),
    "ct._ln_fwd_fake": lambda: ct._ln_fwd_fake(x, w, b, [512], 1e-5, False),
    "ct._ln_fwd_impl": lambda: ct._ln_fwd_impl(x, w, b, [512], 1e-5, False),
    "ct._LayerNorm.apply (no grad)": lambda: ct._LayerNorm.apply(x, w, b, [512], 1e-5, False,
                                                                 0.0),
    "ct.layer_norm (no grad)": lambda: ct.layer_norm(x, (512,), w, b),
    "module(x) (grad)": lambda: module(xg),
    "torch.nn module(x) (grad)": lambda: tmod(xg),
    "Floor.apply (grad, no launch)": lambda: Floor.apply(xg, w, b, [512], 1e-5, False, 0.0),
    "Floor, apply's C++ part": lambda: super(torch.autograd.Function, Floor).apply(
        xg, w, b, [512], 1e-5, False, 0.0),
    "ct._launched (prepared, 3 outputs given)": lambda: ct._launched(
        key, (x, w, b, None, y, mean, rstd, None)),
    "hot.launch_at": lambda: hot.launch_at(0, ptrs, 0),
    "data_ptr x7": lambda: tuple(0 if t is None else t.data_ptr()
                                 for t in (x, w, b, None, y, mean, rstd, None)),
    "cupy getDevice": lambda: cp.cuda.runtime.getDevice(),
    "torch.compiler.is_compiling": torch.compiler.is_compiling,
    "ct._shape((512,))": lambda: ct._shape((512,)),
    "ct._ln_bwd_impl": lambda: ct._ln_bwd_impl(dy, x, w, mean, rstd, True, True, True, False),
    "autograd.grad module": lambda: torch.autograd.grad(ym, (xg, *module.parameters()), dy,
                                                        retain_graph=True),
    "autograd.grad torch.nn": lambda: torch.autograd.grad(ytm, (xg, *tmod.parameters()), dy,
                                                          retain_graph=True),
    "torch.nn.functional.layer_norm": lambda: torch.nn.functional.layer_norm(x, (512,), w, b),
}
for name, fn in steps.items():
    print(f"{name:<40} {host_us_per_call(fn, calls=500):8.1f} us")
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    module(xg)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    torch.autograd.grad(ym, (xg, *module.parameters()), dy, retain_graph=True)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
