"""Whole training steps of small pre-norm transformer stacks, with each provider's norms: what a
model sees of a norm's device and host time together.

    python -m cupyln.bench_models [--configs gpt-512x6,...] [--compiled] [--rounds 5]
                                  [--out steps.json]

A step is zero_grad, forward, a mean-square loss, backward and a fused AdamW step, the parameters
in bfloat16; its time is the median of CUDA events around ``STEPS`` steps after ``WARMUP``, the
providers taking turns in ``ROUNDS`` rounds (``--rounds``). The providers' models start from
the same weights. ``cupyln bench`` records these rows under the key ``model_steps``: one per
(config, provider, compiled) with ``ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NamedTuple

WARMUP, STEPS, ROUNDS = 5, 25, 5


class StackConfig(NamedTuple):
    name: str
    norm: str  # "layernorm" (GPT: GELU MLP) or "rmsnorm" (Llama: SwiGLU MLP)
    d: int
    layers: int
    tokens: int
    seq: int


class HFConfig(NamedTuple):
    """A Hugging Face transformers model, random, patched by each provider: cupyln.torch.patch,
    Liger-Kernel's RMSNorm patch of the family (its other kernels off)."""

    name: str
    family: str  # "llama", "qwen3" or "gemma3"
    d: int
    layers: int
    tokens: int
    seq: int


HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                         "apply_liger_kernel_to_gemma3_text")}

CONFIGS = {c.name: c for c in (
    StackConfig("gpt-512x6", "layernorm", 512, 6, 1024, 512),
    StackConfig("gpt-768x12", "layernorm", 768, 12, 8192, 1024),
    StackConfig("gpt-1024x8", "layernorm", 1024, 8, 8192, 1024),
    StackConfig("llama-512x6", "rmsnorm", 512, 6, 1024, 512),
    StackConfig("llama-2048x4", "rmsnorm", 2048, 4, 8192, 1024),
    HFConfig("hf-llama-2048x4", "llama", 2048, 4, 8192, 1024),
    HFConfig("hf-qwen3-1024x8", "qwen3", 1024, 8, 8192, 1024),
    HFConfig("hf-gemma3-1024x8", "gemma3", 1024, 8, 8192, 1024),
)}


def norm_classes(torch, provider):
    """(LayerNorm, RMSNorm) of a provider; None where it cannot be imported."""
    if provider == "torch":
        return torch.nn.LayerNorm, torch.nn.RMSNorm
    if provider == "cupyln":
        import cupyln.torch as ct

        ct._native_wait()  # the C++ layer built before the steps are timed
        return ct.LayerNorm, ct.RMSNorm
    try:
        from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm
    except Exception:
        return None
    return (lambda d: LigerLayerNorm(d)), (lambda d: LigerRMSNorm(d))


def build(torch, cfg: StackConfig, norm_cls):
    nn, F = torch.nn, torch.nn.functional
    heads = max(cfg.d // 128, 1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = norm_cls(cfg.d), norm_cls(cfg.d)
            self.qkv, self.proj = nn.Linear(cfg.d, 3 * cfg.d), nn.Linear(cfg.d, cfg.d)
            if cfg.norm == "layernorm":
                self.up, self.down = nn.Linear(cfg.d, 4 * cfg.d), nn.Linear(4 * cfg.d, cfg.d)
            else:
                hidden = 8 * cfg.d // 3 // 64 * 64
                self.up = nn.Linear(cfg.d, 2 * hidden, bias=False)
                self.down = nn.Linear(hidden, cfg.d, bias=False)

        def mlp(self, x):
            if cfg.norm == "layernorm":
                return self.down(F.gelu(self.up(x)))
            a, b = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(a) * b)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, T, 3, heads, D // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
            return x + self.mlp(self.n2(x))

    return nn.Sequential(*[Block() for _ in range(cfg.layers)], norm_cls(cfg.d))


