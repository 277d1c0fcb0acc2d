"""quantize_model on CPU: a tiny random Llama, skip rules, tied weights, memory release, meta."""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

from kbit_linear import format as fmt
from kbit_linear.linear import KbitLinear
from kbit_linear.patch import (
    QuantizationSummary,
    check_skip_rules,
    convertible_layers,
    dequantize_model,
    is_convertible,
    kbit_placeholder,
    matches_skip,
    module_bytes,
    quantize_model,
    replace_module,
    sibling_groups,
)

transformers = pytest.importorskip("transformers")

LINEARS_PER_BLOCK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _llama(tied: bool, seed: int = 0, device: str | None = None) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=120,  # not a multiple of 64: padded k-tiles in down_proj
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    if device == "meta":
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).eval()
    return transformers.LlamaForCausalLM(cfg).eval()


def _block_names(n_layers: int = 2) -> list[str]:
    return [f"model.layers.{i}.{s}" for i in range(n_layers) for s in LINEARS_PER_BLOCK]


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _dequantized_reference(dense: nn.Module, quantized: nn.Module) -> nn.Module:
    """``dense`` with every converted Linear's weight replaced by its dequantized weight."""
    ref = copy.deepcopy(dense)
    for name, m in quantized.named_modules():
        if isinstance(m, KbitLinear):
            lin = ref.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            with torch.no_grad():
                lin.weight.copy_(m.dequantize())
    return ref


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bits", [2, 4])
def test_llama_logits_match_dequantized_reference(tied, bits):
    model = _llama(tied)
    dense = copy.deepcopy(model)
    ids = torch.randint(0, 160, (2, 11), generator=torch.Generator().manual_seed(1))
    dense_logits = _logits(dense, ids)
    summary = quantize_model(model, bits=bits, progress=False)

    assert isinstance(summary, QuantizationSummary) and summary.bits == bits
    assert summary.converted == _block_names()
    assert list(summary.skipped) == ["lm_head"] and "skip rule 'lm_head'" in summary.skipped["lm_head"]
    for name in _block_names():
        assert isinstance(model.get_submodule(name), KbitLinear)
    assert type(model.lm_head) is nn.Linear
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight

    got = _logits(model, ids)
    ref = _logits(_dequantized_reference(dense, model), ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and the quantization error on the logits is bounded, shrinking with bits
    rel = (got - dense_logits).norm() / dense_logits.norm()
    assert rel < {2: 0.8, 4: 0.2}[bits], rel  # measured ~0.5 and ~0.1 over seeds
    assert not torch.equal(got, dense_logits)


def test_byte_accounting():
    model = _llama(tied=False)
    before = module_bytes(model)
    dense_bytes = sum(model.get_submodule(n).weight.numel() * 4 for n in _block_names())
    summary = quantize_model(model, bits=4, progress=False)
    assert summary.bytes_before == before and summary.bytes_after == module_bytes(model)
    assert summary.converted_bytes_before == dense_bytes
    q_bytes = sum(t.numel() * t.element_size() for n in _block_names() for t in model.get_submodule(n).state_dict().values())
    assert summary.converted_bytes_after == q_bytes
    assert summary.bytes_before - summary.bytes_after == dense_bytes - q_bytes
    text = str(summary)
    assert "14 layers converted" in text and "lm_head" in text


def test_tied_lm_head_is_left_alone_even_without_skip_rules():
    model = _llama(tied=True)
    summary = quantize_model(model, bits=3, skip=None, progress=False)
    assert summary.skipped == {"lm_head": "weight is tied to model.embed_tokens.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = _llama(tied=False)
    summary = quantize_model(untied, bits=3, skip=(), progress=False)
    assert summary.skipped == {} and isinstance(untied.lm_head, KbitLinear)


def test_linears_sharing_a_weight_are_both_skipped():
    a, b = nn.Linear(64, 32), nn.Linear(64, 32)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b, nn.Linear(32, 8))
    summary = quantize_model(model, skip=None, progress=False)
    assert summary.converted == ["3"]
    assert set(summary.skipped) == {"0", "2"} and "tied" in summary.skipped["0"]


def test_a_linear_reused_at_two_places_becomes_one_kbit_layer():
    shared = nn.Linear(48, 48)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 48)
    summary = quantize_model(model, skip=None, progress=False)
    assert summary.converted == ["0", "2"] and model[0] is model[2] and isinstance(model[0], KbitLinear)
    assert torch.equal(model(x), model[0](torch.relu(model[0](x))))


