#!/usr/bin/env bash
# Mutation check of the property tests: plant each known bug into a copy of the reference and
# list the reference tests that catch it. Usage: bash tests/plant_bugs.sh [python]
set -u
py=${1:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
plant() {  # name, old text, new text
  local work
  work=$(mktemp -d)
  cp -r "$root/cupyln" "$root/kernels" "$root/tests" "$root/pyproject.toml" "$work/"
  "$py" - "$work/cupyln/reference.py" "$2" "$3" <<'PY'
import sys
p, old, new = sys.argv[1:]
s = open(p).read()
assert old in s, f"pattern not found: {old!r}"
open(p, "w").write(s.replace(old, new))
PY
  echo "=== planted: $1"
  (cd "$work" && "$py" -m pytest -q -p no:cacheprovider tests/test_reference.py 2>&1 \
    | grep -E "^FAILED|passed|failed" | sed 's/ - .*//')
  rm -rf "$work"
}
plant "variance with N-1" \
  "var = (xc * xc).mean(axis=1)" "var = (xc * xc).sum(axis=1) / (x2.shape[1] - 1)"
plant "eps dropped from rstd in backward" \
  "    r = np.asarray(rstd, dtype=np.float64).reshape(-1, 1)
    xc = x2 if mean is None else x2 - np.asarray(mean, dtype=np.float64).reshape(-1, 1)" \
  "    xc = x2 if mean is None else x2 - np.asarray(mean, dtype=np.float64).reshape(-1, 1)
    r = 1.0 / np.sqrt((xc * xc).mean(axis=1, keepdims=True))"
plant "mean(g) term dropped from dx" \
  "        inner = inner - g.mean(axis=1, keepdims=True)" "        inner = inner"
plant "dbeta summed over the wrong axis" \
  "    dbeta = dy2.sum(axis=0).reshape(norm_shape)" "    dbeta = dy2.sum(axis=1)"
