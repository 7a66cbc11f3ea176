"""cupyln: LayerNorm and RMSNorm, forward and backward, as CuPy kernels (NumPy reference on CPU).

The contract is ``docs/api.md``, shipped in the package (``cupyln docs`` prints it);
``help(cupyln.layer_norm_fwd)`` and the other functions carry their part of it. ``cupyln.check``
holds the tolerances and the comparisons with the float64 reference; ``cupyln.torch`` the PyTorch
functions and modules.
"""

from __future__ import annotations

from ._config import Config
from ._dtypes import SUPPORTED_DTYPES
from .api import (
    OutDtypeError,
    clear_caches,
    layer_norm_bwd,
    layer_norm_fwd,
    rms_norm_bwd,
    rms_norm_fwd,
)

__version__ = "0.2.0"


def warmup(shapes, ops=("layernorm", "rmsnorm"), param_dtype=None, config=None, progress=False):
    """Compile ahead the kernels of contiguous ``(M, N, dtype)`` shapes on the current GPU, so
    that the first real call does not pay NVRTC time. Binaries land in CuPy's disk cache
    (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), so later processes load them.
    ``progress``: a progress bar (tqdm, where installed). Returns the number of plans made.

    Raises RuntimeError in one line where no GPU is usable.
    """
    from ._device import require_gpu

    require_gpu("cupyln.warmup")
    from . import _passes

    return _passes.warmup(shapes, ops, param_dtype, config or Config(), progress)


__all__ = [
    "SUPPORTED_DTYPES",
    "Config",
    "OutDtypeError",
    "clear_caches",
    "layer_norm_bwd",
    "layer_norm_fwd",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "warmup",
]
