"""Whether a GPU is usable, said in one line (no CUDA traceback for users without one)."""

from __future__ import annotations

GPU_EXTRAS = ('install CuPy with cupyln\'s extra for your GPU: pip install "cupyln[cuda13]" '
              '(CUDA 13.x), "cupyln[cuda12]" (CUDA 12.x) or "cupyln[rocm]" (ROCm 7.0)')


def gpu():
    """(cupy module, device name) when a GPU is usable, else (None, reason)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no GPU found"
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return cupy, props["name"].decode()
    except Exception as e:  # no CuPy, no driver, no device
        return None, f"no usable GPU ({type(e).__name__}: {e})".splitlines()[0]


def require_gpu(what):
    cp, why = gpu()
    if cp is None:
        raise RuntimeError(f"{what} needs a GPU: {with_hint(why)}")
    return cp


def with_hint(why):
    """Why no GPU is usable, and, where CuPy is missing, which extra brings it."""
    return f"{why}; {GPU_EXTRAS}" if "No module named 'cupy'" in why else why