@pytest.mark.parametrize(
    "skip, skipped",
    [
        (["model.layers.0.mlp.up_proj"], {"model.layers.0.mlp.up_proj"}),  # exact
        (["model.layers.1"], {n for n in _block_names() if n.startswith("model.layers.1.")}),  # ancestor
        (["o_proj"], {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}),  # trailing
        (["self_attn.k_proj"], {"model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.k_proj"}),
        (["re:layers\\.0\\.mlp\\.(up|down)_proj"], {"model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}),
        ([re.compile(r"\.v_proj$")], {"model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"}),
        # a single string, matching components in the middle of the names
        ("layers.0.mlp", {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}),
        (["proj"], set()),  # not at a module boundary: matches nothing
    ],
    ids=["exact", "ancestor", "trailing", "trailing-path", "regex-str", "regex-compiled", "single-str", "no-partial"],
)
def test_skip_rules(skip, skipped):
    model = _llama(tied=False)
    rules = list(skip) if isinstance(skip, list) else skip
    if skipped:
        summary = quantize_model(model, bits=2, skip=rules, progress=False)
    else:  # a rule that matches no module is warned about
        with pytest.warns(UserWarning, match=r"skip entries \['proj'\] match no module"):
            summary = quantize_model(model, bits=2, skip=rules, progress=False)
    assert set(summary.skipped) == skipped  # user rules replace the default ("lm_head",)
    assert set(summary.converted) == set(_block_names()) - skipped | {"lm_head"}
    for name in skipped:
        assert type(model.get_submodule(name)) is nn.Linear


def test_skip_rules_that_match_no_module_are_warned_about_and_summarized():
    """A misspelled rule keeps nothing dense: warned about by name and listed in the summary; the
    rules that match stay silent, and so does the default rule on a model without an lm_head."""
    model = _llama(tied=False)
    with pytest.warns(UserWarning, match=r"skip entries \['o_prj', 'nothing.*here'\] match no module"):
        summary = quantize_model(model, bits=4, skip=["lm_head", "o_prj", re.compile(r"nothing\.here")], progress=False)
    assert summary.unmatched_skip == ["o_prj", r"nothing\.here"]
    assert "skip rules matching no module" in str(summary) and "'o_prj'" in str(summary)
    assert type(model.model.layers[0].self_attn.o_proj) is KbitLinear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        headless = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        assert quantize_model(headless, bits=4, progress=False).unmatched_skip == []  # the default ("lm_head",)
        assert quantize_model(_llama(tied=False), bits=4, skip=["mlp", "re:self_attn"], progress=False).unmatched_skip == []


@pytest.mark.parametrize("options", [{}, {"fuse": True, "hadamard": True}], ids=["plain", "fused-hadamard"])
def test_dequantize_model_gives_dense_layers_with_the_dequantized_weights(options):
    model = _llama(tied=False)
    quantize_model(model, bits=3, skip=["lm_head"], progress=False, **options)
    ids = torch.randint(0, 160, (2, 7), generator=torch.Generator().manual_seed(1))
    weights = {n: m.dequantize() for n, m in model.named_modules() if isinstance(m, KbitLinear)}
    with torch.no_grad():
        before = model(ids).logits
    restored = dequantize_model(model)
    assert restored == len(_block_names())
    assert not any(isinstance(m, KbitLinear) for m in model.modules())
    for name in _block_names():
        layer = model.get_submodule(name)
        assert type(layer) is nn.Linear and layer.weight.requires_grad and layer.weight.dtype == torch.float32
        if name in weights:
            assert torch.equal(layer.weight, weights[name])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    assert dequantize_model(model) == 0  # nothing left to restore


def test_dequantize_model_checks_its_arguments_and_refuses_experts_untouched():
    model = _llama(tied=False)
    quantize_model(model, bits=4, progress=False)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        dequantize_model(model, torch.int8)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        dequantize_model("model")
    dequantize_model(model, torch.bfloat16)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    from kbit_linear.experts import KbitExperts
    holder = nn.Module()
    holder.linear = KbitLinear.from_linear(nn.Linear(64, 64), bits=4)
    holder.experts = KbitExperts(2, 64, 64, bits=4)
    with pytest.raises(NotImplementedError, match="KbitExperts modules \\(experts, ...\\)"):
        dequantize_model(holder)
    assert isinstance(holder.linear, KbitLinear)


def test_matches_skip_boundaries():
    assert matches_skip("layers.1.attn", ["layers.1"]) == "layers.1"
    assert matches_skip("layers.11.attn", ["layers.1"]) is None
    assert matches_skip("model.lm_head", ["lm_head"]) == "lm_head"
    assert matches_skip("model.lm_head_2", ["lm_head"]) is None
    assert matches_skip("model.layers.3.mlp.up_proj", ["mlp"]) == "mlp"
    assert matches_skip("model.layers.3.mlp.up_proj", ["proj", "mlp.up"]) is None
    assert matches_skip("a.b.c", ["re:^a\\.b"]) == "re:^a\\.b"
    assert matches_skip("x.b.c", ["re:^a\\.b"]) is None


def test_unsupported_layers_are_skipped_with_a_reason():
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    frozen = nn.Linear(32, 16)
    frozen.weight = nn.Parameter(torch.zeros(16, 32, dtype=torch.int8), requires_grad=False)
    model = nn.ModuleDict({"attn": mha, "int8": frozen, "ok": nn.Linear(32, 16)})
    summary = quantize_model(model, skip=None, progress=False)
    assert summary.converted == ["ok"]
    assert "subclass of nn.Linear" in summary.skipped["attn.out_proj"]
    assert "not floating point" in summary.skipped["int8"]
    x = torch.randn(2, 5, 32)
    assert mha(x, x, x)[0].shape == (2, 5, 32)  # MultiheadAttention still works


def test_nan_weight_raises_naming_the_layer():
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"cannot quantize layer '1' \(8x16\).*NaN or Inf"):
        quantize_model(model, skip=None, progress=False)


def test_argument_checks():
    model = nn.Sequential(nn.Linear(32, 16))
    with pytest.raises(ValueError, match="bits"):
        quantize_model(model, bits=7)
    with pytest.raises(TypeError, match="skip"):
        quantize_model(model, skip=[3])
    with pytest.raises(ValueError, match="regular expression"):
        quantize_model(model, skip=["re:("])
    with pytest.raises(TypeError, match="bare nn.Linear"):
        quantize_model(nn.Linear(32, 16))
    with pytest.raises(TypeError, match="model"):
        quantize_model("model")
    with pytest.raises(ValueError, match="codebook"):
        quantize_model(model, bits=2, codebook=torch.tensor([1.0, 0.5, 0.0, -1.0]))
    assert type(model[0]) is nn.Linear  # nothing converted by the failed calls


def test_user_codebook_is_used_and_copied_per_layer():
    cb = torch.tensor([-1.0, -0.4, 0.2, 1.0])
    model = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 10))
    dense = copy.deepcopy(model)
    quantize_model(model, bits=2, codebook=cb, skip=None, progress=False)
    for i in (0, 1):
        assert torch.equal(model[i].codebook, cb)
        ref = fmt.quantize(dense[i].weight.detach(), 2, cb)
        assert torch.equal(model[i].weight, ref.packed)
    assert model[0].codebook.data_ptr() != model[1].codebook.data_ptr()


