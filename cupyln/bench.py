"""Benchmark cupyln against PyTorch and Liger-Kernel on one GPU, in one process.

    python -m cupyln bench [--shapes FILE] [--shape OP M N DTYPE ...] [--out JSON] [--plot PNG]

Device time: CUDA-event medians after warm-up, each call behind a 256 MiB memset that evicts the
L2 cache and a short spin kernel that keeps the GPU busy while the host enqueues the call, so
host launch cost stays out of device time (it is measured separately); a random number of empty
launches before each call mixes the two values that a small pass's time otherwise keeps for a
whole block of calls. The providers of a shape take turns in ROUNDS rounds and
each one's median is over all its rounds' calls, so a drift of the GPU's speed during the run
falls on every provider alike. GB/s count the bytes
each pass must move (forward 2*M*N*s, backward 3*M*N*s, plus parameters and statistics); every
ratio is against the device-to-device copy bandwidth measured in the same run. Host time of a
hot call: 2,000 back-to-back calls at 32x512 float16 with one synchronize. The JSON schema:
``python -m cupyln bench --help``.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import time

import numpy as np

try:
    import cupy as cp
except ImportError:  # --help works without CuPy; the benchmark itself needs it and a GPU
    cp = None

import cupyln

from ._cli import bench_parser
from ._dtypes import BFLOAT16

SCHEMA_VERSION = 1


_FLUSH = {}
_SPIN_SOURCE = r"""
extern "C" __global__ void cupyln_spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}"""


def device_us(fn, n_warmup=10, n_repeat=100, spin_cycles=600_000):
    """Median device time of fn() in microseconds (see device_samples)."""
    return float(np.median(device_samples(fn, n_warmup, n_repeat, spin_cycles)))


# Empty launches before each timed call: a random 0 to PAD_LAUNCHES of them, from one generator
# of a fixed seed. Without them a small pass's time took one of two values 8-10% apart for a
# whole block of calls, picked by the block's place in the run, so which provider was ahead
# changed between repetitions; with them the repetitions agree within 1-2%.
PAD_LAUNCHES = 7
_PADS = np.random.default_rng(0)


def device_samples(fn, n_warmup=10, n_repeat=100, spin_cycles=600_000):
    """Device times of ``n_repeat`` calls of fn() in microseconds, cold L2, host launch cost
    hidden.

    Before each timed call: a 256 MiB memset evicts the L2 cache, then 0 to PAD_LAUNCHES empty
    launches (at random), then a one-thread kernel spins ~300 us so that the host has enqueued
    every launch of the call before the GPU reaches it (gaps between a call's own launches
    would otherwise count as device time).
    """
    flush = _FLUSH.get("buf")
    if flush is None:
        flush = _FLUSH["buf"] = cp.empty(256 << 20, cp.uint8)
        _FLUSH["spin"] = cp.RawKernel(_SPIN_SOURCE, "cupyln_spin")
    spin_kernel = _FLUSH["spin"]
    for _ in range(n_warmup):
        fn()
    starts = [cp.cuda.Event() for _ in range(n_repeat)]
    ends = [cp.cuda.Event() for _ in range(n_repeat)]
    spin, zero = np.int64(spin_cycles), np.int64(0)
    pads = _PADS.integers(0, PAD_LAUNCHES + 1, n_repeat)
    for s, e, pad in zip(starts, ends, pads, strict=True):
        flush.fill(0)
        for _ in range(pad):
            spin_kernel((1,), (1,), (zero,))
        spin_kernel((1,), (1,), (spin,))
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    return [cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends, strict=True)]


# Rounds in which a shape's providers take turns, and each one's calls per round: every
# provider's time drifts together between rounds (up to 12% on the small shapes), so a provider
# timed after another would read the drift as a difference between them.
ROUNDS, ROUND_CALLS = 5, 20


def interleaved_us(fns):
    """{name: median device time in us} of the callables ``fns``, which take turns in ROUNDS
    rounds of ROUND_CALLS calls each; a callable that raises is left out of later rounds and
    given as the exception."""
    samples, failed = {k: [] for k in fns}, {}
    for _ in range(ROUNDS):
        for k, fn in fns.items():
            if k in failed:
                continue
            try:
                samples[k] += device_samples(fn, n_repeat=ROUND_CALLS)
            except Exception as e:  # a peer that cannot run a shape is reported, not fatal
                failed[k] = e
    return {k: failed.get(k, float(np.median(v)) if v else None) for k, v in samples.items()}


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device copy of a 4 GiB buffer, in GB/s counting bytes read plus written."""
    bufs = [cp.empty(nbytes, cp.uint8) for _ in range(2)]
    bufs[0].fill(1)

    def copy():
        bufs[1].data.copy_from_device_async(bufs[0].data, nbytes)

    us = device_us(copy, n_warmup=3, n_repeat=20)
    bufs.clear()
    return 2 * nbytes / us / 1e3


