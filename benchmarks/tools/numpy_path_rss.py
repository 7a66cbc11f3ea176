"""Peak memory of the NumPy path on a 512 MiB float16 input (65536 x 4096):

    /usr/bin/time -v python benchmarks/tools/numpy_path_rss.py fwd   # or bwd
"""

import sys

import numpy as np

import cupyln

M, N = 65536, 4096  # 512 MiB of float16
rng = np.random.default_rng(0)
x = np.empty((M, N), np.float16)
for i in range(0, M, 4096):  # filled in blocks: the input alone, no float32 copy of it
    x[i:i + 4096] = rng.standard_normal((4096, N), dtype=np.float32)
g, b = np.ones(N, np.float16), np.zeros(N, np.float16)
if sys.argv[1] == "fwd":
    y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
else:
    dy = x[::-1].copy()
    mean, rstd = np.zeros(M, np.float32), np.ones(M, np.float32)
    dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd)
print(sys.argv[1], "done")
