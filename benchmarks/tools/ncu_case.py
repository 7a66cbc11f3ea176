"""One forward and one backward call of a benchmark shape, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight -k regex:norm_ \\
        python3 benchmarks/tools/ncu_case.py [layernorm|rmsnorm|layernorm_add|rmsnorm_add] M N DTYPE

The ``_add`` ops run the fused residual add (its backward with dresidual), as the benchmark's
rows of that name.
"""

import sys

import cupyln
from cupyln.bench import dtype_of, make_inputs

op, M, N, dt = (sys.argv[1:] + ["layernorm", "131072", "4096", "bfloat16"][len(sys.argv) - 1:])
dtype = dtype_of(dt)
x, dy, g, b = make_inputs(int(M), int(N), dtype)
add = op.endswith("_add")
fwd_kw = {"residual": x[::-1].copy()} if add else {}  # the benchmark's: other values
bwd_kw = {"dresidual": dy[::-1].copy()} if add else {}
if op.startswith("layernorm"):
    y, mean, rstd, *h = cupyln.layer_norm_fwd(x, g, b, **fwd_kw)
    cupyln.layer_norm_bwd(dy, h[0] if add else x, g, mean, rstd, **bwd_kw)
else:
    y, rstd, *h = cupyln.rms_norm_fwd(x, g, **fwd_kw)
    cupyln.rms_norm_bwd(dy, h[0] if add else x, g, rstd, **bwd_kw)
