"""The benchmark's interleaved timing, checked on the CPU (device_samples replaced)."""

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


def test_leave_out_removes_exactly_the_forward_reductions():
    pytest.importorskip("cupy")  # the script imports it
    import importlib.util
    import pathlib

    from cupyln import _compile

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "leave_out.py"
    spec = importlib.util.spec_from_file_location("leave_out", path)
    leave_out = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(leave_out)
    src = _compile.source()
    out = leave_out.without_reductions(src)
    assert not any(call in out for call in leave_out.REDUCTIONS)
    assert len(src) - len(out) == sum(map(len, leave_out.REDUCTIONS))
    with pytest.raises(RuntimeError, match="not in the source"):
        leave_out.without_reductions(out)
