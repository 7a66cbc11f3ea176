"""Whether a GPU is usable, said in one line (no CUDA traceback for users without one)."""

from __future__ import annotations


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
        raise RuntimeError(f"{what} needs a GPU: {why}")
    return cp