def moved_bytes(op, pass_, M, N, isz, wsz):
    ln = op.startswith("layernorm")
    stats = (2 if ln else 1) * M * 4
    params = (2 if ln else 1) * N * wsz
    # the fused residual add moves one row array more each way: the forward reads x and the
    # residual and writes y and h; the backward also reads dresidual
    rows = 1 if op.endswith("_add") else 0
    if op.endswith("_fp8"):  # x in, y out in float8, one float32 scale per row
        return (isz + 1) * M * N + params + stats + M * 4
    if pass_ == "fwd":
        return (2 + 2 * rows) * M * N * isz + params + stats
    # backward reads x, dy, gamma, stats; writes dx, dgamma (and dbeta)
    return (3 + rows) * M * N * isz + N * wsz + params + stats


# ----------------------------------------------------------------------------- providers


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def _liger():
    try:
        from liger_kernel.ops import layer_norm as lln
        from liger_kernel.ops import rms_norm as lrms

        return lln, lrms
    except Exception:
        return None


def _to_torch(torch, a):
    if a.dtype == BFLOAT16:  # through int16 bits: not every DLPack path knows bfloat16
        return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def make_inputs(M, N, dtype, seed=0):
    """x = -2.3 + 0.5 randn, dy = 0.1 randn (Triton's tutorial), gamma/beta random; x's dtype."""
    rs = cp.random.RandomState(seed)
    x = (-2.3 + 0.5 * rs.standard_normal((M, N), dtype=cp.float32)).astype(dtype)
    dy = (0.1 * rs.standard_normal((M, N), dtype=cp.float32)).astype(dtype)
    g = (1.0 + 0.1 * rs.standard_normal(N, dtype=cp.float32)).astype(dtype)
    b = (0.1 * rs.standard_normal(N, dtype=cp.float32)).astype(dtype)
    return x, dy, g, b


def _liger_cases(op, tx, tdy, tg, tb, liger):
    lln, lrms = liger
    out = {}
    if op == "layernorm":
        _, _, lm, lr, _, _ = lln.layer_norm_forward(tx, tg, tb, 1e-5)
        out["liger", "fwd"] = lambda: lln.layer_norm_forward(tx, tg, tb, 1e-5)
        out["liger", "bwd"] = lambda: lln.layer_norm_backward(tdy, tx, tg, tb, lm, lr)
    else:
        _, _, lr, bs, nw, cm = lrms.rms_norm_forward(tx, tg, 1e-6, 0.0, "llama", None)
        out["liger", "fwd"] = lambda: lrms.rms_norm_forward(tx, tg, 1e-6, 0.0, "llama", None)
        out["liger", "bwd"] = lambda: lrms.rms_norm_backward(tdy, tx, tg, lr, 0.0, cm, bs, nw,
                                                             False, None)
    return out


