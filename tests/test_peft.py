"""LoRA (PEFT) on KbitLinear: wrapping, training, merging, saving and reloading (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

import kbit_linear  # noqa: E402
from kbit_linear.integrations.peft import KbitLoraLinear, load_adapter, register_lora_layers  # noqa: E402


class _Block(nn.Module):
    """Two projections and a head, the shape of a transformer MLP with its output."""

    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(96, 160, bias=False)
        self.down_proj = nn.Linear(160, 96, bias=True)
        self.head = nn.Linear(96, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down_proj(torch.relu(self.up_proj(x)))))


def _model(bits: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = _Block()
    kbit_linear.quantize_model(model, bits=bits, skip=["head"], progress=False)
    return model


def _lora(model: nn.Module, **kw) -> "peft.PeftModel":
    config = register_lora_layers(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj", "down_proj"], **kw))
    return peft.get_peft_model(model, config)


def test_lora_wraps_kbit_layers_and_starts_at_the_base_output():
    base = _model()
    x = torch.randn(5, 96)
    ref = base(x)
    model = _lora(base)
    for name in ("up_proj", "down_proj"):
        layer = model.base_model.model.get_submodule(name)
        assert isinstance(layer, KbitLoraLinear) and isinstance(layer.get_base_layer(), kbit_linear.KbitLinear)
    torch.testing.assert_close(model(x), ref)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_training_moves_only_the_adapter_and_lowers_the_loss():
    model = _lora(_model())
    frozen = {n: b.clone() for n, b in model.named_buffers()} | {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    torch.manual_seed(1)
    x, target = torch.randn(64, 96), torch.randn(64, 10)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    for n, t in list(model.named_buffers()) + [(n, p) for n, p in model.named_parameters() if not p.requires_grad]:
        assert torch.equal(t, frozen[n]), f"{n} changed"


def _trained(model: "peft.PeftModel") -> "peft.PeftModel":
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def test_merge_and_unload_gives_a_dense_model_with_the_same_outputs():
    model = _trained(_lora(_model()))
    x = torch.randn(7, 96)
    with torch.no_grad():
        ref = model(x)
    merged = model.merge_and_unload()
    assert isinstance(merged.up_proj, nn.Linear) and not isinstance(merged.up_proj, kbit_linear.KbitLinear)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), ref, rtol=1e-4, atol=1e-5)
    # and it quantizes again like any dense model
    kbit_linear.quantize_model(merged, bits=4, skip=["head"], progress=False)
    assert isinstance(merged.up_proj, kbit_linear.KbitLinear)


def test_unmerge_restores_the_kbit_layer_bit_for_bit():
    model = _trained(_lora(_model()))
    layer = model.base_model.model.up_proj
    kbit = layer.get_base_layer()
    packed = kbit.weight.detach().clone()
    x = torch.randn(3, 96)
    with torch.no_grad():
        ref = model(x)
        model.merge_adapter()
        assert isinstance(layer.get_base_layer(), nn.Linear)
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
        model.unmerge_adapter()
        assert layer.get_base_layer() is kbit and torch.equal(kbit.weight, packed)
        torch.testing.assert_close(model(x), ref)


def test_adapter_save_and_reload_give_identical_outputs(tmp_path):
    model = _trained(_lora(_model()))
    x = torch.randn(4, 96)
    with torch.no_grad():
        ref = model(x)
    model.save_pretrained(tmp_path)
    reloaded = load_adapter(_model(), tmp_path)
    assert isinstance(reloaded.base_model.model.down_proj, KbitLoraLinear)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), ref, rtol=0, atol=0)


def test_prepare_model_for_kbit_training_and_gradient_flow_to_the_input():
    model = peft.prepare_model_for_kbit_training(_model(), use_gradient_checkpointing=False)
    model = _lora(model)
    x = torch.randn(2, 96, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_all_linear_needs_the_model_and_spells_out_kbit_layers():
    model = _model()
    with pytest.raises(ValueError, match="all-linear"):
        register_lora_layers(peft.LoraConfig(target_modules="all-linear"))
    config = register_lora_layers(peft.LoraConfig(r=2, target_modules="all-linear"), model)
    assert config.target_modules == {"up_proj", "down_proj", "head"}  # a plain module: no output embedding to leave out
    peft_model = peft.get_peft_model(model, config)
    assert isinstance(peft_model.base_model.model.up_proj, KbitLoraLinear)


def test_dora_is_refused_and_bad_config_named():
    with pytest.raises(ValueError, match="DoRA"):
        _lora(_model(), use_dora=True)
    with pytest.raises(TypeError, match="LoraConfig"):
        register_lora_layers({"r": 4})
