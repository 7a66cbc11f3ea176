import os

import pytest
from hypothesis import HealthCheck, settings

# Two hypothesis profiles: `ci` (derandomized, reproducible, >= 200 examples per property) and
# `fuzz` (many more, random). Pick with CUPYLN_HYPOTHESIS_PROFILE=fuzz.
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=200, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz", deadline=None, max_examples=int(os.environ.get("CUPYLN_FUZZ_EXAMPLES", "2000")),
    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("CUPYLN_HYPOTHESIS_PROFILE", "ci"))


def gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def pytest_addoption(parser):
    parser.addoption("--all-kernels", action="store_true",
                     help="compile every kernel specialization for every target (CI runs it; "
                          "about 10 minutes on two cores with -n 2)")


def pytest_collection_modifyitems(config, items):
    skip_compile = pytest.mark.skip(reason="the full compile check: run with --all-kernels")
    if not config.getoption("--all-kernels"):
        for item in items:
            if "all_kernels" in item.keywords:
                item.add_marker(skip_compile)
    n = gpu_count()
    skip_gpu = pytest.mark.skip(reason="needs a GPU (none found)")
    skip_multi = pytest.mark.skip(reason=f"needs two GPUs ({n} found)")
    for item in items:
        if "multi_gpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def plans(monkeypatch):
    """A record of the plans the GPU calls make, and the config they pass (gpu_cases.Plans)."""
    from gpu_cases import Plans

    return Plans(monkeypatch)