def cases(op, x, dy, g, b, torch, liger, deterministic=False, config=None):
    """{(provider, pass): callable} on identical inputs (cupyln's planned by ``config``)."""
    N = x.shape[-1]
    out = {}
    kw = dict(deterministic=deterministic, config=config)
    if op == "layernorm":
        y, mean, rstd = cupyln.layer_norm_fwd(x, g, b, config=config)
        out["cupyln", "fwd"] = lambda: cupyln.layer_norm_fwd(x, g, b, config=config)
        out["cupyln", "bwd"] = lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd, **kw)
    else:
        y, rstd = cupyln.rms_norm_fwd(x, g, config=config)
        out["cupyln", "fwd"] = lambda: cupyln.rms_norm_fwd(x, g, config=config)
        out["cupyln", "bwd"] = lambda: cupyln.rms_norm_bwd(dy, x, g, rstd, **kw)
    if torch is not None:
        tx, tdy, tg, tb = (_to_torch(torch, a) for a in (x, dy, g, b))
        if op == "layernorm":
            ln = torch.ops.aten.native_layer_norm
            _, tm, tr = ln(tx, [N], tg, tb, 1e-5)
            out["torch", "fwd"] = lambda: ln(tx, [N], tg, tb, 1e-5)
            lnb = torch.ops.aten.native_layer_norm_backward
            out["torch", "bwd"] = lambda: lnb(tdy, tx, [N], tm, tr, tg, tb, [True, True, True])
        else:
            F = torch.nn.functional
            out["torch", "fwd"] = lambda: F.rms_norm(tx, [N], tg, 1e-6)
            xr = tx.detach().requires_grad_()
            gr = tg.detach().requires_grad_()
            yr = F.rms_norm(xr, [N], gr, 1e-6)
            out["torch", "bwd"] = lambda: torch.autograd.grad(yr, (xr, gr), tdy,
                                                              retain_graph=True)
    if torch is not None and liger is not None:
        try:
            out.update(_liger_cases(op, tx, tdy, tg, tb, liger))
        except Exception:  # Liger refuses some shapes (rows over 65536 elements): left out
            pass
    return out


FP8_MAX_N = 8192  # float8 rows in the benchmark: 16-bit rows up to this length (model widths)


def fp8_cases(op, x, g, b, torch):
    """{(provider, "fwd"): callable} of y in float8_e4m3fn (``op`` "layernorm_fp8" or
    "rmsnorm_fp8"): cupyln's one pass with per-row scales ("cupyln") or a static scale
    ("cupyln_static"), cupyln's plain norm ("cupyln_norm"), and torch's norm followed by
    torch's quantization, per row ("torch") or static ("torch_static")."""
    ln = op == "layernorm_fp8"
    fwd = cupyln.layer_norm_fwd if ln else cupyln.rms_norm_fwd
    par = (g, b) if ln else (g,)
    s = cp.array([0.01], cp.float32)
    out = {("cupyln", "fwd"): lambda: fwd(x, *par, y_dtype="float8_e4m3fn"),
           ("cupyln_static", "fwd"): lambda: fwd(x, *par, y_dtype="float8_e4m3fn", y_scale=s),
           ("cupyln_norm", "fwd"): lambda: fwd(x, *par)}
    if torch is None:
        return out
    tx, tg, tb = (_to_torch(torch, a) for a in (x, g, b))
    ts, f8, N = _to_torch(torch, s), torch.float8_e4m3fn, x.shape[-1]
    F = torch.nn.functional
    norm = (lambda: F.layer_norm(tx, [N], tg, tb, 1e-5)) if ln else \
        (lambda: F.rms_norm(tx, [N], tg, 1e-6))

    def per_row():
        y = norm().float()
        scale = y.abs().amax(-1, keepdim=True) / 448.0
        return (y / scale).clamp(-448.0, 448.0).to(f8), scale

    out["torch", "fwd"] = per_row
    out["torch_static", "fwd"] = lambda: (norm() / ts).clamp(-448.0, 448.0).to(f8)
    return out


