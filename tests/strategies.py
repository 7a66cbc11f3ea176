"""Shared hypothesis strategies: shapes that mix boundary sizes with small ones, and values."""

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

BOUNDARY_N = (1, 31, 32, 33, 127, 129, 255, 257, 760, 1025, 2001, 4005, 8117)
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
          np.dtype(np.float64))
_WIDTH = {2: 16, 4: 32, 8: 64}


def sizes_n():
    return st.one_of(st.sampled_from(BOUNDARY_N), st.integers(1, 48))


@st.composite
def shapes(draw, max_elems=40_000, max_m=9):
    """(M, N): M from 0, N from the boundary list or small; M * N bounded."""
    n = draw(sizes_n())
    m = draw(st.integers(0, max(0, min(max_m, max_elems // n))))
    return m, n


@st.composite
def values(draw, shape, dtype=np.float64, scale=None, offset=None):
    """Array of `shape`: a seeded normal base (so rows are generic) plus a hypothesis array with
    the dtype's element width (so hypothesis explores and shrinks structure), cast to dtype."""
    dtype = np.dtype(dtype)
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.floats(0.1, 4.0)) if scale is None else scale
    offset = draw(st.floats(-3.0, 3.0)) if offset is None else offset
    base = np.random.default_rng(seed).standard_normal(shape) * scale + offset
    width = _WIDTH.get(dtype.itemsize, 64) if dtype.kind == "f" else 64
    elems = st.floats(-4.0, 4.0, width=width if dtype != DTYPES[1] else 32)
    extra = draw(hnp.arrays(np.float64 if width == 64 else np.float32, shape, elements=elems,
                            fill=st.just(0.0)))
    return (base + extra).astype(dtype)
