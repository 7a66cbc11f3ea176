"""cupyln.torch's C++ layer against its Python layer: the same bits, the recipes it keeps, the
calls it hands back (misaligned pointers, graph capture, unknown signatures), and the Python
layer where the C++ one cannot be built."""

import re
import warnings

import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cupyln.torch")

gpu = pytest.mark.gpu


@pytest.fixture
def native():
    """The built C++ layer (its build awaited here)."""
    if ct._native_wait() is None:
        pytest.fail(f"the C++ layer did not build: {ct._NATIVE_BUILD.get('error')}")
    return ct._NATIVE


def _python_layer(fn):
    """``fn()`` with the C++ layer switched off."""
    kept = ct._NATIVE
    ct._NATIVE = None
    try:
        return fn()
    finally:
        ct._NATIVE = kept


def _run(module, x, dy, r=None):
    x = x.detach().requires_grad_()
    if r is None:
        y = module(x)
        y.backward(dy)
        return [y, x.grad] + [p.grad.clone() for p in module.parameters()]
    r = r.detach().requires_grad_()
    y, h = module(x, r)
    torch.autograd.backward((y, h), (dy, 0.5 * dy.to(h.dtype)))
    return [y, h, x.grad, r.grad] + [p.grad.clone() for p in module.parameters()]


CASES = [  # module, x shape, x dtype, parameter dtype
    (lambda d, t: ct.LayerNorm(d, deterministic=True, dtype=t), (4, 7, 512), torch.float16,
     torch.float16),
    (lambda d, t: ct.LayerNorm(d, deterministic=True, dtype=t), (33, 1000), torch.bfloat16,
     torch.float32),
    (lambda d, t: ct.LayerNorm(d, bias=False, deterministic=True, dtype=t), (64, 4096),
     torch.float32, torch.float32),
    (lambda d, t: ct.RMSNorm(d, deterministic=True, dtype=t), (2, 9, 768), torch.bfloat16,
     torch.bfloat16),
    (lambda d, t: ct.RMSNorm(d, weight_offset=1.0, deterministic=True, dtype=t), (5, 40000),
     torch.float16, torch.float32),
    (lambda d, t: ct.LayerNorm(d, elementwise_affine=False, dtype=t), (8, 3583),
     torch.bfloat16, torch.float32),
    (lambda d, t: ct.FusedAddLayerNorm(d, deterministic=True, dtype=t), (4, 7, 512),
     torch.float16, torch.float16),
    (lambda d, t: ct.FusedAddRMSNorm(d, residual_dtype=torch.float32, deterministic=True,
                                     dtype=t), (2, 9, 3000), torch.bfloat16, torch.float32),
    (lambda d, t: ct.FusedAddRMSNorm(d, weight_offset=1.0, deterministic=True, dtype=t),
     (64, 2048), torch.bfloat16, torch.bfloat16),
]


@gpu
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpp_layer_gives_the_python_layers_bits(native, case):
    make, shape, dt, wdt = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(case)
    x = torch.randn(shape, device="cuda", generator=g).to(dt)
    dy = torch.randn(shape, device="cuda", generator=g).to(dt)
    module = make(shape[-1], wdt).cuda()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, device="cuda", generator=g))
    r = torch.randn(shape, device="cuda", generator=g).to(dt) if "Add" in type(
        module).__name__ else None
    want = _python_layer(lambda: _run(module, x, dy, r))
    for _ in range(2):  # the first call hands the recipe over, the second runs it
        module.zero_grad()
        got = _run(module, x, dy, r)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@gpu
def test_known_signatures_stay_in_cpp(native):
    calls = []

    def counted(f):
        def wrapped(*a):
            calls.append(f.__name__)
            return f(*a)
        wrapped.__name__ = f.__name__
        return wrapped

    native.set_python(counted(ct._native_forward), counted(ct._native_backward))
    try:
        m = ct.RMSNorm(256).cuda().half()
        x = torch.randn(16, 256, device="cuda", dtype=torch.half, requires_grad=True)
        for _ in range(3):
            m(x).sum().backward()
        assert calls == ["_native_forward", "_native_backward"]
        xs = torch.randn(17, 256, device="cuda", dtype=torch.half)  # another signature
        m(xs)
        assert calls[-1] == "_native_forward" and len(calls) == 3
    finally:
        native.set_python(ct._native_forward, ct._native_backward)