def add_cases(op, x, dy, g, b, torch, liger, config=None):
    """{(provider, pass): callable} of the fused residual add (``op`` "layernorm_add" or
    "rmsnorm_add", h in x's dtype): cupyln fused, cupyln's norm with a separate add
    ("cupyln_unfused"; torch's add where torch is present: CuPy's bfloat16 add is slow), torch
    eager add then norm, and Liger's fused-add RMSNorm."""
    r, dr = x[::-1].copy(), dy[::-1].copy()  # residual and its gradient: other values
    out = _cupyln_add_cases(op == "layernorm_add", x, r, dy, dr, g, b, torch, config)
    if torch is not None:
        t = [_to_torch(torch, a) for a in (x, r, dy, dr, g, b)]
        out.update(_torch_add_cases(op == "layernorm_add", torch, *t))
        if liger is not None and op == "rmsnorm_add":
            out.update(_liger_add_cases(*t[:5]))
    return out


def _cupyln_add_cases(ln, x, r, dy, dr, g, b, torch, config):
    """cupyln fused, and cupyln's norm beside a separate add."""
    fwd = cupyln.layer_norm_fwd if ln else cupyln.rms_norm_fwd
    bwd = cupyln.layer_norm_bwd if ln else cupyln.rms_norm_bwd
    par = (g, b) if ln else (g,)
    *_, h = fwd(x, *par, residual=r)
    stats = fwd(h, *par)[1:]
    hs, dxs = cp.empty_like(x), cp.empty_like(x)
    none = (None,) * len(par)  # the parameter gradients' out= entries
    if torch is None:
        def add(a, c, o):
            cp.add(a, c, out=o)
    else:
        wrapped = {id(a): _to_torch(torch, a) for a in (x, r, dr, hs, dxs)}

        def add(a, c, o):
            torch.add(wrapped[id(a)], wrapped[id(c)], out=wrapped[id(o)])

    def unfused_fwd():
        add(x, r, hs)
        return fwd(hs, *par)

    def unfused_bwd():
        bwd(dy, h, g, *stats, out=(dxs, *none))
        add(dxs, dr, dxs)

    return {("cupyln", "fwd"): lambda: fwd(x, *par, residual=r, config=config),
            ("cupyln", "bwd"): lambda: bwd(dy, h, g, *stats, dresidual=dr, config=config),
            ("cupyln_unfused", "fwd"): unfused_fwd, ("cupyln_unfused", "bwd"): unfused_bwd}


def _torch_add_cases(ln, torch, tx, tr, tdy, tdr, tg, tb):
    """torch eager: the add, then the norm; its backward plus the residual's gradient."""
    N = tx.shape[-1]
    th = tx + tr
    if ln:
        lnf, lnb = torch.ops.aten.native_layer_norm, torch.ops.aten.native_layer_norm_backward
        _, tm, trs = lnf(th, [N], tg, tb, 1e-5)
        return {("torch", "fwd"): lambda: lnf(tx + tr, [N], tg, tb, 1e-5),
                ("torch", "bwd"): lambda: lnb(tdy, th, [N], tm, trs, tg, tb,
                                              [True, True, True])[0] + tdr}
    F = torch.nn.functional
    hr, gr = th.detach().requires_grad_(), tg.detach().requires_grad_()
    yr = F.rms_norm(hr, [N], gr, 1e-6)
    return {("torch", "fwd"): lambda: F.rms_norm(tx + tr, [N], tg, 1e-6),
            ("torch", "bwd"): lambda: torch.autograd.grad(yr, (hr, gr), tdy,
                                                          retain_graph=True)[0] + tdr}


def _liger_add_cases(tx, tr, tdy, tdr, tg):
    """Liger's fused-add RMSNorm; none where Liger refuses the shape (rows over 65536)."""
    try:
        from liger_kernel.ops import fused_add_rms_norm as lf

        _, s_, rs, bs, nw, ns, cm = lf.fused_add_rms_norm_forward(tx, tr, tg, 1e-6, 0.0, "llama")
    except Exception:
        return {}
    return {("liger", "fwd"): lambda: lf.fused_add_rms_norm_forward(tx, tr, tg, 1e-6, 0.0,
                                                                    "llama"),
            ("liger", "bwd"): lambda: lf.fused_add_rms_norm_backward(
                tdy, tdr, s_, tg, rs, 0.0, cm, bs, nw, ns, False, True)}


