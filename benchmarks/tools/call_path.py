"""Whether a stack's eager step time with cupyln's norms comes from the calling path or from
the work: whole training steps (``cupyln.bench_models``' stacks, LayerNorm configs) with
torch's LayerNorm, cupyln's, and torch's own LayerNorm kernels called the way cupyln's C++
layer is called (a pybind11 function applying a C++ ``torch::autograd::Function``), the three
taking turns. Builds its probe with torch.utils.cpp_extension (about a minute).

    python benchmarks/tools/call_path.py [--configs gpt-512x6,gpt-768x12] [--rounds 8]
"""

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

import cupyln.bench_models as bm
import cupyln.torch as ct

# torch's native LayerNorm forward and backward, inside a C++ autograd Function
PROBE = r"""
#include <torch/extension.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
struct LN : public torch::autograd::Function<LN> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& w,
                            const c10::optional<at::Tensor>& b, int64_t k, double eps) {
    auto out = at::native_layer_norm(x, x.sizes().slice(x.dim() - k), w, b, eps);
    ctx->save_for_backward({x, w.value_or(at::Tensor()), b.value_or(at::Tensor()),
                            std::get<1>(out), std::get<2>(out)});
    ctx->saved_data["k"] = k;
    return std::get<0>(out);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto s = ctx->get_saved_variables();
    auto k = ctx->saved_data["k"].toInt();
    auto r = at::native_layer_norm_backward(g[0], s[0], s[0].sizes().slice(s[0].dim() - k),
                                            s[3], s[4], s[1], s[2], {true, true, true});
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), at::Tensor(), at::Tensor()};
  }
};
at::Tensor ln(const at::Tensor& x, const c10::optional<at::Tensor>& w,
              const c10::optional<at::Tensor>& b, int64_t k, double eps) {
  return LN::apply(x, w, b, k, eps);
}
"""


def probe_class():
    """torch.nn.LayerNorm whose forward takes the probe's path."""
    ext = load_inline("cupyln_call_path_probe", cpp_sources=[PROBE], functions=["ln"],
                      extra_cflags=["-O2"])

    class ProbeLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return ext.ln(x, self.weight, self.bias, len(self.normalized_shape), self.eps)

    return ProbeLayerNorm


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="gpt-512x6,gpt-768x12",
                    help="LayerNorm stacks of cupyln.bench_models, comma-separated")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of 5 steps each (8)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    classes = {"torch": torch.nn.LayerNorm, "cupyln": ct.LayerNorm,
               "probe (torch's kernels, cupyln's path)": probe_class()}
    ct._native_wait()
    print(f"built in {time.perf_counter() - t0:.0f} s; ms a step, medians", flush=True)
    for name in a.configs.split(","):
        cfg = bm.CONFIGS[name]
        torch.manual_seed(0)
        state = bm.build(torch, cfg, torch.nn.LayerNorm).state_dict()
        steps = {k: bm.stepper(torch, cfg, c, False, state) for k, c in classes.items()}
        times = {k: [] for k in steps}
        for _ in range(a.rounds):
            for k, step in steps.items():
                times[k] += bm.step_times(torch, step, 5)
        print(name, "  ".join(f"{k} {sorted(v)[len(v) // 2]:.3f}" for k, v in times.items()),
              flush=True)
        steps = None


if __name__ == "__main__":
    main()
