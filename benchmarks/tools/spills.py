"""Registers and spills of each kernel, from ptxas through NVRTC, no GPU needed.

    python benchmarks/tools/spills.py [--arch sm_90] [--kernels norm_bwd_resident,norm_fwd]
                                [--base REV] [--all]

Compiles the kernels the default config builds (those of the templates named by --kernels, all by
default) to machine code with ``-Xptxas=-v`` and reads ptxas's report: registers, stack frame,
spill stores and loads. Prints each kernel that spills (every kernel with --all), then per
template how many kernels spill and the most bytes one stores. With --base, the same for the
kernel sources at that git revision, and each kernel whose report differs, before and after
(templates the revision lacks count as new): a kernel change that is meant to remove a spill
shows it here before a GPU run.
"""

import argparse
import collections
import concurrent.futures
import re
import sys

from same_code import _git_reader, _template, instantiable

from cupyln import _compile
from cupyln._plan import all_kernel_names

REPORT = re.compile(
    r"Function properties for (\w+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\n.*?Used (\d+) registers", re.S)


class Usage(collections.namedtuple("Usage", "registers stack spill_stores spill_loads")):
    def __str__(self):
        return (f"{self.registers} registers, {self.stack} B stack, "
                f"{self.spill_stores}/{self.spill_loads} B spilled/reloaded")


def parse(log):
    """{mangled entry: Usage} from a ptxas -v log."""
    return {m.group(1): Usage(int(m.group(5)), int(m.group(2)), int(m.group(3)),
                              int(m.group(4)))
            for m in REPORT.finditer(log)}


def usage(text, names, arch):
    """{name expression: Usage} of ``names`` compiled from ``text`` (None: the working tree)."""
    log = []
    lowered = _compile.compile_nvrtc(names, arch, text=text, log=log,
                                     options=("-Xptxas=-v", "-w"))
    report = parse(log[0])
    return {n: report[lowered[n]] for n in names}


def _halves(names):
    return [names[0::2], names[1::2]]


def report(text, names, arch, pool):
    """usage() over two NVRTC programs at once (NVRTC frees the GIL)."""
    out = {}
    for part in pool.map(lambda half: usage(text, half, arch), _halves(names)):
        out.update(part)
    return out


def _summary(new, print_all):
    per = collections.defaultdict(lambda: [0, 0, 0])
    for name, u in sorted(new.items()):
        c = per[_template(name)]
        c[0] += 1
        c[1] += u.spill_stores > 0
        c[2] = max(c[2], u.spill_stores)
        if print_all or u.spill_stores:
            print(f"{name}: {u}")
    for template, (n, spilling, most) in sorted(per.items()):
        print(f"{template}: {spilling} of {n} spill (at most {most} B)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90", help="an NVRTC machine target (sm_80, sm_90)")
    ap.add_argument("--kernels", default="", help="template names, comma-separated (all)")
    ap.add_argument("--base", help="git revision whose kernels are compared")
    ap.add_argument("--all", action="store_true", help="every kernel, not only those that spill")
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.kernels.split(",")))
    names = sorted(n for n in all_kernel_names(32, clusters=args.arch != "sm_80")
                   if not wanted or _template(n) in wanted)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        new = report(None, names, args.arch, pool)
        _summary(new, args.all)
        if args.base:  # the kernels BASE defines (a template added since is new)
            text = _compile.translation_unit(_git_reader(args.base))
            old = instantiable(text, names)
            base = report(text, old, args.arch, pool)
            changed = [n for n in old if base[n] != new[n]]
            for n in changed:
                print(f"changed {n}:\n  {args.base}: {base[n]}\n  now: {new[n]}")
            print(f"{len(changed)} of {len(old)} kernels' registers or spills changed, "
                  f"{len(names) - len(old)} new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