# ----------------------------------------------------------------------------- modules

# Shapes of the module rows: the autograd path of cupyln.torch against torch.nn's and Liger's
# modules (device time of a forward, and of a backward through autograd).
MODULE_SHAPES = [("layernorm", 4096, 4096, "bfloat16"), ("rmsnorm", 4096, 4096, "bfloat16"),
                 ("layernorm", 32, 512, "float16")]


def _modules(torch, op, N, with_liger):
    """{provider: module class} of the norm ``op``: cupyln.torch's, torch.nn's, Liger's."""
    import cupyln.torch as ct

    ct._native_wait()  # the C++ layer built first: the rows time it, not whichever layer is up
    name = "LayerNorm" if op == "layernorm" else "RMSNorm"
    mods = {"cupyln.torch": getattr(ct, name), "torch.nn": getattr(torch.nn, name)}
    if with_liger:
        try:
            from liger_kernel import transformers as lt

            mods["liger.nn"] = getattr(lt, f"Liger{name}")
        except Exception:  # Liger's modules need more than its ops: left out
            pass
    return mods


def module_cases(torch, op, M, N, dtype, with_liger):
    """{(provider, pass): callable}: forward through the module, backward through autograd."""
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    out = {}
    for prov, cls in _modules(torch, op, N, with_liger).items():
        m = cls(N).to(device="cuda", dtype=dtype)
        y = m(x)
        wrt = (x, *m.parameters())
        out[prov, "module_fwd"] = lambda m=m: m(x)
        out[prov, "module_bwd"] = lambda y=y, wrt=wrt: torch.autograd.grad(y, wrt, dy,
                                                                           retain_graph=True)
    return out


def module_rows(torch, with_liger):
    if torch is None:
        return []
    rows = []
    for op, M, N, dt in MODULE_SHAPES:
        dtype = getattr(torch, dt)
        for (prov, pass_), us in interleaved_us(
                module_cases(torch, op, M, N, dtype, with_liger)).items():
            if isinstance(us, Exception):
                continue
            isz = torch.finfo(dtype).bits // 8
            gbs = moved_bytes(op, pass_[7:], M, N, isz, isz) / us / 1e3
            rows.append({"op": op, "M": M, "N": N, "dtype": dt, "pass": pass_,
                         "provider": prov, "us": us, "GBs": gbs})
    return rows


# ----------------------------------------------------------------------------- host time


def host_us_per_call(fn, calls=2000):
    """Host time per call of `calls` back-to-back calls, one synchronize at the end."""
    for _ in range(20):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_rows(torch, with_liger=False):
    x, dy, g, b = make_inputs(32, 512, np.float16)
    y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
    fo = (cp.empty_like(x), cp.empty(32, cp.float32), cp.empty(32, cp.float32))
    bo = (cp.empty_like(x), cp.empty_like(g), cp.empty_like(b))
    rows = [("cupyln", "fwd_host", lambda: cupyln.layer_norm_fwd(x, g, b)),
            ("cupyln", "bwd_host", lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd)),
            ("cupyln", "fwd_host_out", lambda: cupyln.layer_norm_fwd(x, g, b, out=fo)),
            ("cupyln", "bwd_host_out",
             lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd, out=bo))]
    if torch is not None:
        mods = {prov: cls(512) for prov, cls in _modules(torch, "layernorm", 512,
                                                        with_liger).items()}
        mx = torch.randn(32, 512, device="cuda", dtype=torch.float16, requires_grad=True)
        mdy = torch.randn_like(mx)

        def inference(m):
            with torch.no_grad():
                return m(mx)

        for prov, m in mods.items():
            m = m.to(device="cuda", dtype=torch.float16)
            my = m(mx)
            rows += [(prov, "module_fwd_host", lambda m=m: m(mx)),
                     (prov, "module_fwd_nograd_host", lambda m=m: inference(m)),
                     (prov, "module_bwd_host", lambda my=my, m=m: torch.autograd.grad(
                         my, (mx, *m.parameters()), mdy, retain_graph=True))]
        tx, tdy, tg, tb = (_to_torch(torch, a) for a in (x, dy, g, b))
        _, tm, tr = torch.ops.aten.native_layer_norm(tx, [512], tg, tb, 1e-5)
        F, lnb = torch.nn.functional, torch.ops.aten.native_layer_norm_backward
        rows += [("torch", "fwd_host", lambda: F.layer_norm(tx, [512], tg, tb, 1e-5)),
                 ("torch", "bwd_host",
                  lambda: lnb(tdy, tx, [512], tm, tr, tg, tb, [True, True, True]))]
    # The host's speed drifts during a run (the same call 15-24 us within a second), so
    # the providers take turns, HOST_ROUNDS times, and each row is the median of its rounds.
    times = [[] for _ in rows]
    for _ in range(HOST_ROUNDS):
        for t, (_, _, fn) in zip(times, rows, strict=True):
            t.append(host_us_per_call(fn))
    return [{"op": "layernorm", "M": 32, "N": 512, "dtype": "float16", "pass": p,
             "provider": prov, "us": float(np.median(t)), "GBs": None}
            for (prov, p, _), t in zip(rows, times, strict=True)]


