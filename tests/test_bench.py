"""The benchmark's interleaved timing, checked on the CPU (device_samples replaced)."""

import re
import sys

import pytest

bench = pytest.importorskip("cupyln.bench", exc_type=ImportError)  # needs CuPy installed


def test_providers_take_turns_and_a_failing_one_is_left_out(monkeypatch):
    order = []

    def fake_samples(fn, n_warmup=10, n_repeat=100, spin_cycles=600_000):
        order.append(fn.__name__)
        fn()
        return [float(len(order))] * n_repeat

    def a():
        pass

    def b():
        pass

    def broken():
        raise RuntimeError("cannot run this shape")

    monkeypatch.setattr(bench, "device_samples", fake_samples)
    monkeypatch.setattr(bench, "ROUNDS", 3)
    out = bench.interleaved_us({"a": a, "b": b, "broken": broken})
    # every round times each provider once, in turn; the failing one only in the first round
    assert order == ["a", "b", "broken", "a", "b", "a", "b"]
    assert out["a"] == 4.0 and out["b"] == 5.0  # medians of (1, 4, 6) and (2, 5, 7)
    assert isinstance(out["broken"], RuntimeError)


def _script(name):
    """A module of benchmarks/ or benchmarks/tools/ (the scripts import CuPy)."""
    pytest.importorskip("cupy")
    import importlib.util
    import pathlib

    top = pathlib.Path(__file__).parent.parent / "benchmarks"
    folder = top if (top / f"{name}.py").exists() else top / "tools"
    if str(folder) not in sys.path:  # the scripts import each other, as when run from there
        sys.path.insert(0, str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_leave_out_removes_exactly_the_forward_reductions():
    leave_out = _script("leave_out")
    from cupyln import _compile

    src = _compile.source()
    out = leave_out.without_reductions(src)
    assert not any(call in out for call in leave_out.REDUCTIONS)
    assert len(src) - len(out) == sum(map(len, leave_out.REDUCTIONS))
    with pytest.raises(RuntimeError, match="not in the source"):
        leave_out.without_reductions(out)


def test_same_code_tells_a_changed_kernel_from_the_same(monkeypatch, capsys):
    """The refactor check compiles both sources and finds the one kernel whose launch bound
    changed (its PTX's .maxntid), and no difference where the sources are the same."""
    same_code = _script("same_code")
    from cupyln import _compile

    text = "template <int N> __global__ void norm_a(int n) {}"  # a kernel added since BASE
    assert same_code.defined_in(text, ["norm_a<1>", "norm_ab<2>", "norm_b<3>"]) == ["norm_a<1>"]
    monkeypatch.setattr(same_code, "_git_reader", lambda rev: _compile._read)  # base: this tree
    args = ["BASE", "--arch", "compute_80", "--kernels", "norm_bwd_rowsums_merge"]
    assert same_code.main(args) == 0
    assert "compute_80 norm_bwd_rowsums_merge: 2 of 2 the same" in capsys.readouterr().out
    src = _compile.source()
    bound = src.rindex("__launch_bounds__(1024)", 0, src.index("norm_bwd_rowsums_merge("))
    changed = src[:bound] + src[bound:].replace("(1024)", "(512)", 1)
    monkeypatch.setattr(_compile, "source", lambda: changed)
    assert same_code.main(args) == 1
    assert "compute_80 norm_bwd_rowsums_merge: 0 of 2 the same" in capsys.readouterr().out


def test_spills_reads_ptxas_report_and_tells_what_changed(monkeypatch, capsys):
    """The spill report reads each kernel's registers from ptxas, and with --base names the
    kernels that a launch bound of 8 blocks of 256 threads (32 registers a thread) squeezed."""
    spills = _script("spills")
    from cupyln import _compile

    args = ["--arch", "sm_80", "--kernels", "norm_bwd_reduce_cols", "--all"]
    assert spills.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"norm_bwd_reduce_cols<double, double>: (\d+) registers, 0 B stack, 0/0 B",
                     out)
    assert "norm_bwd_reduce_cols: 0 of 4 spill" in out
    monkeypatch.setattr(spills, "_git_reader", lambda rev: _compile._read)  # base: this tree
    src = _compile.source()
    bound = src.rindex("__launch_bounds__(256)", 0, src.index("norm_bwd_reduce_cols("))
    changed = src[:bound] + src[bound:].replace("(256)", "(256, 8)", 1)
    monkeypatch.setattr(_compile, "source", lambda: changed)
    assert spills.main([*args, "--base", "BASE"]) == 0
    out = capsys.readouterr().out
    now = re.search(r"changed norm_bwd_reduce_cols<double, double>:\n  BASE: (\d+) registers.*"
                    r"\n  now: (\d+) registers", out)
    assert now and int(now.group(2)) <= 32 < int(now.group(1)), out


