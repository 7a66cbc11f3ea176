"""Whether the kernels compile to the same code as at another revision, no GPU needed.

    python benchmarks/tools/same_code.py BASE [--arch compute_90 compute_80] [--hip gfx90a]
                                        [--kernels norm_bwd,norm_bwd_add]

Every kernel the default config builds (the working tree's names, those of the templates named
by --kernels, all by default) is compiled from the kernel sources at git revision BASE and from
the working tree: with NVRTC to PTX for each --arch (what ptxas would be given) and with hipcc
to AMDGPU assembly for each --hip target. For each template it prints how many kernels compile
to the same text. Block labels are renumbered and a function-local static variable goes by its
own name (its mangled owner changes when code moves into a helper). A refactor that leaves every
kernel the same changes nothing a GPU run could see. Exits 1 where any kernel differs; kernels
that BASE cannot instantiate are counted apart, as new.
"""

import argparse
import collections
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

from cupyln import _compile
from cupyln._plan import all_kernel_names


def _static(m):
    """A mangled function-local static (_ZZ <owner> E <length> <name>) as its own name."""
    name = m.group(0)
    for tail in re.finditer(r"E(\d+)", name):  # the E<length><name> whose length is the rest's
        rest = name[tail.end():]
        if rest and len(rest) == int(tail.group(1)):
            return f"static_{rest}"
    return name


def _normal(text):
    text = re.sub(r"\$L__BB\d+_", "$L__BB_", text)  # PTX block labels
    text = re.sub(r"__local_depot\d+", "__local_depot", text)  # numbered in program order
    text = re.sub(r"\.LBB\d+_", ".LBB_", text)  # AMDGPU block labels
    return re.sub(r"_ZZ\w+", _static, text)


def _git_reader(rev):
    def read(name):  # cupyln/kernels/, or kernels/ at revisions before the move
        for folder in ("cupyln/kernels", "kernels"):
            r = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], capture_output=True,
                               text=True)
            if r.returncode == 0:
                return r.stdout
        raise FileNotFoundError(f"{name} at {rev}")
    return read


def _ptx(text, names, arch):
    """{name expression: its entry's PTX} from one NVRTC program of ``names``."""
    ptx = []
    lowered = _compile.compile_nvrtc(names, arch, text=text, ptx=ptx)
    entries = {m.group(1): m.group(0)
               for m in re.finditer(r"\.entry (\w+)\(.*?\n}\n", ptx[0], flags=re.S)}
    # the entry's own name (and its parameters', which carry it) as one word: an added template
    # parameter with its default changes the name alone
    return {n: _normal(entries[lowered[n]].replace(lowered[n], "KERNEL")) for n in names}


def _amdgpu(text, names, arch):
    """{mangled symbol: its assembly} from one hipcc compile of ``names``."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.hip"), os.path.join(tmp, "k.s")
        with open(src, "w") as f:
            f.write(_compile.hip_source(names, text))
        subprocess.run(["hipcc", "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only",
                        "-O3", *_compile.OPTIONS, "-S", src, "-o", out], check=True,
                       capture_output=True, env=dict(os.environ, HIP_PLATFORM="amd"))
        with open(out) as f:
            asm = f.read()
    code = {m.group(1): m.group(0)
            for m in re.finditer(r"^(_Z\w+):.*?^\.Lfunc_end\d+:", asm, flags=re.S | re.M)}
    # with each kernel's descriptor and metadata (registers, shared memory, launch bound)
    for m in re.finditer(r"\.amdhsa_kernel (\w+)\n.*?\.end_amdhsa_kernel", asm, flags=re.S):
        code[m.group(1)] = code.get(m.group(1), "") + m.group(0)
    for entry in re.split(r"\n  - ", asm.split("amdhsa.kernels:", 1)[-1])[1:]:
        entry = entry.split("\namdhsa.", 1)[0]  # the last entry: not the target lines after it
        name = re.search(r"\.name:\s+(\w+)", entry)
        if name:
            code[name.group(1)] = code.get(name.group(1), "") + entry
    return {k: _normal(v) for k, v in code.items()}


def defined_in(text, names):
    """The ``names`` whose template ``text`` defines (a kernel added since BASE is not)."""
    return [n for n in names if re.search(rf"\b{_template(n)}\s*\(", text)]


def instantiable(text, names):
    """The ``names`` that ``text`` defines and can instantiate (NVRTC's front end): a kernel,
    or a template argument, added since BASE is not."""
    names = defined_in(text, names)
    while True:
        try:
            _compile.compile_nvrtc(names, "compute_90", text=text, syntax_only=True)
            return names
        except RuntimeError as e:
            bad = {re.sub(r"\s", "", n)
                   for n in re.findall(r'Input name expression was: "(.*?)"', str(e))}
            if not bad:
                raise
            names = [n for n in names if re.sub(r"\s", "", n) not in bad]


def _template(key):
    """The template of a name expression (norm_bwd<...>) or a mangled symbol (_Z8norm_bwdI...)."""
    mangled = re.match(r"_Z(\d+)", key)
    if mangled:
        start = mangled.end()
        return key[start:start + int(mangled.group(1))]
    return re.match(r"\w+", key).group(0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="git revision whose kernels are compared")
    ap.add_argument("--arch", nargs="*", default=["compute_90", "compute_80"])
    ap.add_argument("--hip", nargs="*", default=[], help="AMDGPU targets, e.g. gfx90a gfx1030")
    ap.add_argument("--kernels", default="", help="template names, comma-separated (all)")
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.kernels.split(",")))
    texts = (_compile.translation_unit(_git_reader(args.base)), _compile.source())
    jobs = [(_ptx, a, 32, a != "compute_80", False) for a in args.arch]
    jobs += [(_amdgpu, a, 32 if a.startswith("gfx10") else 64, False, True) for a in args.hip]
    differ = False
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # NVRTC and hipcc free the GIL
        for build, arch, warp, clusters, hip in jobs:
            names = sorted(n for n in all_kernel_names(warp, clusters=clusters, hip=hip)
                           if not wanted or _template(n) in wanted)
            old = instantiable(texts[0], names)
            base, new = pool.map(build, texts, (old, names), (arch,) * 2)
            counts = collections.defaultdict(lambda: [0, 0])
            added = collections.Counter(_template(k) for k in new.keys() - base.keys())
            for key in base.keys():
                c = counts[_template(key)]
                c[0] += 1
                c[1] += base[key] == new.get(key)
            for template, (n, same) in sorted(counts.items()):
                print(f"{arch} {template}: {same} of {n} the same")
                differ |= same < n
            for template, n in sorted(added.items()):
                print(f"{arch} {template}: {n} new (not in {args.base})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
