"""cupyln.torch against torch.nn.functional: values, gradients, gradcheck, torch.compile,
modules and state_dict, determinism; on the CPU (the NumPy path) and, marked `gpu`, on CUDA
(DLPack, streams, CUDA graphs, autocast, a short training run)."""

import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cupyln.torch")
F = torch.nn.functional

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
# |cupyln - torch| allowed, relative to max |torch|, by the output's dtype
TOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def inputs(shape, k, dtype, wdtype, device, affine=(True, True), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (-2.3 + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    norm = shape[len(shape) - k:]
    w = (1 + 0.2 * torch.randn(norm, generator=g, dtype=torch.float64)).to(wdtype) \
        if affine[0] else None
    b = (0.2 * torch.randn(norm, generator=g, dtype=torch.float64)).to(wdtype) \
        if affine[1] else None
    dy = (0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    return [None if t is None else t.to(device) for t in (x, w, b, dy)]


def grads(fn, x, w, b, dy):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    return (y, *torch.autograd.grad(y, wrt, dy))


CASES = [  # shape, normalized axes, x dtype, weight dtype, (weight, bias)
    ((4, 7, 64), 1, torch.float32, torch.float32, (True, True)),
    ((3, 5, 4, 6), 2, torch.float64, torch.float64, (True, True)),
    ((33, 1000), 1, torch.float16, torch.float32, (True, False)),
    ((9, 512), 1, torch.bfloat16, torch.bfloat16, (False, False)),
    ((2, 8, 3000), 1, torch.bfloat16, torch.float32, (True, True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,k,dt,wdt,affine", CASES)
def test_layer_norm_matches_torch(device, shape, k, dt, wdt, affine):
    x, w, b, dy = inputs(shape, k, dt, wdt, device, affine)
    norm = shape[len(shape) - k:]
    ours = grads(lambda x, w, b: ct.layer_norm(x, norm, w, b, 1e-5), x, w, b, dy)
    # torch's reference in float64, so that only cupyln's rounding is measured
    up = [None if t is None else t.double() for t in (x, w, b, dy)]
    want = grads(lambda x, w, b: F.layer_norm(x, norm, w, b, 1e-5), *up)
    assert ours[0].dtype == dt and ours[0].shape == x.shape
    for i, (a, r) in enumerate(zip(ours, want, strict=True)):
        assert rel_err(a, r) <= TOL[a.dtype], i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,k,dt,wdt,affine", CASES)
def test_rms_norm_matches_torch(device, shape, k, dt, wdt, affine):
    x, w, _, dy = inputs(shape, k, dt, wdt, device, affine)
    norm = shape[len(shape) - k:]
    ours = grads(lambda x, w, _: ct.rms_norm(x, norm, w, 1e-6), x, w, None, dy)
    up = [None if t is None else t.double() for t in (x, w, dy)]
    want = grads(lambda x, w, _: F.rms_norm(x, norm, w, 1e-6), up[0], up[1], None, up[2])
    for i, (a, r) in enumerate(zip(ours, want, strict=True)):
        assert rel_err(a, r) <= TOL[a.dtype], i


def test_gradcheck_in_float64():
    x, w, b, _ = inputs((3, 4, 10), 1, torch.float64, torch.float64, "cpu")
    args = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda x, w, b: ct.layer_norm(x, (10,), w, b), args)
    assert torch.autograd.gradcheck(lambda x, w: ct.rms_norm(x, (10,), w, 1e-6), args[:2])
    assert torch.autograd.gradcheck(lambda x: ct.layer_norm(x, 10), args[:1])


def test_custom_ops_pass_opcheck():
    x, w, b, dy = inputs((6, 32), 1, torch.float32, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.cupyln.layer_norm_fwd.default, (x, w, b, [32], 1e-5, False))
    torch.library.opcheck(torch.ops.cupyln.rms_norm_fwd.default, (x, w, [32], 1e-6, False))
    _, mean, rstd = torch.ops.cupyln.layer_norm_fwd(x, w, b, [32], 1e-5, False)
    torch.library.opcheck(torch.ops.cupyln.layer_norm_bwd.default,
                          (dy, x, w, mean, rstd, True, True, False, True))


@pytest.fixture(params=[False, True], ids=["traced", "kernels"])
def compiled_kernels(request):
    """Compiled code with the norms traced as torch operations (the default) or calling
    cupyln's kernels (ct.compiled_kernels(True)); the setting restored after."""
    kept = ct.compiled_kernels()
    ct.compiled_kernels(request.param)
    torch._dynamo.reset()
    yield request.param
    ct.compiled_kernels(kept)
    torch._dynamo.reset()


def _graph_ops(fn, *args):
    """The names of the operations of the forward and backward graphs that torch.compile makes
    of ``fn`` (aot_eager), after one forward and backward."""
    from torch._dynamo.backends.common import aot_autograd

    names = []

    def keep(gm, _):
        names.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True,
                             backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(*args).sum().backward()
    return names


@pytest.mark.parametrize("deterministic", [False, True])
def test_compiled_code_traces_the_norms_unless_kernels_are_asked_for(compiled_kernels,
                                                                      deterministic):
    """By default torch.compile sees the norms as torch operations (no cupyln op in its
    graphs), which Inductor fuses with their neighbours; with compiled_kernels(True), or a
    deterministic call, it calls cupyln's ops, forward and backward."""
    x, w, b, _ = inputs((4, 16, 64), 1, torch.float32, torch.float32, "cpu")
    r = torch.randn(4, 16, 64, requires_grad=True)

    def block(x, w, b, r):
        y = ct.layer_norm(x, 64, w, b, deterministic=deterministic)
        y, h = ct.add_rms_norm(y, r, 64, w, weight_offset=1.0, deterministic=deterministic)
        return y + h

    ops = _graph_ops(block, *(t.requires_grad_() for t in (x, w, b)), r)
    ours = [n for n in ops if n.startswith("cupyln.")]
    if compiled_kernels or deterministic:
        assert {n.split(".")[1] for n in ours} == {"layer_norm_fwd", "layer_norm_bwd",
                                                   "add_rms_norm_fwd", "rms_norm_bwd"}
    else:
        assert ours == [] and "aten.rsqrt.default" in ops


def test_compiled_kernels_takes_a_bool():
    with pytest.raises(TypeError, match="bool"):
        ct.compiled_kernels(1)
    assert ct.compiled_kernels() is False


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float16)], ids=str)
def test_traced_norms_match_the_kernels_values_and_gradients(dtype, wdtype):
    """The traced norms (Inductor) against the eager calls (the kernels' contract; on the CPU
    the NumPy path): y, h and every gradient within the dtype's rounding, for LayerNorm,
    RMSNorm with Gemma's weight offset and the fused add into a float32 residual stream."""
    torch._dynamo.reset()
    x, w, b, dy = inputs((3, 5, 96), 1, dtype, wdtype, "cpu")
    r = torch.randn(3, 5, 96, dtype=torch.float32)

    def block(x, r, w, b):
        y = ct.layer_norm(x, 96, w, b, eps=1e-5)
        y2, h = ct.add_rms_norm(y, r, 96, w, weight_offset=1.0, residual_dtype=torch.float32)
        return torch.cat([y, y2, h.to(dtype)])

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (x, r, w, b)]
        out = fn(*leaves)
        out.backward(torch.cat([dy, dy, dy]))
        return [out, *(t.grad for t in leaves)]

    got, want = run(torch.compile(block, fullgraph=True)), run(block)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)


