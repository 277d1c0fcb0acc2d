"""Quantized safetensors checkpoints: round trips, validation of damaged files, atomic writes."""

from __future__ import annotations

import json
import os
import random

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from kbit_linear import serialization as ser
from kbit_linear.linear import KbitLinear
from kbit_linear.patch import quantize_model
from kbit_linear.serialization import (
    FORMAT_VERSION,
    CheckpointError,
    header_metadata,
    layer_metadata,
    load_into,
    load_quantized,
    parse_header,
    save_quantized,
    validate_layer_tensors,
    verify_sha256,
    verify_tensor_type,
)
from safetensors_headers import edit_tensor_entry


def _mlp(seed: int = 0) -> nn.Module:
    """Odd shapes (no full tile anywhere), biases, and a layer left dense."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(100, 33),
        nn.GELU(),
        nn.Linear(33, 300, bias=False),
        nn.GELU(),
        nn.Linear(300, 200),
        nn.LayerNorm(200),
        nn.Linear(200, 7),
    ).eval()


def _quantized_mlp(seed: int = 0, bits: int = 3) -> nn.Module:
    model = _mlp(seed)
    quantize_model(model, bits=bits, skip=["6"], progress=False)
    return model


@pytest.fixture
def saved(tmp_path):
    model = _quantized_mlp()
    path = tmp_path / "model.safetensors"
    save_quantized(model, path, metadata={"note": "test"})
    return model, path


def _read(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safetensors.safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _forge(path, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> None:
    """Rewrite ``path`` consistently (checksums, dtypes and shapes recomputed), so only the
    semantic checks can object."""
    header = dict(header)
    header[ser._KEY_SHA256] = json.dumps({k: ser._sha256(t) for k, t in tensors.items()})
    if ser._KEY_TENSOR_TYPES in header:
        types = {k: ser.tensor_type(t) for k, t in tensors.items()}
        header[ser._KEY_TENSOR_TYPES] = json.dumps({k: [dtype, list(shape)] for k, (dtype, shape) in types.items()})
    header[ser._KEY_HEADER_SHA256] = ser._header_digest(header)
    safetensors.torch.save_file(tensors, str(path), metadata=header)


# ---------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------


def test_round_trip_is_bit_exact(saved):
    model, path = saved
    ckpt = load_quantized(path)
    sd = model.state_dict()
    assert ckpt.tensors.keys() == sd.keys()
    for name, t in sd.items():
        assert ckpt.tensors[name].dtype == t.dtype and torch.equal(ckpt.tensors[name], t), name
    assert ckpt.metadata == {"note": "test"}
    assert set(ckpt.layers) == {"0", "2", "4"}
    assert ckpt.layers["0"] == layer_metadata(model[0])
    assert ckpt.layers["2"]["bias"] is False and ckpt.layers["4"]["out_features_padded"] == 256
    assert ckpt.tensors["4.weight"].shape == (5, 2, 128, 2, 3)  # never [out, in]


def test_load_into_a_dense_model_replaces_layers_and_matches(saved):
    model, path = saved
    dense = _mlp(seed=123)  # other random weights: the load must overwrite them all
    load_into(dense, path)
    assert [type(m).__name__ for m in dense] == [type(m).__name__ for m in model]
    x = torch.randn(4, 100)
    with torch.no_grad():
        assert torch.equal(dense(x), model(x))
    for name, t in model.state_dict().items():
        assert torch.equal(dense.state_dict()[name], t), name


def test_load_into_a_meta_model(saved):
    model, path = saved
    with torch.device("meta"):
        meta = _mlp()
    load_into(meta, path)
    x = torch.randn(2, 100)
    with torch.no_grad():
        assert torch.equal(meta(x), model(x))
    assert not meta[0].weight.requires_grad


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_round_trip(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, attention_bias=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    quantize_model(model, bits=4, progress=False)
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        ref = model(ids).logits
    path = save_quantized(model, tmp_path / "llama.safetensors")
    _, header = _read(path)
    aliases = json.loads(header.get(ser._KEY_ALIASES, "{}"))
    assert aliases == ({"model.embed_tokens.weight": "lm_head.weight"} if tied else {})
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(cfg).eval()
    load_into(fresh, path)
    if tied:
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, ref)


def test_bf16_model_round_trip(tmp_path):
    model = _quantized_mlp(bits=5).to(torch.bfloat16)
    assert model[0].codebook.dtype == torch.float32 and model[0].bias.dtype == torch.bfloat16
    path = save_quantized(model, tmp_path / "bf16.safetensors")
    ckpt = load_quantized(path)
    assert ckpt.tensors["0.bias"].dtype == torch.bfloat16 and ckpt.tensors["0.codebook"].dtype == torch.float32
    dense = _mlp(seed=7).to(torch.bfloat16)
    load_into(dense, path)
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(dense(x), model(x))


def test_save_state_dict_with_layers(tmp_path):
    model = _quantized_mlp()
    layers = {p: layer_metadata(model[int(p)]) for p in ("0", "2", "4")}
    path = save_quantized(model.state_dict(), tmp_path / "sd.safetensors", layers=layers)
    ckpt = load_quantized(path)
    assert ckpt.layers == layers
    with pytest.raises(CheckpointError, match=r"\['0.weight', '2.weight', '4.weight'\] look like quantized planes"):
        save_quantized(model.state_dict(), tmp_path / "bad.safetensors")


def test_a_loader_without_the_format_fails_with_a_size_mismatch(saved):
    _, path = saved
    tensors, _ = _read(path)
    with pytest.raises(RuntimeError, match="size mismatch for 0.weight"):
        _mlp().load_state_dict({k: v for k, v in tensors.items()}, strict=False)


# ---------------------------------------------------------------------------------------
# damaged and mismatched files
# ---------------------------------------------------------------------------------------


def test_truncated_file(saved):
    _, path = saved
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40, 5):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=rf"{path.name}: cannot read the file as safetensors"):
            load_quantized(path)


def test_every_sampled_header_byte_flip_is_detected(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    positions = random.Random(0).sample(range(8, 8 + header_len), 120)
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=path.name):
            load_quantized(path)


def test_flipped_tensor_byte_fails_the_checksum(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len + 3] ^= 0x10  # first tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor '.*' fails its sha256 check"):
        load_quantized(path)


# Dense tensors (norms, embeddings, the head) have no structural check: only the header's record
# of their dtype and shape tells that the safetensors header now gives their bytes other meaning.
@pytest.mark.parametrize(
    "bits, dtype, name, changes, recorded",
    [
        (3, torch.float32, "5.weight", {"dtype": "I32"}, r"I32 \[200\] in the file but F32 \[200\]"),
        (5, torch.bfloat16, "5.weight", {"dtype": "F16"}, r"F16 \[200\] in the file but BF16 \[200\]"),
        (5, torch.bfloat16, "0.bias", {"dtype": "F16"}, r"F16 \[33\] in the file but BF16 \[33\]"),
        (3, torch.float32, "6.weight", {"shape": [200, 7]}, r"F32 \[200, 7\] in the file but F32 \[7, 200\]"),
    ],
    ids=["f32-as-i32", "bf16-as-f16", "kbit-bias-bf16-as-f16", "transposed-shape"],
)
def test_a_relabelled_dense_tensor_is_refused(tmp_path, bits, dtype, name, changes, recorded):
    model = _quantized_mlp(bits=bits).to(dtype)
    path = save_quantized(model, tmp_path / "m.safetensors")
    edit_tensor_entry(path, name, **changes)
    _, header = _read(path)
    assert parse_header(header, str(path), verify_digest=True).sha256  # the kbit metadata is intact
    edited = load_quantized(path, verify_checksums=False).tensors[name]  # unchecked, the edit goes through
    assert ser.tensor_type(edited) != ser.tensor_type(model.state_dict()[name])
    pattern = rf"{path.name}: tensor '{name}' is {recorded} in the checkpoint header"
    with pytest.raises(CheckpointError, match=pattern):
        load_quantized(path)
    with pytest.raises(CheckpointError, match=pattern):
        load_into(_mlp().to(dtype), path)


def test_tensor_types_entry_is_written_for_every_stored_tensor(saved):
    model, path = saved
    _, header = _read(path)
    types = json.loads(header[ser._KEY_TENSOR_TYPES])
    assert types.keys() == model.state_dict().keys()
    assert types["5.weight"] == ["F32", [200]] and types["0.absmax"] == ["U8", [2, 1, 128, 2]]
    assert types["4.weight"] == ["I32", [5, 2, 128, 2, 3]]


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.pop(ser._KEY_TENSOR_TYPES),
        lambda h: h.update({ser._KEY_TENSOR_TYPES: h[ser._KEY_TENSOR_TYPES].replace('"F32", [200]', '"I32", [200]', 1)}),
    ],
    ids=["removed", "edited"],
)
def test_tensor_types_entry_is_covered_by_the_header_digest(saved, edit):
    _, path = saved
    tensors, header = _read(path)
    before = dict(header)
    edit(header)
    assert header != before
    safetensors.torch.save_file(tensors, str(path), metadata=header)  # digest untouched
    with pytest.raises(CheckpointError, match=rf"{path.name}: the header metadata fails its sha256 check"):
        load_quantized(path)


def test_a_file_of_a_writer_without_tensor_types_still_loads(saved):
    """An older writer wrote no tensor_types entry (and its digest did not cover one): such files
    load, without the dtype and shape check."""
    model, path = saved
    tensors, header = _read(path)
    del header[ser._KEY_TENSOR_TYPES]
    header[ser._KEY_HEADER_SHA256] = ser._header_digest(header)
    safetensors.torch.save_file(tensors, str(path), metadata=header)
    assert parse_header(header, str(path), verify_digest=True).tensor_types is None
    ckpt = load_quantized(path)
    for name, t in model.state_dict().items():
        assert torch.equal(ckpt.tensors[name], t), name
    dense = _mlp(seed=5)
    load_into(dense, path)
    x = torch.randn(3, 100)
    with torch.no_grad():
        assert torch.equal(dense(x), model(x))


def test_not_a_kbit_checkpoint(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(3)}, str(path))
    with pytest.raises(CheckpointError, match="not a kbit_linear checkpoint"):
        load_quantized(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_quantized(tmp_path / "missing.safetensors")


def _layer_meta_edit(key, value, prefix="4"):
    def edit(tensors, header):
        layers = json.loads(header[ser._KEY_LAYERS])
        layers[prefix][key] = value
        header[ser._KEY_LAYERS] = json.dumps(layers)

    return edit


def _tensor_edit(name, fn):
    def edit(tensors, header):
        if fn is None:
            del tensors[name]
        else:
            tensors[name] = fn(tensors[name])

    return edit


def _unsorted_codebook(cb):
    cb = cb.clone()
    cb[[1, 2]] = cb[[2, 1]]
    return cb


def _dirty_padding(absmax):
    absmax = absmax.clone()
    absmax[0, 1, 127, 0] = 7  # row 255 of a 200-row layer
    return absmax


def _header_edit(key, value):
    def edit(tensors, header):
        header[key] = value

    return edit


CORRUPTIONS = {
    "wrong-bits": (_layer_meta_edit("bits", 4), r"layer '4': 'weight' has shape \(5, 2, 128, 2, 3\), expected \(5, 2, 128, 2, 4\)"),
    "unsupported-bits": (_layer_meta_edit("bits", 8), r"layer '4': bits=8 is not supported"),
    "wrong-out-features": (_layer_meta_edit("out_features", 250), r"layer '4': 'bias' has shape \(200,\), expected \(250,\)"),
    "wrong-out-features-padded-alike": (
        _layer_meta_edit("out_features", 290, prefix="2"),
        r"layer '2': absmax is not zero in the padding \(rows 290\.\.383\)",
    ),
    # 33 -> 20 in-features keeps the tile shapes; the real second block now sits in the padding
    "wrong-in-features": (_layer_meta_edit("in_features", 20, prefix="2"), r"layer '2': absmax is not zero in the padding \(block column 1\)"),
    "wrong-padded-shape": (_layer_meta_edit("in_features_padded", 256), r"in_features_padded=256 does not match"),
    "wrong-tile": (_layer_meta_edit("tile_n", 64), r"tile_n=64 does not match this format"),
    "bias-flag": (_layer_meta_edit("bias", False), r"layer '4': has a 'bias' tensor but the metadata says it has none"),
    "missing-meta-key": (_layer_meta_edit("in_features", None), r"metadata 'in_features' must be an int"),
    "wrong-absmax-shape": (_tensor_edit("4.absmax", lambda t: t[:, :1].contiguous()), r"layer '4': 'absmax' has shape \(5, 1, 128, 2\)"),
    "wrong-weight-dtype": (_tensor_edit("4.weight", lambda t: t.to(torch.int64)), r"layer '4': 'weight' has dtype torch.int64, expected torch.int32"),
    "wrong-codebook-dtype": (_tensor_edit("0.codebook", lambda t: t.half()), r"layer '0': 'codebook' has dtype torch.float16"),
    "unsorted-codebook": (_tensor_edit("0.codebook", _unsorted_codebook), r"layer '0': invalid codebook: .*strictly increasing"),
    "codebook-out-of-range": (_tensor_edit("0.codebook", lambda t: t * 2), r"layer '0': invalid codebook: .*\[-1, 1\]"),
    "tensor-scale-not-pow2": (_tensor_edit("2.tensor_scale", lambda t: t * 3), r"layer '2': tensor_scale must be a positive finite power of two"),
    "dirty-padding": (_tensor_edit("4.absmax", _dirty_padding), r"layer '4': absmax is not zero in the padding \(rows 200\.\.255\)"),
    "missing-tensor": (_tensor_edit("2.tensor_scale", None), r"layer '2': tensor 'tensor_scale' is missing"),
    "missing-bias": (_tensor_edit("0.bias", None), r"layer '0': tensor 'bias' is missing"),
    "unknown-version": (_header_edit(ser._KEY_VERSION, "3"), r"format version '3' is not supported"),
    "bad-layers-json": (_header_edit(ser._KEY_LAYERS, "{not json"), r"'kbit_linear.layers' is not valid JSON"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_mismatched_checkpoint_raises_a_clear_error(saved, case):
    _, path = saved
    edit, pattern = CORRUPTIONS[case]
    tensors, header = _read(path)
    edit(tensors, header)
    _forge(path, tensors, header)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_quantized(path)
    assert str(path) in str(info.value)


def test_tensor_removed_from_the_file_only(saved):
    _, path = saved
    tensors, header = _read(path)
    del tensors["2.absmax"]
    safetensors.torch.save_file(tensors, str(path), metadata=header)  # header untouched
    with pytest.raises(CheckpointError, match=r"missing from the file: \['2.absmax'\]"):
        load_quantized(path)


def test_load_into_mismatched_model(saved):
    _, path = saved
    wrong = nn.Sequential(nn.Linear(100, 34), nn.GELU(), nn.Linear(34, 300), nn.GELU(), nn.Linear(300, 200), nn.LayerNorm(200), nn.Linear(200, 7))
    with pytest.raises(CheckpointError, match=r"layer '0' is 33x100 in the checkpoint but 34x100 in the model"):
        load_into(wrong, path)
    other_bits = _quantized_mlp(bits=2)
    with pytest.raises(CheckpointError, match=r"layer '0' is \(bits, in, out, bias, hadamard\)=\(3, 100, 33, True, False\) in the checkpoint but \(2, 100, 33, True, False\)"):
        load_into(other_bits, path)
    extra = nn.Sequential(*_mlp(), nn.Linear(7, 2))
    with pytest.raises(CheckpointError, match=r"(?s)does not match the model.*Missing key"):
        load_into(extra, path)


class _SubLinear(nn.Linear):
    pass


def test_load_into_refuses_a_subclass_of_linear(saved):
    """The swap rule of kbit_linear.patch.is_convertible: exact nn.Linear only."""
    _, path = saved
    model = _mlp()
    model[2] = _SubLinear(33, 300, bias=False)
    with pytest.raises(CheckpointError, match=r"layer '2' is a _SubLinear in the model.*never swapped"):
        load_into(model, path)


# ---------------------------------------------------------------------------------------
# the header schema (shared with the transformers plug-in)
# ---------------------------------------------------------------------------------------


def test_header_metadata_and_parse_header_round_trip(saved):
    model, path = saved
    layers = {"0": layer_metadata(model[0])}
    sums = {"0.weight": ser.tensor_sha256(model[0].weight)}
    header = header_metadata(layers, sums)
    assert header[ser._KEY_VERSION] == FORMAT_VERSION and all(isinstance(v, str) for v in header.values())
    parsed = parse_header(header, "x.safetensors")
    assert parsed.layers == layers and parsed.sha256 == sums and parsed.aliases == {}
    assert parsed.tensor_types is None  # not given: not written
    types = {"0.weight": ser.tensor_type(model[0].weight)}
    parsed = parse_header(header_metadata(layers, sums, tensor_types=types), "x.safetensors")
    assert parsed.tensor_types == {"0.weight": ("I32", (2, 1, 128, 2, 3))}
    # what save_quantized wrote parses the same way, with its header digest
    _, written = _read(path)
    parsed = parse_header(written, str(path), verify_digest=True)
    assert set(parsed.layers) == {"0", "2", "4"} and set(parsed.sha256) == set(model.state_dict())


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.pop(ser._KEY_VERSION), r"x.safetensors: not a kbit_linear checkpoint.*not written by kbit_linear"),
        (lambda h: h.update({ser._KEY_VERSION: "9"}), r"format version '9' is not supported"),
        (lambda h: h.pop(ser._KEY_LAYERS), r"header lacks 'kbit_linear.layers'"),
        (lambda h: h.pop(ser._KEY_SHA256), r"header lacks 'kbit_linear.sha256'"),
        (lambda h: h.update({ser._KEY_LAYERS: "[1, 2]"}), r"'kbit_linear.layers' must be a JSON object"),
        (lambda h: h.update({ser._KEY_SHA256: "{"}), r"'kbit_linear.sha256' is not valid JSON"),
        (lambda h: h.update({ser._KEY_TENSOR_TYPES: "[]"}), r"'kbit_linear.tensor_types' must be a JSON object"),
        (lambda h: h.update({ser._KEY_TENSOR_TYPES: '{"a": ["F32", [2, -1]]}'}), r"\[\"F32\", \[2, -1\]\] for tensor 'a', expected \[dtype, shape\]"),
        (lambda h: h.update({ser._KEY_TENSOR_TYPES: '{"a": ["F32"]}'}), r"for tensor 'a', expected \[dtype, shape\]"),
        (lambda h: h.update({ser._KEY_TENSOR_TYPES: '{"a": [32, [2]]}'}), r"for tensor 'a', expected \[dtype, shape\]"),
    ],
    ids=["no-version", "version", "no-layers", "no-sha256", "layers-not-object", "bad-json", "types-not-object",
         "types-negative-dim", "types-no-shape", "types-dtype-not-str"],
)
def test_parse_header_errors(edit, match):
    header = header_metadata({}, {})
    edit(header)
    with pytest.raises(CheckpointError, match=match):
        parse_header(header, "x.safetensors")


def test_parse_header_digest():
    header = header_metadata({}, {})
    with pytest.raises(CheckpointError, match="header metadata fails its sha256 check"):
        parse_header(header, "x.safetensors", verify_digest=True)
    header[ser._KEY_HEADER_SHA256] = ser._header_digest(header)
    assert parse_header(header, "x.safetensors", verify_digest=True).layers == {}


def test_verify_sha256():
    t = torch.arange(10, dtype=torch.int32)
    sums = {"a": ser.tensor_sha256(t)}
    verify_sha256("a", t, sums)
    with pytest.raises(CheckpointError, match=r"f.safetensors: tensor 'a' fails its sha256 check"):
        verify_sha256("a", t + 1, sums, where="f.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'b' has no checksum"):
        verify_sha256("b", t, sums)


def test_verify_tensor_type():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    types = {"a": ser.tensor_type(t)}
    assert types["a"] == ("BF16", (3, 4))
    verify_tensor_type("a", t, types)
    with pytest.raises(CheckpointError, match=r"f.safetensors: tensor 'a' is F16 \[3, 4\] in the file but BF16 \[3, 4\]"):
        verify_tensor_type("a", t.half(), types, where="f.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'a' is BF16 \[4, 3\] in the file but BF16 \[3, 4\]"):
        verify_tensor_type("a", t.t(), types)
    with pytest.raises(CheckpointError, match=r"tensor 'b' has no dtype and shape in the checkpoint header"):
        verify_tensor_type("b", t, types)


# ---------------------------------------------------------------------------------------
# validate_layer_tensors (shared with the transformers plug-in)
# ---------------------------------------------------------------------------------------


def test_validate_layer_tensors_directly():
    layer = KbitLinear.from_linear(nn.Linear(100, 33), bits=4)
    tensors = dict(layer.state_dict())
    meta = {"bits": 4, "in_features": 100, "out_features": 33}
    validate_layer_tensors("blk.q", tensors, meta)
    validate_layer_tensors("blk.q", tensors, layer_metadata(layer), where="x.safetensors")
    with pytest.raises(CheckpointError, match=r"x.safetensors: layer 'blk.q': unexpected tensors \['scale'\]"):
        validate_layer_tensors("blk.q", dict(tensors, scale=torch.ones(1)), meta, where="x.safetensors")
    with pytest.raises(CheckpointError, match=r"layer 'blk.q': metadata lacks 'bits'"):
        validate_layer_tensors("blk.q", tensors, {"in_features": 100, "out_features": 33})
    with pytest.raises(CheckpointError, match=r"'weight' has shape \(2, 1, 128, 2, 4\), expected \(4, 1, 128, 2, 4\)"):
        validate_layer_tensors("blk.q", tensors, dict(meta, in_features=200))
    # meta tensors: structure only
    with torch.device("meta"):
        m = KbitLinear(100, 33, bits=4)
    validate_layer_tensors("blk.q", dict(m.state_dict()), meta)


# ---------------------------------------------------------------------------------------
# saving: arguments and atomicity
# ---------------------------------------------------------------------------------------


def test_save_argument_checks(tmp_path):
    model = _quantized_mlp()
    with pytest.raises(ValueError, match="reserved"):
        save_quantized(model, tmp_path / "a.safetensors", metadata={"kbit_linear.version": "9"})
    with pytest.raises(TypeError, match="metadata"):
        save_quantized(model, tmp_path / "a.safetensors", metadata={"n": 3})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_quantized(model, tmp_path / "no" / "a.safetensors")
    with pytest.raises(TypeError, match="layers="):
        save_quantized(model, tmp_path / "a.safetensors", layers={})
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        save_quantized([1, 2], tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="maps names"):
        save_quantized({1: torch.zeros(2)}, tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="maps names"):
        save_quantized({"a": [1.0]}, tmp_path / "a.safetensors")
    with torch.device("meta"):
        meta = _mlp()
    quantize_model(meta, progress=False)
    with pytest.raises(ValueError, match="meta device"):
        save_quantized(meta, tmp_path / "a.safetensors")
    assert not list(tmp_path.iterdir())


def test_interrupted_save_leaves_no_loadable_file(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # half a file, then the process "dies"
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(_quantized_mlp(), path)
    assert list(tmp_path.iterdir()) == []

    # an existing checkpoint survives a failed overwrite untouched
    monkeypatch.undo()
    good = _quantized_mlp(seed=1)
    save_quantized(good, path)
    before = path.read_bytes()
    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(_quantized_mlp(seed=2), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    monkeypatch.undo()
    assert torch.equal(load_quantized(path).tensors["0.weight"], good[0].weight)


def test_overwrite_replaces_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_quantized(_quantized_mlp(seed=1), path)
    second = _quantized_mlp(seed=2)
    save_quantized(second, path)
    assert torch.equal(load_quantized(path).tensors["4.weight"], second[4].weight)
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_load_into_refuses_a_dense_layer_whose_bias_the_checkpoint_lacks_or_has(saved):
    _, path = saved
    for index, bias in ((0, False), (2, True)):  # the checkpoint's "0" has a bias, its "2" none
        model = _mlp()
        model[index] = nn.Linear(model[index].in_features, model[index].out_features, bias=bias)
        with pytest.raises(CheckpointError, match=rf"layer '{index}' has (a|no) bias in the checkpoint but (none|one) in the model"):
            load_into(model, path)


def test_load_into_refuses_different_tensors_for_parameters_the_model_ties(tmp_path):
    def net(tied: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(40, 64), nn.Linear(64, 64), nn.Linear(64, 40, bias=False))
        if tied:
            model[2].weight = model[0].weight
        return model

    def quantized(tied: bool) -> nn.Module:
        model = net(tied)
        quantize_model(model, bits=4, skip=["0", "2"], progress=False)
        return model

    path = save_quantized(quantized(False), tmp_path / "untied.safetensors")
    with pytest.raises(CheckpointError, match=r"the model ties \['0.weight', '2.weight'\]"):
        load_into(quantized(True), path)
    path = save_quantized(quantized(True), tmp_path / "tied.safetensors")  # a tied model's own checkpoint loads
    load_into(quantized(True), path)


def test_a_layer_used_under_two_names_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.GELU(), shared)
    quantize_model(model, bits=4, skip=None, progress=False)
    path = save_quantized(model, tmp_path / "reused.safetensors")  # was refused as unlisted quantized planes
    other = nn.Linear(64, 64)
    loaded = nn.Sequential(other, nn.GELU(), other)
    load_into(loaded, path)
    x = torch.randn(3, 64)
    assert torch.equal(loaded(x), model(x))