HOST_ROUNDS = 7


# ----------------------------------------------------------------------------- compile latency

_FIRST_CALLS = r"""
import json, sys, time
import cupy as cp
import cupyln
from cupyln.bench import make_inputs
M, N, dt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
x, dy, g, b = make_inputs(M, N, dt)
cp.cuda.Device().synchronize()  # context, allocator and CuPy's own kernels are up
t0 = time.perf_counter()
y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
cp.cuda.Device().synchronize()
t1 = time.perf_counter()
cupyln.layer_norm_bwd(dy, x, g, mean, rstd)
cp.cuda.Device().synchronize()
t2 = time.perf_counter()
print(json.dumps({"fwd": (t1 - t0) * 1e6, "bwd": (t2 - t1) * 1e6}))
"""


def compile_rows(M=4096, N=1024, dtype="float16"):
    """First-call times in fresh processes: with an empty CUPY_CACHE_DIR (NVRTC compiles the
    forward module, then the backward one), then again with that cache filled (disk hits)."""
    import subprocess
    import sys
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        for kind in ("compile_cold", "first_call_warm"):
            r = subprocess.run([sys.executable, "-c", _FIRST_CALLS, str(M), str(N), dtype],
                               env=env, capture_output=True, text=True, check=True)
            times = json.loads(r.stdout.strip().splitlines()[-1])
            rows += [{"op": "layernorm", "M": M, "N": N, "dtype": dtype, "pass": f"{p}_{kind}",
                      "provider": "cupyln", "us": us, "GBs": None} for p, us in times.items()]
    return rows


# ----------------------------------------------------------------------------- main


def dtype_of(name):
    """The NumPy dtype of a dtype name of the shapes file ("float16", "bfloat16", ...)."""
    return np.dtype(BFLOAT16 if name == "bfloat16" else name)


def parse_shapes(items):
    """(op, M, N, dtype name) of each "op:M:N:dtype" item (as the scripts take shapes)."""
    return [(o, int(m), int(n), d) for o, m, n, d in (item.split(":") for item in items)]


def env_shapes(var, default):
    """Shapes from environment variable ``var`` ("op:M:N:dtype,...", as the tuning scripts take
    them), else ``default``."""
    text = os.environ.get(var)
    return parse_shapes(text.split(",")) if text else default


def load_shapes(path=None):
    if path is None:
        text = importlib.resources.files("cupyln").joinpath("benchmark_shapes.json").read_text()
    else:
        with open(path) as f:
            text = f.read()
    d = json.loads(text)
    return [(op, M, N, dt) for op in ("layernorm", "rmsnorm") for M, N, dt in d.get(op, [])]