def test_traced_norms_refuse_what_the_kernels_refuse():
    """Under torch.compile a call the kernels would refuse is refused, not computed: a weight
    of another 16-bit dtype, a normalized shape that is not x's, a negative eps (fullgraph:
    torch reports the exception the trace met)."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    calls = [(lambda: ct.layer_norm(x, 64, torch.ones(64, dtype=torch.float16)),
              "weight has dtype torch.float16"),
             (lambda: ct.rms_norm(x, 32), "is not the trailing shape"),
             (lambda: ct.rms_norm(x, 64, eps=-1.0), "eps must be finite")]
    for call, message in calls:
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(call, fullgraph=True, backend="aot_eager")()


def test_torch_compile_fullgraph_without_graph_breaks(compiled_kernels):
    x, w, b, _ = inputs((4, 16, 64), 1, torch.float32, torch.float32, "cpu")

    def block(x, w, b):
        return ct.rms_norm(ct.layer_norm(x, (64,), w, b) * 2.0, (64,), w).sum()

    explained = torch._dynamo.explain(block)(x, w, b)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    out = compiled(*leaves)
    out.backward()
    want = block(*[t.detach().requires_grad_() for t in (x, w, b)])
    assert torch.allclose(out, want)


def _reduce_overhead_steps(model, fused, xs):
    """Loss and parameter gradients of each step of ``model`` (Linear, norm, norm of y + h)
    under torch.compile(mode="reduce-overhead"), in the training loop cudagraph trees expect
    (a compiled call after the backward starts a new step); copies, as replays overwrite."""
    def forward(x):
        h = model[0](x)
        y = model[1](h)
        y = model[2](y, h)[0] if fused else model[2](y + h)
        return y.square().mean()

    compiled = torch.compile(forward, mode="reduce-overhead")
    out = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        loss = compiled(x)
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    return out


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
def test_reduce_overhead_captures_the_norms_in_its_cuda_graphs(fused, compiled_kernels):
    """torch.compile(mode="reduce-overhead") runs cupyln's ops inside its CUDA graphs, forward
    and backward: inductor skips no graph for them, and replayed steps give the loss and
    gradients of torch's norms in the same loop. (Where torch's own norms fail the loop, the
    loop is torch's problem: skipped with its message.)"""
    from torch._dynamo.utils import counters

    def make(norm, last):
        torch.manual_seed(0)
        return torch.nn.ModuleList([torch.nn.Linear(256, 256), norm(256), last(256)]).cuda()

    xs = [torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(s))
          for s in range(4)]
    ref = make(torch.nn.LayerNorm, torch.nn.RMSNorm)
    ours = make(ct.LayerNorm, ct.FusedAddRMSNorm if fused else ct.RMSNorm)
    ours.load_state_dict(ref.state_dict())
    torch._dynamo.reset()
    try:
        want = _reduce_overhead_steps(ref, False, xs)
    except RuntimeError as e:
        pytest.skip(f"torch's own norms fail this loop: {str(e).splitlines()[0][:200]}")
    torch._dynamo.reset()
    counters.clear()
    got = _reduce_overhead_steps(ours, fused, xs)
    assert counters["inductor"]["cudagraph_skips"] == 0
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-4)
        for a, b in zip(grads, want_grads, strict=True):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)