def stepper(torch, cfg: StackConfig, norm_cls, compiled, state):
    """A training step of ``cfg`` with ``norm_cls`` from weights ``state``, warmed up."""
    torch.manual_seed(0)
    model = build(torch, cfg, norm_cls).to("cuda", torch.bfloat16)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = torch.compile(model) if compiled else model
    x = torch.randn(cfg.tokens // cfg.seq, cfg.seq, cfg.d, device="cuda", dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        run(x).float().square().mean().backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    return step


def hf_model(torch, cfg: HFConfig):
    """The family's model at ``cfg``'s size, random (a config, no download)."""
    import transformers

    conf, cls, _ = HF_CLASSES[cfg.family]
    heads = cfg.d // 128
    config = getattr(transformers, conf)(
        hidden_size=cfg.d, intermediate_size=8 * cfg.d // 3 // 64 * 64,
        num_hidden_layers=cfg.layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=128, vocab_size=8192, max_position_embeddings=cfg.seq)
    torch.manual_seed(0)
    return getattr(transformers, cls)(config)


def hf_stepper(torch, cfg: HFConfig, provider, compiled, state):
    """A training step of the Hugging Face model with ``provider``'s norms, warmed up; None
    where the provider cannot be imported."""
    model = hf_model(torch, cfg)
    model.load_state_dict(state)
    if provider == "cupyln":
        import cupyln.torch as ct

        ct._native_wait()
        ct.patch(model)
    elif provider == "liger":
        try:
            import liger_kernel.transformers as lk

            getattr(lk, HF_CLASSES[cfg.family][2])(
                rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                rms_norm=True, swiglu=False, model=model)
        except Exception:
            return None
    model = model.to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = torch.compile(model) if compiled else model
    ids = torch.randint(0, 8192, (cfg.tokens // cfg.seq, cfg.seq), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    return step


def step_times(torch, step, n):
    """CUDA-event times (ms) of ``n`` steps, each on its own."""
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def rows(configs=tuple(CONFIGS), compiled=(False,), providers=("torch", "cupyln", "liger"),
         rounds=ROUNDS):
    """One row per (config, provider, compiled): ``{config, provider, compiled, ms}``, the
    median of ``rounds`` rounds of ``STEPS // ROUNDS`` steps in which the providers take turns
    (the host's speed drifts)."""
    import torch

    out = []
    for name in configs:
        cfg = CONFIGS[name]
        torch.manual_seed(0)
        hf = isinstance(cfg, HFConfig)
        state = (hf_model(torch, cfg) if hf else build(
            torch, cfg, torch.nn.LayerNorm if cfg.norm == "layernorm" else torch.nn.RMSNorm)
        ).state_dict()
        for comp in compiled:
            steps = {}
            for prov in providers:
                t0 = time.perf_counter()
                if hf:
                    steps[prov] = hf_stepper(torch, cfg, prov, comp, state)
                else:
                    classes = norm_classes(torch, prov)
                    if classes is not None:
                        cls = classes[0] if cfg.norm == "layernorm" else classes[1]
                        steps[prov] = stepper(torch, cfg, cls, comp, state)
                # set up and warmed up (builds and compiles included): where a run stops
                print(f"{name} {'compiled' if comp else 'eager'} {prov}: "
                      f"{'ready' if steps.get(prov) else 'not available'} after "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            steps = {p: st for p, st in steps.items() if st is not None}
            times = {prov: [] for prov in steps}
            for _ in range(rounds):
                for prov, step in steps.items():
                    times[prov] += step_times(torch, step, STEPS // ROUNDS)
            for prov, t in times.items():
                ms = sorted(t)[len(t) // 2]
                out.append({"config": name, "provider": prov, "compiled": comp, "ms": ms})
                print(f"{name:<14} {'compiled' if comp else 'eager':<9} {prov:<8} {ms:8.3f} ms",
                      flush=True)
            steps = None
            torch._dynamo.reset()
    return out


def plot(steps, path):
    """Each config's step time against torch's norms (1.0), eager and compiled, per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = {(r["config"], r["compiled"], r["provider"]): r["ms"] for r in steps}
    groups = sorted({(c, comp) for c, comp, _ in ms}, key=lambda g: (g[1], g[0]))
    providers = [p for p in ("torch", "cupyln", "liger") if any(k[2] == p for k in ms)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 3.5))
    width = 0.8 / len(providers)
    for i, prov in enumerate(providers):
        xs, ys = [], []
        for j, (c, comp) in enumerate(groups):
            if (c, comp, prov) in ms and (c, comp, "torch") in ms:
                xs.append(j + (i - (len(providers) - 1) / 2) * width)
                ys.append(ms[c, comp, prov] / ms[c, comp, "torch"])
        ax.bar(xs, ys, width, label=prov)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{c}\n{'compiled' if comp else 'eager'}" for c, comp in groups],
                       fontsize=7)
    ax.set_ylabel("step time / torch's norms")
    ax.set_title("whole training steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cupyln.bench_models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--compiled", action="store_true", help="torch.compile(model) as well")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"rounds of {STEPS // ROUNDS} steps each provider (default {ROUNDS})")
    ap.add_argument("--out", help="JSON file for the rows")
    ap.add_argument("--plot", help="PNG of the step times against torch's (needs matplotlib)")
    a = ap.parse_args(argv)
    result = rows(a.configs.split(","), (False, True) if a.compiled else (False,),
                  rounds=a.rounds)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
