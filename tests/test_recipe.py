"""A prepared pass as data (cupyln._recipe): slots resolved in the table's order, the pointer
checks, the launches' arguments, and the plain values the C++ layer reads. No GPU needed."""

from typing import NamedTuple

import pytest

from cupyln._recipe import Builder


class _Kernel(NamedTuple):
    ptr: int


class _RawKernel(NamedTuple):
    kernel: _Kernel


class _Launcher:
    """What a recipe reads of a launcher, recording its calls."""

    def __init__(self, kinds, fn=0xF00, cooperative=False):
        self.kern, self.kinds, self.cooperative = _RawKernel(_Kernel(fn)), kinds, cooperative
        self.grid, self.block, self.smem = (4, 2, 1), (256, 1, 1), 1024
        self.calls = []

    def __call__(self, stream, *args):
        self.calls.append((stream, args))


def _recipe():
    b = Builder(("x", "y", "h"))
    b.aligned(("x", "y"), 15)
    b.alike("x", "h")
    first, second = _Launcher("pipf"), _Launcher("ppi", fn=0xBEEF, cooperative=True)
    b.launch(first, ["x", b.scratch(256), "y", b.const(1e-5)])
    b.launch(second, [b.zeroed(4), b.zeroed(None), b.const(7)])
    return b.build(scratch_bytes=512, zeroed_bytes=300), first, second


def test_slots_resolve_in_the_tables_order():
    r, first, second = _recipe()
    assert r.suits((4096, 8192, 0))
    r.run(99, (4096, 8192, 0), 1 << 20, 1 << 24)
    assert first.calls == [(99, (4096, (1 << 20) + 256, 8192, 1e-5))]
    assert second.calls == [(99, ((1 << 24) + 4, 0, 7))]  # None: the constant 0


@pytest.mark.parametrize("ptrs,ok", [
    ((4096, 8192, 0), True),
    ((4096 + 2, 8192, 0), False),  # x off its 16-byte vectors
    ((4096, 8192 + 8, 0), False),
    ((4096, 8192, 4096 + 64), True),  # h alike within 16 bytes
    ((4096, 8192, 4096 + 66), False),
])
def test_checks(ptrs, ok):
    r, _, _ = _recipe()
    assert r.suits(ptrs) == ok


def test_native_values_are_what_the_cpp_layer_reads():
    r, _, _ = _recipe()
    nptrs, checks, same16, scratch, zeroed, consts, sbytes, zbytes, launches = r.native()
    assert (nptrs, checks, same16) == (3, [(0, 15), (1, 15)], [(0, 2)])
    assert (scratch, zeroed, sbytes, zbytes) == ([256], [4], 512, 300)
    assert consts == [1e-5, 0, 7] and isinstance(consts[0], float) and isinstance(consts[2], int)
    assert launches == [(0xF00, (4, 2, 1), (256, 1, 1), 1024, False, "pipf", (0, 3, 1, 5)),
                        (0xBEEF, (4, 2, 1), (256, 1, 1), 1024, True, "ppi", (4, 6, 7))]
    for (_, _, _, _, _, kinds, idx) in launches:  # one slot per argument
        assert len(kinds) == len(idx)