def test_modules_are_drop_in():
    ref = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32),
                              torch.nn.RMSNorm([4, 32], eps=1e-5),
                              torch.nn.LayerNorm(32, bias=False, elementwise_affine=True))
    ours = torch.nn.Sequential(ct.LayerNorm(32), torch.nn.Linear(32, 32),
                               ct.RMSNorm([4, 32], eps=1e-5),
                               ct.LayerNorm(32, bias=False, elementwise_affine=True))
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 32)
    assert torch.allclose(ours(x), ref(x), atol=1e-5)
    assert isinstance(ours[0], torch.nn.LayerNorm) and isinstance(ours[2], torch.nn.RMSNorm)


def test_replace_norms_swaps_in_place_and_keeps_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Sequential(
        torch.nn.LayerNorm(16), torch.nn.RMSNorm(16)))
    weight = model[1][0].weight
    x = torch.randn(5, 16)
    want = model(x)
    assert ct.replace_norms(model, deterministic=True) is model
    assert type(model[1][0]) is ct.LayerNorm and type(model[1][1]) is ct.RMSNorm
    assert model[1][0].weight is weight and model[1][0].deterministic
    assert torch.allclose(model(x), want, atol=1e-5)
    assert "cupyln.torch.LayerNorm((16,)" in repr(model) and "cupyln.torch.RMSNorm((16,)" in repr(model)


def test_no_weight_gradient_without_weight_and_none_where_not_required():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8)  # not requiring grad
    y = ct.layer_norm(x, (8,), w, None)
    (dx,) = torch.autograd.grad(y.sum(), (x,))
    assert dx.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_without_grad_the_forward_runs_without_autograd(monkeypatch, device, context):
    """Under no_grad / inference_mode the forwards give what they give with autograd (y, and h
    for the fused add), and no autograd.Function is applied (nothing to record)."""
    x, w, b, _ = inputs((6, 40), 1, torch.float32, torch.float32, device)
    r, w = torch.randn_like(x), w.requires_grad_()
    calls = [lambda: ct.layer_norm(x, (40,), w, b), lambda: ct.rms_norm(x, (40,), w),
             lambda: ct.add_layer_norm(x, r, (40,), w, b), lambda: ct.add_rms_norm(x, r, (40,), w)]
    expect = [call() for call in calls]  # (recorded: w requires grad)
    monkeypatch.setattr(torch.autograd.Function, "apply",
                        classmethod(lambda *a: pytest.fail("autograd.Function.apply")))
    for eager in (ct._LayerNorm, ct._RMSNorm, ct._AddLayerNorm, ct._AddRMSNorm):
        monkeypatch.setattr(eager, "recorded", lambda *a: pytest.fail("apply's C++ part"))
    with getattr(torch, context)():
        for call, want in zip(calls, expect, strict=True):
            got = call()
            for g, e in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,))),
                            strict=True):
                assert torch.equal(g, e) and not g.requires_grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_has_level", [True, False])
