"""LoRA (PEFT) on KbitLinear: wrapping, training, merging, saving and reloading (CPU)."""

from __future__ import annotations

import copy
import json

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


def test_merging_an_adapter_that_skips_a_layer_leaves_that_layer_alone():
    # "b" targets up_proj only: merging it (or both, "b" first) once raised KeyError in down_proj
    model = _trained(_lora(_model()))
    model.add_adapter("b", register_lora_layers(peft.LoraConfig(r=2, target_modules=["up_proj"], init_lora_weights=False)))
    model.base_model.set_adapter(["b", "default"])
    down = model.base_model.model.down_proj
    x = torch.randn(3, 96)
    with torch.no_grad():
        ref = model(x)
        model.merge_adapter(["b"])
        assert isinstance(down.get_base_layer(), kbit_linear.KbitLinear) and not down.merged
        model.unmerge_adapter()
        model.merge_adapter()  # both, "b" first
        assert isinstance(down.get_base_layer(), nn.Linear) and down.merged_adapters == ["default"]
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
        model.unmerge_adapter()
        assert isinstance(down.get_base_layer(), kbit_linear.KbitLinear)
        torch.testing.assert_close(model(x), ref)


def _bias_free_bfloat16_lora() -> "peft.PeftModel":
    """A bfloat16 block whose down_proj has no bias, quantized, with a trained adapter."""
    torch.manual_seed(0)
    base = _Block().to(torch.bfloat16)
    base.down_proj.bias = None
    kbit_linear.quantize_model(base, bits=4, skip=["head"], progress=False)
    return _trained(_lora(base))


def test_a_merge_that_fails_leaves_the_kbit_layer_in_place():
    """PEFT refuses to merge a LoRA bias into a bias-free base: the layer keeps its kbit base (a
    dense copy was left in its place before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    kbit_linear.quantize_model(model, bits=4, progress=False)
    peft_model = peft.get_peft_model(model, register_lora_layers(peft.LoraConfig(r=4, target_modules=["0"], lora_bias=True)))
    layer = peft_model.base_model.model[0]
    kbit = layer.get_base_layer()
    with pytest.raises(RuntimeError):
        peft_model.merge_adapter()
    assert layer.get_base_layer() is kbit and not layer.merged and layer._quantized_base is None


def test_a_bias_free_bfloat16_model_merges_in_bfloat16():
    # the adapter is float32 (PEFT upcasts it): the merged copy of a layer without a bias was float32,
    # and the merged bfloat16 model failed with a dtype mismatch
    model = _bias_free_bfloat16_lora()
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        merged = model.merge_and_unload()
        assert merged.up_proj.weight.dtype == merged.down_proj.weight.dtype == torch.bfloat16
        torch.testing.assert_close(merged(x), ref, rtol=2e-2, atol=2e-2)


def test_merge_with_no_forward_before_it_gives_the_models_dtype():
    # the common flow: load (or quantize) a bfloat16 model, add or load an adapter, merge_and_unload
    # at once. With no forward to tell the input dtype, a bias-free layer was merged in the
    # adapter's float32, and the merged bfloat16 model failed with a dtype mismatch.
    model = _bias_free_bfloat16_lora()
    ref_model = copy.deepcopy(model)
    merged = model.merge_and_unload()  # no forward on this model before
    assert merged.up_proj.weight.dtype == merged.down_proj.weight.dtype == torch.bfloat16
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), ref_model(x), rtol=2e-2, atol=2e-2)


def test_fan_in_fan_out_is_turned_off_as_for_nn_linear():
    # a square layer merged a transposed update without a word
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64))
    kbit_linear.quantize_model(base, bits=4, progress=False)
    config = register_lora_layers(peft.LoraConfig(r=4, target_modules=["0"], fan_in_fan_out=True))
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        model = _trained(peft.get_peft_model(base, config))
    assert model.base_model.model[0].fan_in_fan_out is False
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(model.merge_and_unload()(x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw,name", [
    ({"init_lora_weights": "olora"}, "init_lora_weights"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
    ({"init_lora_weights": "corda"}, "init_lora_weights"),
    ({"init_lora_weights": "mica"}, "init_lora_weights"),
    ({"init_lora_weights": "orthogonal"}, "init_lora_weights"),
    ({"kasa_config": "kasa"}, "kasa_config"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_options_that_need_the_dense_base_weight_are_refused_by_name(kw, name):
    if kw.get("kasa_config") == "kasa":
        if not hasattr(peft, "KasaConfig"):
            pytest.skip("this PEFT has no KaSA")
        kw = {"kasa_config": peft.KasaConfig()}
    base = _model()
    packed = base.up_proj.weight.detach().clone()
    with pytest.raises(ValueError, match=name):
        _lora(base, **kw)
    assert torch.equal(base.up_proj.weight, packed)


def test_a_second_adapter_is_checked_too():
    model = _lora(_model())
    with pytest.raises(ValueError, match="DoRA"):
        model.add_adapter("b", register_lora_layers(peft.LoraConfig(r=2, target_modules=["up_proj"], use_dora=True)))


def test_all_linear_for_a_second_adapter_names_the_layers_not_their_parts():
    base = _model()
    model = peft.get_peft_model(base, register_lora_layers(peft.LoraConfig(r=2, target_modules="all-linear"), base))
    for target in (model, model.base_model.model):
        config = register_lora_layers(peft.LoraConfig(r=2, target_modules="all-linear"), target)
        assert config.target_modules == {"up_proj", "down_proj", "head"}
    model.add_adapter("b", config)
    assert all("b" in model.base_model.model.get_submodule(n).lora_A for n in ("up_proj", "down_proj", "head"))


def test_an_adapter_saved_with_a_base_weight_initialisation_is_refused_with_the_way_out(tmp_path):
    # a PiSSA adapter trained on the dense model, saved as is: loading it would run PiSSA again on the base
    model = _trained(_lora(_model()))
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["init_lora_weights"] = "pissa_niter_4"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa_niter_4'.*init_lora_weights=True.*path_initial_model"):
        load_adapter(_model(), tmp_path)
    config["init_lora_weights"] = True  # what PEFT's own PiSSA example saves
    config_file.write_text(json.dumps(config))
    assert isinstance(load_adapter(_model(), tmp_path).base_model.model.down_proj, KbitLoraLinear)


def test_load_adapter_reads_the_config_from_the_subfolder(tmp_path):
    model = _trained(_lora(_model()))
    x = torch.randn(4, 96)
    with torch.no_grad():
        ref = model(x)
    model.save_pretrained(tmp_path / "sub")
    reloaded = load_adapter(_model(), tmp_path, subfolder="sub")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), ref, rtol=0, atol=0)