def _head_view(device, dtype):
    """Gemma 3's q_norm input: (batch, seq, heads, head_dim) projections transposed to
    (batch, heads, seq, head_dim), rows no single pitch apart."""
    return torch.randn(2, 40, 4, 128, device=device, dtype=dtype).transpose(1, 2)


@gpu
def test_transposed_head_views_stay_in_cpp_with_the_python_layers_bits(native):
    """A view whose rows the kernels cannot take as they are (and its gradient's) is made
    contiguous in the C++ layer, so that later calls keep the recipe, not copied by the Python
    layer on every call; the same bits as the Python layer's."""
    calls = []

    def counted(f):
        def wrapped(*a):
            calls.append(f.__name__)
            return f(*a)
        return wrapped

    m = ct.RMSNorm(128, weight_offset=1.0, deterministic=True).cuda()
    x = _head_view("cuda", torch.bfloat16)
    dy = torch.randn(2, 40, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    want = _python_layer(lambda: _run(m, x, dy))
    native.set_python(counted(ct._native_forward), counted(ct._native_backward))
    try:
        for _ in range(3):
            m.weight.grad = None
            got = _run(m, x, dy)
        assert calls == ["_native_forward", "_native_backward"]
    finally:
        native.set_python(ct._native_forward, ct._native_backward)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_transposed_head_views_give_torchs_values_on_the_cpu():
    """The C++ layer's own logic on the CPU, where it builds (its Python calls take the NumPy
    path): a transposed view and a gradient of another layout, against torch's RMSNorm."""
    if ct._native_wait() is None:
        pytest.skip(f"the C++ layer did not build here: {ct._NATIVE_BUILD.get('error')}")
    x = _head_view("cpu", torch.float32).requires_grad_()
    w = torch.randn(128, requires_grad=True)
    dy = torch.randn(2, 4, 40, 128).transpose(0, 1).contiguous().transpose(0, 1)
    y = ct._NATIVE.norm(x, w, None, [128], 1e-6, False, 0.0, False)
    got = [y, *torch.autograd.grad(y, (x, w), dy)]
    want = torch.nn.functional.rms_norm(x, (128,), w, 1e-6)
    want = [want, *torch.autograd.grad(want, (x, w), dy)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_calls_autograd_does_not_record_make_no_node():
    """Without grad mode, or without an input that requires grad, the C++ layer runs the pass
    without an autograd node (as torch's operations do); with one, the node is there. On the
    CPU where the layer builds."""
    if ct._native_wait() is None:
        pytest.skip(f"the C++ layer did not build here: {ct._NATIVE_BUILD.get('error')}")
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    w = torch.randn(64, requires_grad=True)
    with torch.no_grad():
        y, (y2, h) = ct._NATIVE.norm(x, w, None, [64], 1e-6, False, 0.0, False), \
            ct._NATIVE.add_norm(x, r, w, None, [64], 1e-6, False, 0.0, None, False)
    assert y.grad_fn is None and y2.grad_fn is None and h.grad_fn is None
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (64,), w.detach(), 1e-6))
    torch.testing.assert_close(h, x + r)
    assert ct._NATIVE.norm(x, w.detach(), None, [64], 1e-6, False, 0.0, False).grad_fn is None
    assert ct._NATIVE.norm(x, w, None, [64], 1e-6, False, 0.0, False).grad_fn is not None


