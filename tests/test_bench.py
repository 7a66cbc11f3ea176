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
