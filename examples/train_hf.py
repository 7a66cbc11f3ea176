"""Train a small Hugging Face model (random, from a config: no download) with its own norms and
with cupyln's (``cupyln.torch.patch``), from the same weights on the same tokens, and compare the
losses. On a GPU in bfloat16; on a CPU (the NumPy path) in float32.

    python examples/train_hf.py [--model llama|qwen3|gemma3] [--steps 50]
"""

import argparse
import copy

import torch
import transformers

import cupyln.torch as ct

MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
          "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def make(name):
    conf, cls = MODELS[name]
    config = getattr(transformers, conf)(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=128)
    torch.manual_seed(0)
    return getattr(transformers, cls)(config)


def train(model, tokens, steps):
    """The loss at each step of next-token prediction on ``tokens``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    stock = make(a.model).to(device, dtype)
    patched = copy.deepcopy(stock)
    report = ct.patch(patched)
    print(f"{a.model}: {len(report.swapped)} norm modules swapped"
          + (f", left alone: {report.left}" if report.left else ""))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (4, 64), generator=g).to(device)
    want, got = train(stock, tokens, a.steps), train(patched, tokens, a.steps)
    gap = max(abs(x - y) for x, y in zip(want, got, strict=True))
    print(f"loss {want[0]:.4f} -> {want[-1]:.4f} (stock), {got[0]:.4f} -> {got[-1]:.4f} (cupyln); "
          f"largest gap at any step {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
