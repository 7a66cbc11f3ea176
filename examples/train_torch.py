"""Train a small pre-norm transformer with torch.nn's norms and with cupyln.torch's, from the
same initialization on the same data, and compare the loss curves.

    python examples/train_torch.py [--steps 300] [--norm LayerNorm|RMSNorm] [--plot curves.png]
"""

import argparse
import json
import sys

import torch

F = torch.nn.functional


class Block(torch.nn.Module):
    """A pre-norm transformer block (attention + MLP), its norms made by ``norm(d)``."""

    def __init__(self, d, norm):
        super().__init__()
        self.n1, self.n2 = norm(d), norm(d)
        self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


def train(norm, steps=300, seed=0, device="cuda"):
    """Loss per step of two blocks fit to a fixed random target (the same data for every norm)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Block(128, norm), Block(128, norm),
                                torch.nn.Linear(128, 128)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(16, 64, 128, device=device, generator=g)
    target = torch.randn(16, 64, 128, device=device, generator=g)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def curves(norm="LayerNorm", steps=300, device="cuda"):
    """{"torch": [...], "cupyln": [...]} loss curves of ``norm``."""
    import cupyln.torch as ct

    return {"torch": train(getattr(torch.nn, norm), steps, device=device),
            "cupyln": train(getattr(ct, norm), steps, device=device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--norm", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    ap.add_argument("--json", help="write the curves here")
    ap.add_argument("--plot", help="PNG of the curves (needs matplotlib)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_torch.py needs a CUDA GPU (cupyln.torch runs CPU tensors on NumPy)")
    c = curves(a.norm, a.steps)
    worst = max(abs(p - q) for p, q in zip(c["cupyln"], c["torch"], strict=True))
    print(f"{a.norm}, {a.steps} steps: loss {c['torch'][0]:.4f} -> torch {c['torch'][-1]:.4f}, "
          f"cupyln {c['cupyln'][-1]:.4f}; largest gap {worst:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(c, f)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, ys in c.items():
            ax.plot(ys, label=name, lw=1)
        ax.set(xlabel="step", ylabel="MSE loss", yscale="log", title=f"{a.norm}: torch vs cupyln")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
