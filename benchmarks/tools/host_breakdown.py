"""Host time per call of cupyln.torch's modules against the torch path each replaces, side by
side in one process: LayerNorm, RMSNorm and the fused residual add (``x + r`` then torch's
norm), under ``no_grad``, recording the graph, and forward + backward; cupyln's C++ layer and
its Python layer. 32×512 float16 by default, medians of 5 rounds in which the three take
turns. At a model's shape (``--shape 8192x768 --dtype bfloat16``) a call's time is the host's
where the host takes longer than the device, as in a host-bound training step.

    python benchmarks/tools/host_breakdown.py [--shape 32x512] [--dtype float16]
"""

import argparse
import time

import torch

import cupyln.torch as ct

DEV = "cuda"


def us(fn, calls=1000, warm=100):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


class TorchAdd(torch.nn.Module):
    """``h = x + r`` and torch's norm of h: what the fused-add modules replace."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, r):
        h = x + r
        return self.norm(h), h


def modes(m, add, x, r, dy):
    args = (x, r) if add else (x,)

    def nograd():
        with torch.no_grad():
            return m(*args)

    def backward():
        out = m(*args)
        if add:
            torch.autograd.backward(out, (dy, dy))
        else:
            out.backward(dy)

    return {"no_grad": nograd, "forward": lambda: m(*args), "forward+backward": backward}


def python_layer(fn, native):
    def f():
        ct._NATIVE = None
        try:
            return fn()
        finally:
            ct._NATIVE = native
    return f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="32x512", help="MxN (default 32x512)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    a = ap.parse_args(argv)
    M, N = (int(v) for v in a.shape.lower().split("x"))
    dtype = getattr(torch, a.dtype)
    native = ct._native_wait()
    print(f"C++ layer: {'built' if native else ct._NATIVE_BUILD.get('error')}; {M}x{N} {a.dtype}")
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEV, dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    dy = torch.randn_like(x)
    mods = {"LayerNorm": (torch.nn.LayerNorm(N), ct.LayerNorm(N)),
            "RMSNorm": (torch.nn.RMSNorm(N), ct.RMSNorm(N)),
            "add + LayerNorm": (TorchAdd(torch.nn.LayerNorm(N)), ct.FusedAddLayerNorm(N)),
            "add + RMSNorm": (TorchAdd(torch.nn.RMSNorm(N)), ct.FusedAddRMSNorm(N))}
    print(f"{'module':<16} {'mode':<17} {'torch':>7} {'cupyln':>7} {'python':>7}  (µs)")
    for name, (tm, cm) in mods.items():
        add = name.startswith("add")
        tmodes = modes(tm.to(DEV, dtype), add, x, r, dy)
        cmodes = modes(cm.to(DEV, dtype), add, x, r, dy)
        for mode in tmodes:
            t, c, p = [], [], []
            for _ in range(5):
                t.append(us(tmodes[mode]))
                c.append(us(cmodes[mode]))
                p.append(us(python_layer(cmodes[mode], native)))
            t, c, p = (sorted(v)[2] for v in (t, c, p))
            print(f"{name:<16} {mode:<17} {t:7.1f} {c:7.1f} {p:7.1f}  "
                  f"({c / t:.2f}x, {p / t:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
