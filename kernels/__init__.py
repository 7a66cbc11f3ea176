"""CUDA/HIP C sources of cupyln, shipped inside the wheel (read with importlib.resources)."""
