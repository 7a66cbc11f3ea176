"""Copies of the bytes one pass moves, timed as the benchmark times cupyln (device time).

    python benchmarks/tools/copy_floor.py [op:M:N:dtype ...]

The benchmark's ratios are against the copy of a 4 GiB buffer; copies of fewer bytes run at a
lower rate (benchmarks/NOTES.md). So for each shape (default: those of the benchmark
file whose forward moves at least 256 MiB) this times, at that pass's size:
- fwd: cudaMemcpyAsync of M*N*s bytes, and a one-shot copy kernel (blocks of 128 threads with
  four 16-byte loads each, then four stores: the direct forward's access pattern without its
  arithmetic);
- bwd: a one-shot kernel that reads two arrays of M*N*s bytes and writes one (the backward's
  x, dy -> dx traffic), same geometry.
Each as µs, GB/s and % of the 4 GiB copy of the same run: what any kernel of that pattern
reaches at that size.
"""

import sys

import cupy as cp

from cupyln.bench import copy_bandwidth, device_us, dtype_of, load_shapes, parse_shapes

_SRC = r"""
template <int R>
__global__ void __launch_bounds__(128) oneshot(const uint4* __restrict__ a,
                                               const uint4* __restrict__ b,
                                               uint4* __restrict__ y) {
  const long long i = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = a[i + k * blockDim.x];
  if (R == 2) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint4 w = b[i + k * blockDim.x];
      v[k].x ^= w.x; v[k].y ^= w.y; v[k].z ^= w.z; v[k].w ^= w.w;
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) y[i + k * blockDim.x] = v[k];
}
"""
_NAMES = ("oneshot<1>", "oneshot<2>")
_CHUNK = 128 * 4 * 16  # bytes per block


def _bytes(M, N, dt):
    """Bytes of one M x N array of ``dt`` (a dtype name, as in the shapes file)."""
    return M * N * dtype_of(dt).itemsize


def _default_shapes():
    return [(op, M, N, dt) for op, M, N, dt in load_shapes() if 2 * _bytes(M, N, dt) >= 256 << 20]


def _floor(kernels, copy, M, N, dt):
    k1, k2 = kernels
    nb = _bytes(M, N, dt)
    nb_k = -(-nb // _CHUNK) * _CHUNK  # whole blocks
    a, b, y = (cp.ones(nb_k // 4, cp.uint32) for _ in range(3))
    grid = (nb_k // _CHUNK,)
    runs = [
        ("fwd memcpy", 2, lambda: y.data.copy_from_device_async(a.data, nb)),
        ("fwd one-shot kernel", 2, lambda: k1(grid, (128,), (a, b, y))),
        ("bwd one-shot kernel (read 2, write 1)", 3, lambda: k2(grid, (128,), (a, b, y))),
    ]
    for label, arrays, fn in runs:
        us = device_us(fn)
        gbs = arrays * nb / us / 1e3
        print(f"{M}x{N} {dt} ({nb >> 20} MiB per array) {label}: {us:.1f} us "
              f"{gbs:.0f} GB/s {100 * gbs / copy:.1f}%", flush=True)


def main(shapes):
    mod = cp.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=list(_NAMES))
    kernels = [mod.get_function(n) for n in _NAMES]
    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s (4 GiB buffer)", flush=True)
    seen = set()
    for _op, M, N, dt in shapes:
        if (M * N, dt) not in seen:  # the same bytes as a shape above: skipped
            seen.add((M * N, dt))
            _floor(kernels, copy, M, N, dt)
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(parse_shapes(sys.argv[1:]) or _default_shapes())