def test_the_cpp_node_keeps_autograds_rules():
    """The C++ layer's autograd node, on the CPU where the layer builds: gradients of the fused
    add's y alone, of h alone and of both against torch's, and under activation checkpointing;
    a second backward, and an input changed in place before the backward, are errors, as for
    torch's nodes; a forward-mode tangent and a bad argument are handed back or named before
    any work."""
    if ct._native_wait() is None:
        pytest.skip(f"the C++ layer did not build here: {ct._NATIVE_BUILD.get('error')}")
    n = ct._NATIVE
    x, r, w, b = (torch.randn(*s, requires_grad=True) for s in ((4, 64), (4, 64), (64,), (64,)))
    dy, dh = torch.randn(4, 64), torch.randn(4, 64)
    y, h = n.add_norm(x, r, w, b, [64], 1e-5, True, 0.0, None, False)
    assert y.grad_fn is h.grad_fn and y.grad_fn.name() == "cupyln::AddNormBackward"
    hr = x + r
    yr = torch.nn.functional.layer_norm(hr, (64,), w, b, 1e-5)
    ins = (x, r, w, b)
    for outs, refs, grads in (((y, h), (yr, hr), (dy, dh)), ((y,), (yr,), (dy,)),
                              ((h,), (hr,), (dh,))):
        got = torch.autograd.grad(outs, ins, grads, retain_graph=True)
        want = torch.autograd.grad(refs, ins, grads, retain_graph=True, allow_unused=True)
        for a, c, i in zip(got, want, ins, strict=True):  # one node: zeros for w, b from h
            assert torch.allclose(a, torch.zeros_like(i) if c is None else c, atol=1e-5)

    def stack(x, r):
        y, h = n.add_norm(x, r, w, b, [64], 1e-5, True, 0.0, None, False)
        return n.norm(y * h, w, None, [64], 1e-5, False, 0.0, False).square().sum()

    want = torch.autograd.grad(stack(x, r), ins)  # activation checkpointing: the same grads
    got = torch.autograd.grad(torch.utils.checkpoint.checkpoint(stack, x, r, use_reentrant=False),
                              ins)
    assert all(torch.allclose(a, c, atol=1e-6) for a, c in zip(got, want, strict=True))
    y = n.norm(x, w, b, [64], 1e-5, True, 0.0, False)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    xc = x.detach().clone().requires_grad_()
    y, h = n.add_norm(xc, r, w, None, [64], 1e-5, False, 0.0, None, False)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        assert n.norm(fwad.make_dual(x.detach(), dy), w, b, [64], 1e-5, True, 0.0, False) is None
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        n.norm(x, 1.0, b, [64], 1e-5, True, 0.0, False)
    with pytest.raises(TypeError, match="residual_dtype must be a torch.dtype"):
        n.add_norm(x, r, w, b, [64], 1e-5, True, 0.0, "float32", False)


@gpu
def test_a_weight_offset_stays_in_cpp(native):
    """Gemma's (1 + weight): after the first call of a signature, no call reaches the Python
    layer, and y and the gradients are the float32 formula's, dweight in the weight's dtype."""
    calls = []
    native.set_python(lambda *a: calls.append("fwd") or ct._native_forward(*a),
                      lambda *a: calls.append("bwd") or ct._native_backward(*a))
    try:
        m = ct.RMSNorm(256, weight_offset=1.0).cuda().bfloat16()
        with torch.no_grad():
            m.weight.normal_(0, 0.1)
        x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for _ in range(3):
            x.grad = m.weight.grad = None
            y = m(x)
            y.backward(dy)
        assert calls == ["fwd", "bwd"]
    finally:
        native.set_python(ct._native_forward, ct._native_backward)
    xr, wr = x.detach().float().requires_grad_(), m.weight.detach().requires_grad_()
    eps = torch.finfo(torch.bfloat16).eps if m.eps is None else m.eps
    want = torch.nn.functional.rms_norm(xr, (256,), 1 + wr.float(), eps)
    want.backward(dy.float())
    assert torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2)
    assert m.weight.grad.dtype == torch.bfloat16
    assert torch.allclose(x.grad.float(), xr.grad, rtol=2e-2, atol=2e-2)
    assert torch.allclose(m.weight.grad.float(), wr.grad.float(), rtol=2e-2, atol=5e-2)


