"""cupyln.torch.patch on Hugging Face transformers' models: tiny random-initialised models (a
config, no download) patched against their stock copies, logits and parameter gradients; what
is left alone and why. On the CPU (the NumPy path); marked `gpu`, on CUDA too."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("cupyln.torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
               max_position_embeddings=64, head_dim=16)
# family: (config class, model class, config keywords, the norm class names it holds)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER, {"LlamaRMSNorm"}),
    "mistral": ("MistralConfig", "MistralForCausalLM", DECODER, {"MistralRMSNorm"}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DECODER, {"Qwen2RMSNorm"}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", DECODER, {"Qwen3RMSNorm"}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", DECODER, {"GemmaRMSNorm"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", DECODER, {"Gemma2RMSNorm"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", DECODER, {"Gemma3RMSNorm"}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**DECODER, "pad_token_id": 0}, {"Phi3RMSNorm"}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", DECODER, {"OlmoLayerNorm"}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", DECODER, {"Olmo2RMSNorm"}),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=128),
           {"T5LayerNorm"}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64), set()),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=128, max_position_embeddings=64), set()),
    "vit": ("ViTConfig", "ViTForImageClassification",
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, image_size=32, patch_size=8), set()),
}


def tiny(family, dtype=torch.float32, device="cpu"):
    """The family's tiny model, random, its norm weights moved off their init value."""
    conf, cls, kw, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.to(device, dtype)


def inputs(family, device):
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g).to(device)}
    ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
    kw = {"input_ids": ids}
    if family == "t5":
        kw["decoder_input_ids"] = ids[:, :7]
    return kw


def logits_and_grads(model, kw):
    model.zero_grad()
    out = model(**{k: v for k, v in kw.items()}).logits
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def rel(a, b, floor=1e-30):
    """max |a - b| / max(max |b|, floor)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_matches_the_stock_model(family, device):
    stock = tiny(family, device=device)
    model = copy.deepcopy(stock)
    report = ct.patch(model)
    names = {type(m).__name__ for m in stock.modules()}
    norms = [n for n, m in stock.named_modules()
             if type(m).__name__ in FAMILIES[family][3] | {"LayerNorm", "RMSNorm"}]
    assert set(report.swapped) == set(norms) and norms and not report.left, report
    assert FAMILIES[family][3] <= names
    kw = inputs(family, device)
    want, want_g = logits_and_grads(stock, kw)
    got, got_g = logits_and_grads(model, kw)
    assert rel(got, want) < 1e-4
    assert set(got_g) == set(want_g)
    # a gradient that is zero but for rounding (attention's key bias) is measured against the
    # model's largest gradient
    floor = 1e-3 * max(float(g.abs().max()) for g in want_g.values())
    for n in want_g:
        assert rel(got_g[n], want_g[n], floor) < 2e-3, n
    assert model.state_dict().keys() == stock.state_dict().keys()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_patched_bfloat16_logits_within_bfloat16_rounding(family, device):
    stock = tiny(family, torch.bfloat16, device)
    model = copy.deepcopy(stock)
    ct.patch(model)
    kw = inputs(family, device)
    with torch.no_grad():
        assert rel(model(**kw).logits, stock(**kw).logits) < 5e-2


def test_qwen3_head_norms_take_the_4d_view_without_a_copy(monkeypatch):
    model = tiny("qwen3")
    ct.patch(model)
    seen = []
    real = ct._norm

    def spy(x, *a):
        seen.append((tuple(x.shape), x.is_contiguous()))
        return real(x, *a)

    monkeypatch.setattr(ct, "_norm", spy)
    with torch.no_grad():
        model(**inputs("qwen3", "cpu"))
    assert (2, 12, 4, 16) in {s for s, _ in seen} and all(c for _, c in seen)


def test_parameters_keys_and_loading_stay():
    stock = tiny("llama")
    model = copy.deepcopy(stock)
    weight = model.model.norm.weight
    ct.patch(model)
    assert model.model.norm.weight is weight
    assert isinstance(model.model.norm, type(stock.model.norm))
    assert repr(model.model.norm).startswith("cupyln.torch(LlamaRMSNorm)((64,), eps=1e-06)")
    model.load_state_dict(stock.state_dict())
    assert ct.patch(model) == ({}, {})  # a second patch finds nothing to do


def test_patch_after_from_pretrained_and_save_pretrained_round_trip(tmp_path):
    stock = tiny("gemma3")
    stock.save_pretrained(tmp_path / "stock")
    model = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "stock")
    ct.patch(model)
    model.save_pretrained(tmp_path / "patched")
    again = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "patched")
    for (n, a), (_, b) in zip(stock.state_dict().items(), again.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), n


def test_meta_device_model_patched_before_its_weights():
    conf, cls, kw, _ = FAMILIES["llama"]
    with torch.device("meta"):
        model = getattr(transformers, cls)(getattr(transformers, conf)(**kw))
    report = ct.patch(model)
    assert len(report.swapped) == 5 and not report.left
    stock = tiny("llama")
    model.to_empty(device="cpu")
    model.load_state_dict(stock.state_dict())
    for name, b in stock.named_buffers():  # those no state_dict holds (rotary frequencies)
        model.get_buffer(name).copy_(b)
    model.eval()
    kw = inputs("llama", "cpu")
    with torch.no_grad():
        assert rel(model(**kw).logits, stock(**kw).logits) < 1e-4


def test_a_subclass_with_another_forward_is_left_alone_and_reported():
    base = type(tiny("llama").model.norm)

    class ShiftedRMSNorm(base):
        def forward(self, x):
            return super().forward(x) + 1.0

    class UnitRMSNorm(torch.nn.Module):  # named like a norm, computes something else
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            return x / x.abs().amax(-1, keepdim=True) * self.weight

    model = torch.nn.Sequential(ShiftedRMSNorm(64), UnitRMSNorm(), base(64))
    report = ct.patch(model)
    assert set(report.left) == {"0", "1"} and set(report.swapped) == {"2"}
    assert "computes differently" in report.left["0"]
    assert type(model[0]) is ShiftedRMSNorm and type(model[1]) is UnitRMSNorm


def test_another_dtype_than_the_weights_runs_the_stock_forward():
    stock = tiny("llama").model.norm
    norm = copy.deepcopy(stock)
    ct.patch(torch.nn.Sequential(norm))
    x = torch.randn(3, 64, dtype=torch.bfloat16)  # float32 weight: torch's promotion, as stock
    assert torch.equal(norm(x), stock(x)) and norm(x).dtype == torch.float32


def test_the_example_trains_as_the_stock_model(capsys):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    try:
        import train_hf
    finally:
        sys.path.pop(0)
    assert train_hf.main(["--model", "qwen3", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "qwen3: 9 norm modules swapped" in out  # 2 layers x (2 + q_norm, k_norm) + final
    gap = float(out.rsplit("largest gap at any step ", 1)[1])
    assert gap < 1e-4