def test_the_fused_add_runs_on_the_list_and_the_sweeps_odd_lengths():
    shapes = bench.load_shapes()
    runs = bench.jobs(shapes, bench.SWEEP)
    assert [s for s, _ in runs[: len(shapes)]] == shapes and all(a for _, a in runs[: len(shapes)])
    sweep = runs[len(shapes):]
    assert {s for s, _ in sweep} == set(bench.SWEEP) - set(shapes)
    assert all(add == (s[2] in bench.ODD_N) for s, add in sweep) and any(a for _, a in sweep)


def test_plot_draws_the_sweep_with_its_odd_lengths(tmp_path):
    """The plot's three panels from a result holding the sweep's rows, odd lengths included
    (their rows peeled or in single elements, drawn apart from the powers of two)."""
    pytest.importorskip("matplotlib")
    assert all(n % 2 == 1 for n in bench.ODD_N)
    assert {(op, n) for op, _, n, _ in bench.SWEEP if n in bench.ODD_N} == \
        {(op, n) for op in ("layernorm", "rmsnorm") for n in bench.ODD_N}
    rows = [{"provider": prov, "pass": p, "op": op, "M": M, "N": N, "dtype": dt,
             "GBs": 1000.0 + N % 997}
            for op, M, N, dt in bench.SWEEP for prov in ("cupyln", "torch")
            for p in ("fwd", "bwd")]
    path = tmp_path / "plot.png"
    bench.plot({"rows": rows, "copy_GBs": 4000.0}, path)
    assert path.stat().st_size > 10_000


def test_targets_tell_met_from_missed(tmp_path, capsys):
    """A record with one pass at 90% of copy and one at 50% reads met and MISSED, with the
    missed pass named; a target whose rows the record lacks does not read as met."""
    targets = _script("targets")

    def row(op, M, N, p, prov, us, frac):
        return {"op": op, "M": M, "N": N, "dtype": "bfloat16", "pass": p, "provider": prov,
                "us": us, "GBs": 1000.0 * frac}

    rec = {"copy_GBs": 1000.0, "rows": [
        row("layernorm", 65536, 2048, "fwd", "cupyln", 100.0, 0.90),
        row("layernorm", 65536, 2048, "fwd", "torch", 150.0, 0.60),
        row("layernorm", 2048, 65536, "fwd", "cupyln", 100.0, 0.50),
        row("layernorm", 2048, 65536, "fwd", "liger", 90.0, 0.55),
        row("layernorm", 1, 1048576, "fwd", "cupyln", 14.0, 0.1)]}
    path = tmp_path / "rec.json"
    path.write_text(__import__("json").dumps(rec))
    targets.main(str(path))
    out = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert "MISSED" in out["long rows: large passes, forward >= 88% of copy"]
    assert "2048x65536 bfloat16 50.0%" in out["long rows: large passes, forward >= 88% of copy"]
    assert "met" in out["long rows: 1x1048576 bf16 fwd <= 15 us"]
    assert "lacks" in out["long rows: 1x1048576 bf16 bwd <= 20 us"]
    assert "1 missed" in out["long rows: no slower than the best peer (plain passes)"]
