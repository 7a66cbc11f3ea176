"""The dtype tables: what the API accepts, the C type of each dtype in the kernels, the dtype
the kernels accumulate in, and the dtype of the parameter gradients. Imports nothing of cupyln."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

#: float8 dtypes y may be quantized to, by name (CuPy holds them as uint8: the same bits)
FLOAT8_DTYPES = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
                 "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}

#: dtypes accepted for x and dy
SUPPORTED_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
SUPPORTED_NAMES = "float16, bfloat16, float32 or float64"

#: C storage type of each dtype in cupyln/kernels/ (the one table)
CTYPES = {FLOAT16: "cl_half", BFLOAT16: "cl_bf16", FLOAT32: "float", FLOAT64: "double"}
#: dtype the kernels compute in, for each data dtype
ACC_DTYPES = {FLOAT16: FLOAT32, BFLOAT16: FLOAT32, FLOAT32: FLOAT32, FLOAT64: FLOAT64}
#: (x dtype, gamma dtype) pairs the kernels are built for: gamma like x, or float32 for 16-bit
#: rows; float64 rows widen float32 parameters on the host (kernel_param_dtype)
PARAM_PAIRS = tuple((t, w) for t in SUPPORTED_DTYPES
                    for w in dict.fromkeys((t, FLOAT32 if t.itemsize == 2 else t)))


def param_dtype(gamma, x_dtype):
    """dtype of dgamma/dbeta: gamma's, or x's when there is no gamma."""
    return x_dtype if gamma is None else gamma.dtype


def kernel_param_dtype(x_dtype, w_dtype):
    """The gamma dtype the kernels take for parameters of ``w_dtype``."""
    return w_dtype if (x_dtype, w_dtype) in PARAM_PAIRS else x_dtype


#: elements of a 16-byte vector, the width aligned rows take
VEC = {FLOAT16: 8, BFLOAT16: 8, FLOAT32: 4, FLOAT64: 2}


def vec_options(dtype, narrow=True):
    """Vector widths (elements) the kernels are built for, widest first: 16 bytes, and for rows
    it does not divide, with ``narrow`` every narrower width (the plain backward's: its peeled
    rows need many rows), else one element (the forward peels rows off the vector wherever
    x's and y's rows start alike; the fused add's backward)."""
    v, out = VEC[dtype], []
    while v >= 1:
        out.append(v)
        v //= 2
    return out if narrow else list(dict.fromkeys((out[0], 1)))


def tuned(dtype, vec):
    """Whether rows of ``dtype`` in vectors of ``vec`` take the tuned kernel families (clusters,
    shared-memory rows, the row kernel, staging, peeled rows, float8 with its norm fixed):
    16-byte vectors of the dtypes models train in; float64, a checking dtype, takes the
    general ones (and parts over the grid: Spec.in_parts)."""
    return vec == VEC[dtype] and dtype != FLOAT64


def h_dtypes(x_dtype):
    """dtypes of the fused residual add's h for rows of ``x_dtype``: x's, or float32 for 16-bit
    rows (a residual stream kept in float32)."""
    return (x_dtype, FLOAT32) if x_dtype.itemsize == 2 else (x_dtype,)