def test_each_dense_weight_is_freed_before_the_next_layer_is_quantized(monkeypatch):
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    events: list[str] = []
    for i in range(len(model)):
        weakref.finalize(model[i].weight, events.append, f"freed {i}")
    original = KbitLinear.from_linear.__func__

    def spy(cls, linear, bits=4, codebook=None, **kwargs):
        gc.collect()
        events.append("quantize")
        return original(cls, linear, bits, codebook, **kwargs)

    monkeypatch.setattr(KbitLinear, "from_linear", classmethod(spy))
    quantize_model(model, skip=None, progress=False)
    gc.collect()
    assert events == ["quantize", "freed 0", "quantize", "freed 1", "quantize", "freed 2", "quantize", "freed 3"]


def test_progress_bar(capsys):
    quantize_model(nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8)), bits=3, skip=None, progress=True)
    err = capsys.readouterr().err
    assert "kbit quantize (3 bits)" in err and "2/2" in err


def test_meta_model_gives_meta_layers_that_load_a_real_state_dict():
    real = _llama(tied=True)
    quantize_model(real, bits=3, progress=False)
    meta = _llama(tied=True, device="meta")
    summary = quantize_model(meta, bits=3, progress=False)
    assert summary.converted == _block_names()
    sd_real, sd_meta = real.state_dict(), meta.state_dict()
    assert sd_real.keys() == sd_meta.keys()
    for k, t in sd_meta.items():
        assert t.device.type == "meta" and t.shape == sd_real[k].shape and t.dtype == sd_real[k].dtype, k
    meta.load_state_dict(sd_real, assign=True)
    for name in _block_names():
        assert torch.equal(meta.get_submodule(name).weight, real.get_submodule(name).weight)


