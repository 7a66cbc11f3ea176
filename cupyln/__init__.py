"""cupyln: LayerNorm and RMSNorm, forward and backward, as CuPy kernels (NumPy reference on CPU)."""

from .api import (
    SUPPORTED_DTYPES,
    layer_norm_bwd,
    layer_norm_fwd,
    rms_norm_bwd,
    rms_norm_fwd,
)

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "layer_norm_bwd",
    "layer_norm_fwd",
    "rms_norm_bwd",
    "rms_norm_fwd",
]
