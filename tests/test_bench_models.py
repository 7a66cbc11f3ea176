"""The whole-step benchmark's pieces that need no GPU: its models and its plot."""

import pytest

torch = pytest.importorskip("torch")
from cupyln import bench_models as bm  # noqa: E402


@pytest.mark.parametrize("name", [n for n, c in bm.CONFIGS.items()
                                  if isinstance(c, bm.StackConfig)])
def test_stacks_hold_the_norms_the_provider_gives(name):
    cfg = bm.CONFIGS[name]._replace(d=64, layers=2)
    model = bm.build(torch, cfg, torch.nn.LayerNorm if cfg.norm == "layernorm"
                     else torch.nn.RMSNorm)
    kind = torch.nn.LayerNorm if cfg.norm == "layernorm" else torch.nn.RMSNorm
    assert sum(isinstance(m, kind) for m in model.modules()) == 2 * cfg.layers + 1
    y = model(torch.randn(2, 8, 64))
    assert y.shape == (2, 8, 64)


@pytest.mark.parametrize("name", [n for n, c in bm.CONFIGS.items()
                                  if isinstance(c, bm.HFConfig)])
def test_hugging_face_configs_build_and_patch(name):
    pytest.importorskip("transformers")
    import cupyln.torch as ct

    cfg = bm.CONFIGS[name]._replace(d=256, layers=1)
    report = ct.patch(bm.hf_model(torch, cfg))
    assert report.swapped and not report.left


def test_plot_draws_each_config_against_torch(tmp_path):
    pytest.importorskip("matplotlib")
    steps = [{"config": c, "provider": p, "compiled": comp, "ms": ms}
             for c in ("gpt-512x6", "llama-2048x4") for comp in (False, True)
             for p, ms in (("torch", 6.0), ("cupyln", 5.5), ("liger", 9.0))]
    path = tmp_path / "steps.png"
    bm.plot(steps, path)
    assert path.stat().st_size > 10_000
