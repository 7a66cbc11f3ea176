"""One forward and one backward call of a benchmark shape, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight -k regex:norm_ python3 benchmarks/ncu_case.py \\
        [layernorm|rmsnorm] M N DTYPE
"""

import sys

import cupyln
from cupyln.bench import dtype_of, make_inputs

op, M, N, dt = (sys.argv[1:] + ["layernorm", "131072", "4096", "bfloat16"][len(sys.argv) - 1:])
dtype = dtype_of(dt)
x, dy, g, b = make_inputs(int(M), int(N), dtype)
if op == "layernorm":
    y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
    cupyln.layer_norm_bwd(dy, x, g, mean, rstd)
else:
    y, rstd = cupyln.rms_norm_fwd(x, g)
    cupyln.rms_norm_bwd(dy, x, g, rstd)
