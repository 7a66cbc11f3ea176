"""cupyln: LayerNorm and RMSNorm, forward and backward, as CuPy kernels (NumPy reference on CPU)."""

from .api import (
    SUPPORTED_DTYPES,
    layer_norm_bwd,
    layer_norm_fwd,
    rms_norm_bwd,
    rms_norm_fwd,
)

__version__ = "0.1.0"


def warmup(shapes, ops=("layernorm", "rmsnorm"), param_dtype=None):
    """Compile ahead the kernels for ``(M, N, dtype)`` shapes on the current GPU, so that the
    first real call does not pay NVRTC time. Binaries land in CuPy's disk cache
    (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), so later processes load them.
    Returns the number of plans made."""
    from . import _launch

    return _launch.warmup(shapes, ops, param_dtype)

__all__ = [
    "SUPPORTED_DTYPES",
    "layer_norm_bwd",
    "layer_norm_fwd",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "warmup",
]