@gpu
def test_pointers_that_do_not_suit_the_recipe_go_to_the_python_layer(native):
    """x one element past an aligned start: the recipe's vectors do not fit, the Python layer
    runs the call (its narrower plan), and the answer is right."""
    m = ct.LayerNorm(1024).cuda()
    base = torch.randn(8 * 1024 + 1, device="cuda")
    aligned, shifted = base[:8192].view(8, 1024), base[1:].view(8, 1024)
    m(aligned)  # the recipe of this signature (16-byte vectors)
    got = m(shifted)
    want = torch.nn.functional.layer_norm(shifted, (1024,), m.weight, m.bias)
    assert torch.allclose(got, want, atol=1e-5)


@gpu
def test_graph_capture_takes_the_python_layer(native):
    m = ct.LayerNorm(512).cuda().half()
    x = torch.randn(32, 512, device="cuda", dtype=torch.half, requires_grad=True)
    for _ in range(2):
        m(x).sum().backward()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            y = m(x)
            y.sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    m.weight.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.nn.LayerNorm(512).cuda().half()
    xr = x.detach().clone().requires_grad_()
    yr = ref(xr)
    yr.sum().backward()
    assert torch.allclose(y, yr, atol=2e-3) and torch.allclose(m.weight.grad, ref.weight.grad,
                                                               atol=0.1)


@gpu
def test_a_normalized_shape_that_does_not_fit_is_a_value_error(native):
    x = torch.randn(4, 8, 16, device="cuda")
    ct.layer_norm(x, (8, 16))
    with pytest.raises(ValueError, match=r"normalized_shape has shape \(4, 32\) but x has "
                                         r"shape \(4, 8, 16\)"):
        ct.layer_norm(x, (4, 32))


@gpu
def test_custom_ops_run_cpp_kernels_with_the_python_implementations_bits(native):
    """The custom ops (what torch.compile's graphs call) have C++ kernels for CUDA tensors,
    which give their Python implementations' bits, forward and backward, both norms and the
    fused add (h in float32 too), on the first call (recipe handed back) and the next (recipe
    run); gradients not asked for as 0-element tensors. A shape x does not end in, or
    statistics of the wrong shape, still get the Python layer's ValueError."""
    ops = torch.ops.cupyln
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16)
    r, dy = torch.randn_like(x), torch.randn_like(x)
    w, b = (torch.randn(512, device="cuda") for _ in range(2))
    y, mean, rstd = ops.layer_norm_fwd(x, w, b, [512], 1e-5, True, 0.0)
    calls = [
        ("layer_norm_fwd", (x, w, b, [512], 1e-5, True, 0.0)),
        ("rms_norm_fwd", (x, w, [512], 1e-5, True, 1.0)),
        ("add_layer_norm_fwd", (x, r, w, b, [512], 1e-5, torch.float32, 0.0, True)),
        ("add_rms_norm_fwd", (x, r, None, [512], 1e-5, None, 0.0, True)),
        ("layer_norm_bwd", (dy, x, w, mean, rstd, True, True, True, True, None, 0.0)),
        ("layer_norm_bwd", (dy, x, w, mean, rstd, True, False, True, True, r, 0.0)),
        ("rms_norm_bwd", (dy, x, w, rstd, True, True, True, r, 1.0)),
        ("rms_norm_bwd", (dy, x, None, rstd, True, False, True, None, 0.0)),
    ]
    for name, args in calls:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cupyln::{name}", "CUDA")
        want = ct._OP_IMPLS[name](*args)
        for _ in range(2):
            got = getattr(ops, name)(*args)
            assert all(a.dtype == c.dtype and torch.equal(a, c)
                       for a, c in zip(got, want, strict=True)), name
    with pytest.raises(ValueError, match=r"normalized_shape has shape \(511,\)"):
        ops.layer_norm_fwd(x, w, b, [511], 1e-5, True, 0.0)
    with pytest.raises(ValueError, match="rstd has shape"):
        ops.rms_norm_bwd(dy, x, w, torch.zeros_like(x, dtype=torch.float32), True, True, True,
                         None, 0.0)