# The sweep of the plot's third panel: LayerNorm bfloat16 rows of N from 256 to 1,048,576 at
# M * N = 2^27 elements, the plain passes only, and lengths that no vector width divides (odd:
# their rows are peeled, or read in single elements where no peeled kernel holds them), RMSNorm's
# too.
ODD_N = (3583, 50257, 65535, 131071, 1048575)
SWEEP = [("layernorm", 2**27 // n, n, "bfloat16")
         for n in sorted([2**k for k in range(8, 21)] + list(ODD_N))] + \
    [("rmsnorm", 2**27 // n, n, "bfloat16") for n in ODD_N]


def jobs(shapes, sweep=()):
    """(shape, with the fused add) of one run: the list's shapes with the fused add, then the
    sweep's others, whose fused add runs at the odd lengths alone (its peeled rows)."""
    return [(s, True) for s in shapes] + [(s, s[2] in ODD_N) for s in sweep if s not in shapes]


def run(shapes, progress=True, sweep=(), models=True):
    torch, liger = _torch(), _liger()
    copy = copy_bandwidth()
    rows = []
    it = jobs(shapes, sweep)
    if progress:
        try:
            from tqdm import tqdm

            it = tqdm(it, desc="benchmark", unit="shape")
        except ImportError:  # tqdm comes with the bench extra
            pass
    for (op, M, N, dt), with_add in it:
        dtype = dtype_of(dt)
        x, dy, g, b = make_inputs(M, N, dtype)
        ops = [(op, cases(op, x, dy, g, b, torch, liger))]
        if with_add:
            ops.append((f"{op}_add", add_cases(f"{op}_add", x, dy, g, b, torch, liger)))
        if dtype.itemsize == 2 and N <= FP8_MAX_N:
            ops.append((f"{op}_fp8", fp8_cases(f"{op}_fp8", x, g, b, torch)))
        for name, made in ops:
            for (prov, pass_), us in interleaved_us(made).items():
                if isinstance(us, Exception):
                    print(f"{prov} {name} {pass_} {M}x{N} {dt}: {type(us).__name__}: {us}")
                    continue
                gbs = moved_bytes(name, pass_, M, N, dtype.itemsize, dtype.itemsize) / us / 1e3
                rows.append({"op": name, "M": M, "N": N, "dtype": dt, "pass": pass_,
                             "provider": prov, "us": us, "GBs": gbs})
        ops = made = None  # the closures hold the arrays
        del x, dy, g, b
        cp.get_default_memory_pool().free_all_blocks()
    rows += module_rows(torch, liger is not None)
    rows += host_rows(torch, liger is not None)
    rows += compile_rows()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    steps = []
    if models and torch is not None:
        from . import bench_models

        steps = bench_models.rows(compiled=(False, True))
    return {
        "schema": SCHEMA_VERSION,
        "device": props["name"].decode(),
        "copy_GBs": copy,
        "versions": {"cupyln": cupyln.__version__, "cupy": cp.__version__,
                     "torch": getattr(torch, "__version__", None),
                     "liger": _liger_version() if liger else None},
        "rows": rows,
        "model_steps": steps,
    }


def _liger_version():
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return "unknown"


def table(result):
    """One line per (op, shape, pass): cupyln us, GB/s, % of copy, best peer and the ratio."""
    copy = result["copy_GBs"]
    by = {}
    for r in result["rows"]:
        if r["GBs"] is None:
            continue
        by.setdefault((r["op"], r["M"], r["N"], r["dtype"], r["pass"]), {})[r["provider"]] = r
    lines = [f"copy bandwidth {copy:.0f} GB/s on {result['device']}",
             f"{'op':<9} {'M':>6} {'N':>6} {'dtype':<8} {'pass':<4} {'cupyln us':>9} "
             f"{'GB/s':>6} {'%copy':>6} {'torch us':>9} {'liger us':>9} {'best/cupyln':>11}"]
    for (op, M, N, dt, p), d in by.items():
        c = d.get("cupyln")
        if c is None:
            continue
        peers = [d[k]["us"] for k in ("torch", "liger", "cupyln_unfused") if k in d]
        if op.endswith("_fp8"):  # against what it replaces: a norm, then a quantization
            peers = [d[k]["us"] for k in ("torch",) if k in d]
        t = d.get("torch", {}).get("us")
        li = d.get("liger", {}).get("us")
        ratio = f"{min(peers) / c['us']:.2f}x" if peers else "-"
        lines.append(
            f"{op:<9} {M:>6} {N:>6} {dt:<8} {p:<4} {c['us']:>9.1f} {c['GBs']:>6.0f} "
            f"{100 * c['GBs'] / copy:>5.1f}% {'-' if t is None else f'{t:9.1f}':>9} "
            f"{'-' if li is None else f'{li:9.1f}':>9} {ratio:>11}")
    for r in result["rows"]:
        if r["GBs"] is None or r["pass"].startswith("module_"):
            lines.append(f"{r['provider']:<12} {r['pass']:<24} {r['us']:10.1f} us "
                         f"({r['op']} {r['M']}x{r['N']} {r['dtype']})")
    return "\n".join(lines)


def plot(result, path, M=4096, dtype="float16", op="layernorm"):
    """GB/s against N: forward and backward at M rows (two panels), and the sweep at M * N =
    2^27 (third panel, bfloat16, both passes); the model steps beside it (PATH_steps.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4), sharey=True)
    for ax, p in zip(axes[:2], ("fwd", "bwd"), strict=True):
        for prov in ("cupyln", "torch", "liger"):
            pts = sorted((r["N"], r["GBs"]) for r in result["rows"]
                         if r["provider"] == prov and r["pass"] == p and r["M"] == M
                         and r["dtype"] == dtype and r["op"] == op and r["GBs"])
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=prov)
        ax.axhline(result["copy_GBs"], color="gray", ls="--", label="D2D copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_title(f"{op} {p}, M={M}, {dtype}")
        ax.grid(alpha=0.3)
    ax = axes[2]
    for prov, color in (("cupyln", "C0"), ("torch", "C1"), ("liger", "C2")):
        for p, ls, odd in (("fwd", "-", "x"), ("bwd", "--", "+")):
            pts = sorted((r["N"], r["GBs"]) for r in result["rows"]
                         if r["provider"] == prov and r["pass"] == p and r["op"] == "layernorm"
                         and r["M"] * r["N"] == 2**27 - 2**27 % r["N"]
                         and r["dtype"] == "bfloat16" and r["GBs"])
            pow2 = [pt for pt in pts if pt[0] & (pt[0] - 1) == 0]
            if len(pow2) > 2:
                ax.plot(*zip(*pow2, strict=True), ls, marker=".", color=color,
                        label=f"{prov} {p}")
            others = [pt for pt in pts if pt not in pow2]  # odd N: markers, not on the line
            if others and len(pow2) > 2:
                ax.plot(*zip(*others, strict=True), odd, ls="none", color=color)
    ax.plot([], [], "x", color="gray", label="odd N (x fwd, + bwd)")
    ax.axhline(result["copy_GBs"], color="gray", ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (M·N = 2^27)")
    ax.set_title("layernorm, bfloat16, M·N = 2^27")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("GB/s")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    if result.get("model_steps"):
        from . import bench_models

        stem, dot, ext = str(path).rpartition(".")
        bench_models.plot(result["model_steps"], f"{stem}_steps.{ext}" if dot else f"{path}_steps")


def run_args(a):
    """Run the benchmark for parsed arguments (see cupyln._cli.add_bench_arguments)."""
    shapes = [] if a.only else load_shapes(a.shapes)
    shapes += [(op, int(M), int(N), dt) for op, M, N, dt in a.shape]
    result = run(shapes, progress=not a.no_progress,
                 sweep=() if a.only or a.no_sweep else SWEEP, models=not a.no_models)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    print(table(result))
    return 0


def main(argv=None):
    args = bench_parser().parse_args(argv)
    from ._device import require_gpu

    require_gpu("the benchmark")
    return run_args(args)


if __name__ == "__main__":
    raise SystemExit(main())