def test_a_forward_mode_tangent_is_refused_not_dropped(monkeypatch, device, torch_has_level):
    """Forward-mode AD, with or without grad mode: the norms carry no tangent, so a dual input
    is refused (NotImplementedError) rather than its tangent dropped. Where torch lacks the
    private level the check reads, every call takes apply: the same refusal, and calls without
    a tangent still give their values."""
    import types

    import torch.autograd.forward_ad as fwad

    if not torch_has_level:
        monkeypatch.setattr(ct, "_FORWARD_AD", types.SimpleNamespace())
    x, w, b, dy = inputs((6, 40), 1, torch.float32, torch.float32, device)
    with torch.no_grad():
        want = ct.layer_norm(x, (40,), w, b)
        torch.testing.assert_close(want, F.layer_norm(x, (40,), w, b))
    with fwad.dual_level():
        dual = fwad.make_dual(x, dy)
        for grad in (True, False):
            with torch.set_grad_enabled(grad), pytest.raises(NotImplementedError, match="jvp"):
                ct.layer_norm(dual, (40,), w, b)


def test_with_grad_the_function_is_applied_past_torchs_python_wrapper(monkeypatch):
    """With gradients recorded and no functorch transform active, the forwards apply their
    autograd.Function through its C++ part, not torch's Python ``apply``; the gradients are
    torch.nn.functional's."""
    x, w, b, dy = inputs((6, 40), 1, torch.float64, torch.float64, "cpu")
    r = torch.randn_like(x)
    want = [grads(lambda x, w, b: F.layer_norm(x, (40,), w, b), x, w, b, dy),
            grads(lambda x, w, _: F.rms_norm(x, (40,), w, 1e-6), x, w, None, dy),
            grads(lambda x, w, b: F.layer_norm(x + r, (40,), w, b), x, w, b, dy)]
    monkeypatch.setattr(torch.autograd.Function, "apply",
                        classmethod(lambda *a: pytest.fail("autograd.Function.apply")))
    got = [grads(lambda x, w, b: ct.layer_norm(x, (40,), w, b), x, w, b, dy),
           grads(lambda x, w, _: ct.rms_norm(x, (40,), w, 1e-6), x, w, None, dy),
           grads(lambda x, w, b: ct.add_layer_norm(x, r, (40,), w, b)[0], x, w, b, dy)]
    for g, e in zip(got, want, strict=True):
        assert all(rel_err(a, c) < TOL[torch.float64] for a, c in zip(g, e, strict=True))


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_deterministic_module_is_bitwise_repeatable():
    norm = ct.LayerNorm(4096, deterministic=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3000, 4096, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        norm.zero_grad()
        norm(x).float().square().sum().backward()
        runs.append((norm.weight.grad.clone(), norm.bias.grad.clone()))
    for w, b in runs[1:]:
        assert torch.equal(w, runs[0][0]) and torch.equal(b, runs[0][1])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_non_contiguous_and_non_default_stream():
    x, w, b, dy = inputs((64, 2048), 1, torch.float16, torch.float32, "cuda")
    xt = x.t().contiguous().t()  # column-major: the copy path
    xs = torch.cat([x, x], 1)[:, 1000:3048]  # rows of a wider buffer, misaligned
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for xin in (xt, xs):
            got = grads(lambda x, w, b: ct.layer_norm(x, (2048,), w, b), xin, w, b, dy)
            want = grads(lambda x, w, b: F.layer_norm(x, (2048,), w, b),
                         *(t.double() for t in (xin, w, b, dy)))
            for a, r in zip(got, want, strict=True):
                assert rel_err(a, r) <= TOL[a.dtype]
    s.synchronize()


def test_stream_protocol_over_a_torch_stream_that_lacks_it():
    """What CuPy's Stream.from_external reads: version 0 and the stream's handle."""
    stream = type("OldTorchStream", (), {"cuda_stream": 0x5EED})()
    assert ct._Protocol(stream).__cuda_stream__() == (0, 0x5EED)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cupy_stream_is_torchs_current_stream_without_deprecation():
    """The CuPy stream the slow path launches on wraps torch's current stream, made without
    CuPy's deprecated ExternalStream."""
    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        on_s = ct._stream(dev)
    assert on_s.ptr == s.cuda_stream
    assert ct._stream(dev).ptr == torch.cuda.current_stream(dev).cuda_stream
    with torch.cuda.stream(s):
        assert ct._stream(dev) is on_s


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    model = torch.nn.Sequential(ct.LayerNorm(1024), torch.nn.Linear(1024, 1024),
                                ct.RMSNorm(1024)).cuda()
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile, plan, fill the pools) outside the capture
        for _ in range(3):
            model(x).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    # captured on the warm-up stream: CuPy's pool, which holds cupyln's scratch, reuses memory
    # per stream, and a capture may not allocate new memory
    with torch.cuda.graph(graph, stream=s):
        out = model(x).square().mean()
        out.backward()
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.data.copy_(torch.randn_like(x))
        model.zero_grad(set_to_none=False)
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.nn.Sequential(torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 1024),
                                  torch.nn.RMSNorm(1024)).cuda()
        ref.load_state_dict(model.state_dict())
        want = ref(x.detach()).square().mean()
        assert torch.allclose(out, want, rtol=1e-4)
        want.backward()
        assert torch.allclose(model[0].weight.grad, ref[0].weight.grad, rtol=1e-3, atol=1e-5)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_autocast_bfloat16_with_float32_weights():
    norm = ct.LayerNorm(768).cuda()
    ref = torch.nn.LayerNorm(768).cuda()
    lin = torch.nn.Linear(768, 768).cuda()
    x = torch.randn(64, 768, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = lin(x)  # bfloat16 under autocast
        y = norm(h)
        want = ref(h)
    assert h.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    assert rel_err(y, want) <= TOL[torch.bfloat16]


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_training_loss_curves_agree_with_torch(norm):
    """300 AdamW steps of two pre-norm blocks, torch's norms against cupyln's (same init and
    data): the loss curves agree within 2% of the initial loss at every step, and both fall."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import train_torch

    c = train_torch.curves(norm)
    ours, ref = c["cupyln"], c["torch"]
    assert ours[-1] < 0.9 * ours[0] and ref[-1] < 0.9 * ref[0]
    worst = max(abs(a - b) for a, b in zip(ours, ref, strict=True))
    assert worst <= 0.02 * ref[0], worst


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("op", ["ln", "rms", "add_ln", "add_rms"])
def test_repeated_calls_launch_their_prepared_pass(op):
    """A call's second run of the same signature launches its prepared pass on the tensors'
    addresses (cupyln.torch's table holds it), with the first run's values bitwise (forward and
    deterministic backward); a tensor of that signature at an address the pass's vectors do not
    suit takes the general path and is still right."""
    M, N = 37, 4096
    base, w, b, dy = inputs((M * N + 1,), 1, torch.bfloat16, torch.float32, "cuda")
    w, b, dy = w[:N].contiguous(), b[:N].contiguous(), dy[: M * N].view(M, N)
    aligned, shifted = base[: M * N].view(M, N), base[1:].view(M, N)  # 2 bytes off: scalars
    r = torch.flip(aligned, (0,)).contiguous()

    def run(x):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        xx, ww, bb = leaves
        if op == "ln":
            y = ct.layer_norm(xx, (N,), ww, bb, deterministic=True)
        elif op == "rms":
            y = ct.rms_norm(xx, (N,), ww, deterministic=True)
        elif op == "add_ln":
            y = sum(ct.add_layer_norm(xx, r, (N,), ww, bb, deterministic=True))
        else:
            y = sum(ct.add_rms_norm(xx, r, (N,), ww, deterministic=True))
        wrt = leaves if op.endswith("ln") else leaves[:2]
        return (y, *torch.autograd.grad(y, wrt, dy))

    ct._PREPARED.clear()
    first = run(aligned)
    kept = len(ct._PREPARED)
    assert kept == 2  # the forward's and the backward's
    for _ in range(2):
        assert all(torch.equal(a, c) for a, c in zip(run(aligned), first, strict=True))
    assert len(ct._PREPARED) == kept
    want = run(aligned.clone())  # the same values at an aligned address
    got = run(shifted.copy_(aligned.clone()))
    assert all(rel_err(a, c) < 1e-2 for a, c in zip(got, want, strict=True))


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_prepared_calls_from_a_thread_without_a_current_context():
    """A prepared call from a thread on which no CUDA context is current yet (as the autograd
    engine's device thread, whose first CUDA work may be cupyln's launch) launches, with the
    main thread's values bitwise."""
    x, w, b, dy = inputs((64, 1024), 1, torch.float16, torch.float16, "cuda")
    x.requires_grad_()

    def run():
        y = ct.layer_norm(x, (1024,), w, b)
        return y, torch.autograd.grad(y, x, dy)[0]

    run()  # the first call prepares the passes
    want, got = run(), []
    thread = threading.Thread(target=lambda: got.extend(run()))
    thread.start()
    thread.join()
    assert len(got) == 2 and all(torch.equal(a, c) for a, c in zip(got, want, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_private_accessors_have_public_fallbacks(monkeypatch, device):
    """Without torch's private current-stream and functorch accessors, calls take the public
    paths (``torch.cuda.current_stream``, ``Function.apply``) and give the same values."""
    x, w, b, dy = inputs((6, 40), 1, torch.float32, torch.float32, device)

    def fn(*a):
        return ct.layer_norm(a[0], (40,), a[1], a[2], deterministic=True)

    want = grads(fn, x, w, b, dy)
    monkeypatch.setattr(ct, "_CURRENT_RAW_STREAM", None)
    monkeypatch.setattr(ct, "_FUNCTORCH_ACTIVE", lambda: True)
    monkeypatch.setattr(ct, "_NATIVE", None)  # the Python layer, where both are read
    applied = []
    real = ct._LayerNorm.apply
    monkeypatch.setattr(ct._LayerNorm, "apply", lambda *a: applied.append(1) or real(*a))
    got = grads(fn, x, w, b, dy)
    assert applied
    for g, h in zip(got, want, strict=True):
        assert torch.equal(g, h)
    if device == "cuda":
        assert ct._raw_stream(0) == torch.cuda.current_stream(0).cuda_stream


def test_unsupported_tensor_dtype_is_named():
    with pytest.raises(TypeError, match="got torch.int32"):
        ct.layer_norm(torch.ones(2, 4, dtype=torch.int32), 4)


@pytest.mark.parametrize("call,name", [
    (lambda a, t: ct.LayerNorm(4)(a), "x"),
    (lambda a, t: ct.RMSNorm(4)(a), "x"),
    (lambda a, t: ct.layer_norm(t, 4, a), "weight"),
    (lambda a, t: ct.layer_norm(t, 4, None, a), "bias"),
    (lambda a, t: ct.add_rms_norm(t, a, 4), "residual"),
    (lambda a, t: ct.FusedAddLayerNorm(4)(a, t), "x"),
])
def test_a_non_tensor_is_a_type_error_naming_the_argument(call, name):
    import numpy as np

    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got ndarray$"):
        call(np.ones((2, 4), np.float32), torch.ones(2, 4))


# --------------------------------------------------------------------------- fused residual add


ADD_CASES = [  # shape, x dtype, residual (and h) dtype, weight dtype
    ((4, 7, 64), torch.float32, torch.float32, torch.float32),
    ((33, 1000), torch.float16, torch.float16, torch.float32),
    ((2, 8, 3000), torch.bfloat16, torch.float32, torch.float32),
    ((5, 4096), torch.float64, torch.float64, torch.float64),
    ((6, 512), torch.bfloat16, torch.float32, torch.bfloat16),  # 16-bit weights, float32 h
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("shape,dt,hdt,wdt", ADD_CASES)
def test_fused_add_matches_torch_add_then_norm(device, op, shape, dt, hdt, wdt):
    """(y, h) and the gradients of x, residual, weight and bias, against torch's add (rounded
    to h's dtype) then norm in float64, with gradients arriving on both y and h."""
    x, w, b, dy = inputs(shape, 1, dt, wdt, device)
    g = torch.Generator().manual_seed(5)
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(hdt).to(device)
    dh = (0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(hdt).to(device)
    n = shape[-1]
    b = b if op == "ln" else None
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    if op == "ln":
        y, h = ct.add_layer_norm(*leaves[:2], n, *leaves[2:], residual_dtype=hdt)
    else:
        y, h = ct.add_rms_norm(*leaves[:2], n, leaves[2], 1e-6, residual_dtype=hdt)
    assert (y.dtype, h.dtype) == (dt, hdt)
    wrt = [t for t in leaves if t is not None]
    ours = (y, h, *torch.autograd.grad((y, h), wrt, (dy, dh)))
    up = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    href = (up[0] + up[1]).to(hdt).double()  # h as stored, then its norm
    href = up[0] + up[1] + (href - (up[0] + up[1])).detach()  # its rounding, without gradient
    yref = (F.layer_norm(href, (n,), up[2], up[3]) if op == "ln"
            else F.rms_norm(href, (n,), up[2], 1e-6))
    want = (yref, href, *torch.autograd.grad((yref, href), [t for t in up if t is not None],
                                             (dy.double(), dh.double())))
    for i, (a, ref_) in enumerate(zip(ours, want, strict=True)):
        assert rel_err(a, ref_) <= TOL[a.dtype], i


def test_fused_add_and_offset_gradcheck_in_float64():
    x, w, b, _ = inputs((3, 4, 10), 1, torch.float64, torch.float64, "cpu")
    r = torch.randn(3, 4, 10, dtype=torch.float64)
    args = [t.requires_grad_() for t in (x, r, w, b)]
    assert torch.autograd.gradcheck(
        lambda x, r, w, b: ct.add_layer_norm(x, r, 10, w, b, weight_offset=0.5), args)
    assert torch.autograd.gradcheck(
        lambda x, r, w: ct.add_rms_norm(x, r, 10, w, 1e-6, weight_offset=1.0), args[:3])
    assert torch.autograd.gradcheck(
        lambda x, w: ct.rms_norm(x, 10, w, 1e-6, weight_offset=1.0), [args[0], args[2]])


def test_fused_add_ops_pass_opcheck():
    x, w, b, _ = inputs((6, 32), 1, torch.bfloat16, torch.float32, "cpu")
    r = torch.randn(6, 32)
    torch.library.opcheck(torch.ops.cupyln.add_layer_norm_fwd.default,
                          (x, r, w, b, [32], 1e-5, torch.float32, 0.0, False))
    torch.library.opcheck(torch.ops.cupyln.add_rms_norm_fwd.default,
                          (x, r.bfloat16(), w, [32], 1e-6, None, 1.0, False))


def test_fused_add_under_torch_compile_without_graph_breaks(compiled_kernels):
    x, w, _, _ = inputs((4, 16, 64), 1, torch.float32, torch.float32, "cpu")
    r = torch.randn(4, 16, 64)

    def block(x, r, w):
        y, h = ct.add_rms_norm(x, r, 64, w, weight_offset=1.0)
        return (y * 2.0 + h).sum()

    explained = torch._dynamo.explain(block)(x, r, w)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().requires_grad_() for t in (x, r, w)]
    compiled(*leaves).backward()
    eager = [t.detach().requires_grad_() for t in (x, r, w)]
    block(*eager).backward()
    for a, e in zip(leaves, eager, strict=True):
        assert torch.allclose(a.grad, e.grad, rtol=1e-5, atol=1e-6)


def test_fused_add_modules_and_gemma_offset():
    """The fused-add modules keep torch's parameters and state_dict keys; RMSNorm with
    weight_offset=1.0 starts from zero weights and computes what torch's RMSNorm with weights
    of ones does (Gemma's (1 + w))."""
    assert list(ct.FusedAddLayerNorm(32).state_dict()) == list(torch.nn.LayerNorm(32)
                                                               .state_dict())
    assert list(ct.FusedAddRMSNorm(32).state_dict()) == list(torch.nn.RMSNorm(32).state_dict())
    gemma = ct.RMSNorm(32, eps=1e-6, weight_offset=1.0)
    assert not gemma.weight.detach().any()
    x, r = torch.randn(5, 32), torch.randn(5, 32)
    want = torch.nn.RMSNorm(32, eps=1e-6)(x + r)
    y, h = ct.FusedAddRMSNorm(32, eps=1e-6, weight_offset=1.0)(x, r)
    assert torch.allclose(h, x + r) and torch.allclose(y, want, atol=1e-5)
    assert torch.allclose(gemma(x), torch.nn.RMSNorm(32, eps=1e-6)(x), atol=1e-5)
