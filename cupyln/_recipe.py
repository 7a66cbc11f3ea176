"""A prepared pass as data: which addresses it checks, which scratch it addresses, and each
launch's arguments as slots of one table. The CuPy path runs it here; cupyln.torch's native
layer runs the same data from C++ (:meth:`Recipe.native`). Imports nothing of CuPy.

The slot table of a call is its pointers (in the pass's order, 0 for None), then the scratch
buffers (the call's scratch address plus each offset), then the zeroed buffers (the stream's
zeroed memory plus each offset), then the constants.
"""

from __future__ import annotations

from operator import itemgetter


class Slot:
    """A slot of the table, numbered when the recipe is built: ``kind`` is "scratch", "zeroed"
    or "const", ``k`` its place among its kind."""

    __slots__ = ("kind", "k")

    def __init__(self, kind, k):
        self.kind, self.k = kind, k


class Builder:
    """Collects a recipe: ``ptrs`` names the pointers of a call, in order."""

    def __init__(self, ptrs):
        self.ptrs = {n: i for i, n in enumerate(ptrs)}
        self.checks, self.same16, self.launches = [], [], []
        self.values = {"scratch": [], "zeroed": [], "const": []}

    def _slot(self, kind, v):
        self.values[kind].append(v)
        return Slot(kind, len(self.values[kind]) - 1)

    def const(self, v):
        return self._slot("const", v)

    def scratch(self, offset):
        """The call's scratch address plus ``offset``; the constant 0 for None."""
        return self.const(0) if offset is None else self._slot("scratch", offset)

    def zeroed(self, offset):
        """The stream's zeroed memory plus ``offset``; the constant 0 for None."""
        return self.const(0) if offset is None else self._slot("zeroed", offset)

    def aligned(self, names, mask):
        """Each named pointer has no bit of ``mask`` set (the plan's vector alignment)."""
        if mask:
            self.checks += [(self.ptrs[n], mask) for n in names]

    def alike(self, a, b):
        """Pointer ``b`` (unless 0) starts at the same offset within 16 bytes as ``a``."""
        self.same16.append((self.ptrs[a], self.ptrs[b]))

    def launch(self, launcher, args):
        self.launches.append((launcher, args))

    def build(self, scratch_bytes, zeroed_bytes=0):
        n = len(self.ptrs)
        first = {"scratch": n}
        first["zeroed"] = n + len(self.values["scratch"])
        first["const"] = first["zeroed"] + len(self.values["zeroed"])

        def index(a):
            return self.ptrs[a] if isinstance(a, str) else first[a.kind] + a.k

        launches = tuple((ln, tuple(map(index, args))) for ln, args in self.launches)
        return Recipe(n, tuple(self.checks), tuple(self.same16), tuple(self.values["scratch"]),
                      tuple(self.values["zeroed"]), tuple(self.values["const"]), launches,
                      scratch_bytes, zeroed_bytes)


class Recipe:
    __slots__ = ("nptrs", "checks", "same16", "scratch", "zeroed", "consts", "launches",
                 "scratch_bytes", "zeroed_bytes", "_get")

    def __init__(self, nptrs, checks, same16, scratch, zeroed, consts, launches, scratch_bytes,
                 zeroed_bytes):
        self.nptrs, self.checks, self.same16 = nptrs, checks, same16
        self.scratch, self.zeroed, self.consts = scratch, zeroed, consts
        self.launches, self.scratch_bytes, self.zeroed_bytes = launches, scratch_bytes, \
            zeroed_bytes
        self._get = [(ln, itemgetter(*idx)) for ln, idx in launches]

    def suits(self, ptrs):
        """Whether the pointers meet the checks (else the pass cannot run on them)."""
        for i, m in self.checks:
            if ptrs[i] & m:
                return False
        for i, j in self.same16:
            if ptrs[j] and (ptrs[i] ^ ptrs[j]) & 15:
                return False
        return True

    def run(self, stream, ptrs, base, zero):
        """Launch on ``stream``: ``base`` the call's scratch, ``zero`` the zeroed memory."""
        table = (*ptrs, *[base + o for o in self.scratch], *[zero + o for o in self.zeroed],
                 *self.consts)
        for launcher, get in self._get:
            launcher(stream, *get(table))

    def native(self):
        """The recipe as plain values for the C++ layer: (pointers, checks, same16, scratch
        offsets, zeroed offsets, consts, scratch bytes, zeroed bytes, launches), a launch being
        (CUfunction address, grid, block, shared bytes, cooperative, argument kinds, slots)."""
        launches = [(ln.kern.kernel.ptr, ln.grid, ln.block, ln.smem, ln.cooperative, ln.kinds,
                     idx) for ln, idx in self.launches]
        return (self.nptrs, list(self.checks), list(self.same16), list(self.scratch),
                list(self.zeroed), list(self.consts), self.scratch_bytes, self.zeroed_bytes,
                launches)
