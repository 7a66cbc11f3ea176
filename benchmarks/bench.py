"""The benchmark: same as `python -m cupyln bench` (see cupyln/bench.py and README.md here)."""

import sys

from cupyln.bench import main

if __name__ == "__main__":
    sys.exit(main())