def test_device_argument_moves_the_new_layers():
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    quantize_model(model, skip=None, progress=False, device="meta")
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    assert isinstance(model[0], KbitLinear)


# ---------------------------------------------------------------------------------------
# the swap rule and the swap helpers (shared with load_into and the transformers plug-in)
# ---------------------------------------------------------------------------------------


class _SubLinear(nn.Linear):
    """A subclass that changes forward: a swap would silently drop the change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_is_convertible_takes_exact_nn_linear_only():
    assert is_convertible(nn.Linear(4, 4))
    assert not is_convertible(_SubLinear(4, 4))
    assert not is_convertible(nn.MultiheadAttention(8, 2).out_proj)  # NonDynamicallyQuantizableLinear
    assert not is_convertible(KbitLinear.from_linear(nn.Linear(32, 8)))
    assert not is_convertible(nn.Conv1d(3, 3, 1))
    assert not is_convertible(nn.Sequential(nn.Linear(4, 4)))


def test_convertible_layers_gives_names_and_reasons():
    model = nn.ModuleDict({"a": nn.Linear(32, 16), "sub": _SubLinear(32, 16), "b": nn.Sequential(nn.Linear(16, 8)), "skipme": nn.Linear(8, 8)})
    names, skipped = convertible_layers(model, ["skipme"])
    assert names == ["a", "b.0"]
    assert set(skipped) == {"sub", "skipme"}
    assert "subclass of nn.Linear" in skipped["sub"] and "skip rule 'skipme'" in skipped["skipme"]
    summary = quantize_model(model, skip=["skipme"], progress=False)
    assert summary.converted == names and summary.skipped == skipped
    assert type(model["sub"]) is _SubLinear


def test_replace_module_and_placeholders():
    model = nn.Sequential(nn.Sequential(nn.Linear(40, 24).to(torch.float16)), nn.Linear(24, 10, bias=False))
    model[0][0].eval()
    layer = kbit_placeholder(model[0][0], 3)
    assert (layer.in_features, layer.out_features, layer.bits) == (40, 24, 3)
    assert layer.bias.dtype == torch.float16 and not layer.training
    assert layer.weight.shape == fmt.tiled_shapes(24, 40, 3)[0] and layer.weight.dtype == torch.int32
    replace_module(model, "0.0", layer)
    assert model[0][0] is layer
    meta = kbit_placeholder(model[1], 2, device="meta")
    assert meta.bias is None and meta.weight.device.type == "meta"
    assert kbit_placeholder(model[1], 2, bias=True).bias.shape == (10,)
    replace_module(model, "1", meta)
    assert model[1] is meta
    with pytest.raises(ValueError, match="root"):
        replace_module(model, "", meta)


def test_replace_module_refuses_a_name_that_is_no_submodule():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    before = dict(model.named_modules())
    for name in ("0.1", "0.linear", "2", "nope.0"):  # a misspelled child, a missing parent
        with pytest.raises(ValueError, match=re.escape(repr(name))):
            replace_module(model, name, nn.Identity())
    assert dict(model.named_modules()) == before  # nothing added or replaced
    with pytest.raises(TypeError, match="new must be an nn.Module"):
        replace_module(model, "1", "identity")
    with pytest.raises(TypeError, match="root must be an nn.Module"):
        replace_module(None, "1", nn.Identity())


def test_a_quantize_model_that_fails_midway_still_guards_save_pretrained(tmp_path):
    model = _llama(tied=False)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="cannot quantize layer 'model.layers.1.self_attn.o_proj'"):
        quantize_model(model, bits=4, progress=False)
    assert isinstance(model.model.layers[0].self_attn.q_proj, KbitLinear)  # layers before it are swapped
    with pytest.raises(ValueError, match="cannot be saved with save_pretrained"):
        model.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())
    failed_first = _llama(tied=False)  # nothing swapped: transformers' own save_pretrained stays
    with torch.no_grad():
        failed_first.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="cannot quantize layer"):
        quantize_model(failed_first, bits=4, progress=False)
    assert "save_pretrained" not in failed_first.__dict__


def test_check_skip_rules_names_the_argument():
    assert check_skip_rules(None) == () and check_skip_rules("lm_head") == ("lm_head",)
    with pytest.raises(TypeError, match="skip_modules entries"):
        check_skip_rules([""], name="skip_modules")
    with pytest.raises(ValueError, match="skip_modules entry 're:\\(' is not a valid regular expression"):
        check_skip_rules(["re:("], name="skip_modules")


def test_matches_skip_takes_one_bare_rule_as_a_rule():
    assert matches_skip("model.layers.0.mlp.up_proj", "mlp") == "mlp"
    assert matches_skip("model.layers.0.mlp.up_proj", re.compile(r"mlp\.up")).pattern == r"mlp\.up"
    assert matches_skip("a.b", "b.c") is None


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is not available")


@pytest.mark.parametrize(
    "device, error, match",
    [
        ("nope", ValueError, r"device 'nope' is not a device torch knows"),
        (3.0, TypeError, r"device must be a torch.device, a str, an int or None, got float"),
        (True, TypeError, r"device must be a torch.device, a str, an int or None, got bool"),
        pytest.param("cuda", ValueError, r"device 'cuda': CUDA is not available here", marks=_NO_CUDA),
        pytest.param(torch.device("cuda", 0), ValueError, r"device 'cuda:0': CUDA is not available here", marks=_NO_CUDA),
    ],
    ids=["unknown-str", "float", "bool", "cuda-str", "cuda-device"],
)
def test_quantize_model_checks_device_up_front(device, error, match):
    model = _llama(tied=False)
    with pytest.raises(error, match=match):
        quantize_model(model, device=device, progress=False)
    assert all(type(m) is not KbitLinear for m in model.modules())  # nothing was touched
    with pytest.raises(error, match=match):
        kbit_placeholder(nn.Linear(64, 64), 4, device=device)


def test_quantize_model_still_takes_what_torch_device_takes():
    model = _llama(tied=False)
    summary = quantize_model(model, device=torch.device("cpu"), progress=False)
    assert summary.converted and model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    assert kbit_placeholder(nn.Linear(64, 64), 4, device="meta").weight.device.type == "meta"


def test_matches_skip_names_a_non_str_name():
    with pytest.raises(TypeError, match="name must be a str, got NoneType"):
        matches_skip(None, ["x"])


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((None, {}, 4), TypeError, "names must be an iterable of layer names"),
        (("model.layers.0.self_attn.q_proj", {}, 4), TypeError, "names must be an iterable of layer names"),
        (([3], {}, 4), TypeError, "names must hold str layer names"),
        ((["a.q_proj"], None, 4), TypeError, "layer_bits must be a dict"),
        ((["a.q_proj"], {}, 4.0), TypeError, "bits must be an int"),
        ((["a.q_proj"], {}, 7), ValueError, "bits must be one of"),
        ((["a.q_proj"], {}, 4, "model"), TypeError, "model must be an nn.Module or None"),
    ],
    ids=["names-none", "names-str", "names-int", "layer-bits-none", "bits-float", "bits-7", "model-str"],
)
def test_sibling_groups_names_a_bad_argument(args, error, match):
    with pytest.raises(error, match=match):
        sibling_groups(*args)


def test_sibling_groups_still_groups_siblings():
    names = [f"m.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    groups = sibling_groups(names, {}, 4)
    assert groups == {n: ("m.q_proj", "m.k_proj", "m.v_proj") for n in names[:3]}


def test_the_models_fp32_modules_stay_dense() -> None:
    """A model's ``_keep_in_fp32_modules`` stay dense (T5 casts ``wo``'s input to that layer's
    weight dtype: quantized, the next forward failed), reported as such in the summary."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=ids[:, :5]).logits
    summary = quantize_model(model, bits=4, progress=False)
    wo = [n for n, m in model.named_modules() if n.endswith(".wo")]
    assert wo and all(type(model.get_submodule(n)) is nn.Linear for n in wo)
    assert all(summary.skipped[n] == "kept in float32 by the model (_keep_in_fp32_modules)" for n in wo)
    assert any(isinstance(m, KbitLinear) for m in model.modules())
    with torch.no_grad():
        out = model(input_ids=ids, decoder_input_ids=ids[:, :5]).logits
    assert (out - ref).abs().max() / ref.abs().max() < 0.3
