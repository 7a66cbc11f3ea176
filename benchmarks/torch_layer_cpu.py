"""cupyln.torch's own host time, no GPU needed: a LayerNorm module's forward at 32x512 on CPU
tensors with the launch left out (``_launched`` answers True, so neither a kernel nor the NumPy
path runs), with gradients recorded (through apply's C++ part, and through
``autograd.Function.apply`` for comparison) and under ``no_grad``, and its backward through
``torch.autograd.grad``; torch.nn.LayerNorm's whole CPU passes beside them. Median and range of
7 rounds of 5000 calls.

    python benchmarks/torch_layer_cpu.py
"""

import statistics
import timeit

import torch

import cupyln.torch as ct

ct._launched = lambda key, tensors: True  # the layer alone
x = torch.randn(32, 512, requires_grad=True)
module, reference = ct.LayerNorm(512), torch.nn.LayerNorm(512)
recorded = ct._LayerNorm.recorded


def through(apply):
    ct._LayerNorm.recorded = apply
    return timeit.timeit(lambda: module(x), number=5000) / 5000


def without_grad():
    with torch.no_grad():
        return timeit.timeit(lambda: module(x), number=5000) / 5000


def backward(norm):
    y = norm(x)
    inputs, dy = (x, *norm.parameters()), torch.randn_like(y)
    return timeit.timeit(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True),
                         number=5000) / 5000


rows = {"grad, apply's C++ part": lambda: through(recorded),
        "grad, Function.apply": lambda: through(lambda *a: ct._LayerNorm.apply(*a)),
        "no_grad": without_grad,
        "torch.nn.LayerNorm (with compute)":
            lambda: timeit.timeit(lambda: reference(x), number=5000) / 5000,
        "backward": lambda: backward(module),
        "torch.nn.LayerNorm backward (with compute)": lambda: backward(reference)}
times = {name: [] for name in rows}
for _ in range(7):
    for name, run in rows.items():
        times[name].append(run() * 1e6)
ct._LayerNorm.recorded = recorded
for name, ts in times.items():
    print(f"{name:44s} {statistics.median(ts):6.1f} us  ({min(ts):.1f}-{max(ts):.1f})")