def test_without_a_compiler_the_python_layer_runs(monkeypatch, tmp_path):
    """A build that fails warns once and leaves the Python layer (CPU tensors here)."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def fail(*a, **kw):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(ext, "load_inline", fail)
    monkeypatch.setattr(ct, "_NATIVE", None)
    monkeypatch.setattr(ct, "_NATIVE_BUILD", {})
    with pytest.warns(RuntimeWarning, match=r"the C\+\+ layer could not be built.*no compiler"):
        ct._build_native()
    assert ct._NATIVE is None and ct._NATIVE_BUILD["error"] == "RuntimeError: no compiler"
    x = torch.randn(3, 16, requires_grad=True)
    y = ct.LayerNorm(16)(x)
    y.sum().backward()
    assert torch.allclose(y, torch.nn.functional.layer_norm(x, (16,)), atol=1e-5)


def test_the_lock_of_a_build_killed_midway_does_not_stop_the_next(monkeypatch, tmp_path):
    """A build killed mid-way leaves torch's lock file behind: the next build, in the folder
    cupyln holds under its own lock, removes it before torch looks (else torch waits without
    end) and builds there."""
    import types

    import torch.utils.cpp_extension as ext

    seen = {}

    def build(name, cpp_sources, extra_cflags, build_directory):
        seen["folder"] = build_directory
        seen["lock left"] = (tmp_path / build_directory / "lock").exists()
        return types.SimpleNamespace(set_python=lambda *fns: None, register_ops=lambda impls: None)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with ct._build_folder() as folder:  # a build that was killed: torch's lock file stays
        (tmp_path / folder / "lock").write_text("")
    monkeypatch.setattr(ext, "load_inline", build)
    monkeypatch.setattr(ct, "_NATIVE", None)
    monkeypatch.setattr(ct, "_NATIVE_BUILD", {})
    ct._build_native()
    assert ct._NATIVE is not None and "error" not in ct._NATIVE_BUILD
    assert seen == {"folder": folder, "lock left": False}
    assert folder.startswith(str(tmp_path))


def test_a_build_that_does_not_end_is_not_waited_for_without_end(monkeypatch, tmp_path):
    """A build that does not end gives the Python layer after the wait's limit, with a warning
    that says why; its end, later, still brings the C++ layer."""
    import threading
    import types

    import torch.utils.cpp_extension as ext

    release = threading.Event()
    built = types.SimpleNamespace(set_python=lambda *fns: None, register_ops=lambda impls: None)

    def stuck(*a, **kw):
        release.wait(10)
        return built

    monkeypatch.setenv("CUPYLN_TORCH_NATIVE", "1")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ct, "_NATIVE", None)
    monkeypatch.setattr(ct, "_NATIVE_BUILD", {})
    monkeypatch.setattr(ext, "load_inline", stuck)
    with pytest.warns(RuntimeWarning, match="still building after 0 s.*lock"):
        assert ct._native_wait(timeout=0.05) is None
    assert "still building" in ct._NATIVE_BUILD["error"]
    release.set()
    assert ct._native_wait() is built and "error" not in ct._NATIVE_BUILD


@pytest.mark.parametrize("version", ["2.10.1+cu128", "2.9.0a0+git1234"])
def test_a_torch_older_than_the_layer_needs_keeps_the_python_layer(monkeypatch, version):
    """A torch without the device interface's stream handle: no build is tried (it would fail
    after a compile), a RuntimeWarning names the version needed, and calls take the Python
    layer (CPU tensors here)."""
    monkeypatch.setenv("CUPYLN_TORCH_NATIVE", "1")
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(ct, "_NATIVE", None)
    monkeypatch.setattr(ct, "_NATIVE_BUILD", {})
    with pytest.warns(RuntimeWarning, match=rf"torch {re.escape(version)}: the C\+\+ layer "
                                            r"needs torch 2\.11 or later"):
        assert ct._native_wait() is None
    assert "thread" not in ct._NATIVE_BUILD
    x = torch.randn(3, 16)
    torch.testing.assert_close(ct.LayerNorm(16)(x), torch.nn.functional.layer_norm(x, (16,)))


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setenv("CUPYLN_TORCH_NATIVE", "0")
    monkeypatch.setattr(ct, "_NATIVE_BUILD", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ct._start_native()
    assert ct._NATIVE_BUILD == {"error": "off"}
