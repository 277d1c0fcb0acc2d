"""Checkpoints of models holding GGUF modules (``GGUFLinear`` / ``GGUFEmbedding``): bit-exact round
trips for every block type, the tied head stored once and tied again, validation of damaged and
mismatched files, the transformers plug-in's refusal, and ``load_gguf`` -> save -> load."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from torch import nn

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import quants  # noqa: E402

from kbit_linear import gguf_format as gf  # noqa: E402
from kbit_linear import serialization as ser  # noqa: E402
from kbit_linear.gguf_linear import GGUFEmbedding, GGUFLinear  # noqa: E402
from kbit_linear.linear import KbitLinear  # noqa: E402
from kbit_linear.patch import module_bytes, quantize_model  # noqa: E402
from kbit_linear.serialization import CheckpointError, load_into, load_quantized, save_quantized  # noqa: E402
from kbit_linear.serialization_gguf import gguf_metadata  # noqa: E402
from test_serialization import _forge, _read  # noqa: E402  (the same file reader and forger)

HIDDEN, NARROW, VOCAB = 64, 50, 40
QTYPES = sorted(gf.BLOCK_TYPES)
IDS = torch.tensor([[1, 5, 17, 33, 39, 0, 2, 20], [7, 7, 3, 11, 25, 38, 4, 9]])


def _blocks(weight: torch.Tensor, qtype: str) -> gf.GGUFWeight:
    """``weight`` quantized by the gguf package to ``qtype``, as the arrays of a GGUFWeight."""
    raw = torch.from_numpy(quants.quantize(weight.detach().float().numpy(), gguf.GGMLQuantizationType[qtype]))
    return gf.split_blocks(raw, qtype, *weight.shape)


class _TinyNet(nn.Module):
    """An embedding, one linear per block type with a bias and one without, a narrow linear
    (out_features 50) with a dense one after it (in_features 50 cannot be GGUF), a norm and a
    head tied to the embedding."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.biased = nn.ModuleDict({q: nn.Linear(HIDDEN, HIDDEN) for q in QTYPES})
        self.plain = nn.ModuleDict({q: nn.Linear(HIDDEN, HIDDEN, bias=False) for q in QTYPES})
        self.narrow = nn.Linear(HIDDEN, NARROW)
        self.back = nn.Linear(NARROW, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in (*self.biased.values(), *self.plain.values()):
            h = h + torch.tanh(layer(h))
        h = h + self.back(self.narrow(h))
        return self.head(self.norm(h))


def _gguf_net(seed: int = 0, embedding: str = "Q8_0", narrow: str = "Q5_1") -> _TinyNet:
    """:class:`_TinyNet` with GGUF modules: each dict's linears in their block type, the narrow
    linear in ``narrow``, the embedding in ``embedding`` and the head sharing its arrays."""
    model = _TinyNet(seed)
    for layers in (model.biased, model.plain):
        for qtype, linear in list(layers.items()):
            layers[qtype] = GGUFLinear.from_weight(_blocks(linear.weight, qtype), bias=linear.bias)
    model.narrow = GGUFLinear.from_weight(_blocks(model.narrow.weight, narrow), bias=model.narrow.bias)
    model.embed = GGUFEmbedding.from_weight(_blocks(model.embed.weight, embedding))
    model.head = GGUFLinear.from_weight(model.embed.weight_format())
    return model.eval()


def _gguf_prefixes(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))}


def _out(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def _assert_tied(model: nn.Module, head: str = "head", embed: str = "embed") -> None:
    """The head holds the embedding's array tensors (one copy), not equal copies."""
    h, e = model.get_submodule(head), model.get_submodule(embed)
    assert isinstance(h, GGUFLinear) and isinstance(e, GGUFEmbedding)
    for name in ("qs", "qh", "scale", "mins"):
        assert getattr(h, name) is getattr(e, name), name


@pytest.fixture
def saved(tmp_path):
    model = _gguf_net()
    path = save_quantized(model, tmp_path / "gguf.safetensors", metadata={"note": "gguf"})
    return model, path


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
    assert ckpt.metadata == {"note": "gguf"}
    modules = _gguf_prefixes(model)
    assert ckpt.gguf == {name: gguf_metadata(m) for name, m in modules.items()}
    assert len(ckpt.gguf) == 2 * len(QTYPES) + 3 and ckpt.layers == {} and ckpt.experts == {}
    for name, module in modules.items():
        stored = {k.rpartition(".")[2] for k in ckpt.tensors if k.rpartition(".")[0] == name}
        w = module.weight_format()
        fields = set(gf.field_shapes(w.qtype, w.out_features, w.in_features))
        assert stored == fields | ({"bias"} if getattr(module, "bias", None) is not None else set()), name
    assert ckpt.gguf["embed"] == {"kind": "embedding", "qtype": "Q8_0", "out_features": VOCAB, "in_features": HIDDEN,
                                  "bias": False, "embed_scale": None}
    assert ckpt.gguf["narrow"] == {"kind": "linear", "qtype": "Q5_1", "out_features": NARROW, "in_features": HIDDEN, "bias": True,
                                   "activation_bits": 16}


def test_tied_head_is_stored_once(saved):
    _, path = saved
    tensors, header = _read(path)
    aliases = json.loads(header[ser._KEY_ALIASES])
    assert aliases == {"head.qs": "embed.qs", "head.scale": "embed.scale"}
    assert "head.qs" not in tensors and "embed.qs" in tensors
    ckpt = load_quantized(path)
    assert ckpt.tensors["head.qs"] is ckpt.tensors["embed.qs"] and ckpt.tensors["head.scale"] is ckpt.tensors["embed.scale"]


def test_load_into_a_dense_model(saved):
    model, path = saved
    dense = _TinyNet(seed=1)  # other random weights, the head tied as a shared Parameter
    load_into(dense, path)
    assert {n: type(m) for n, m in dense.named_modules()} == {n: type(m) for n, m in model.named_modules()}
    for name, t in model.state_dict().items():
        assert torch.equal(dense.state_dict()[name], t), name
    assert torch.equal(_out(dense), _out(model))
    _assert_tied(dense)
    assert module_bytes(dense) == module_bytes(model)  # the table counted once
    assert not dense.training and dense.embed.dtype == torch.float32


def test_load_into_a_meta_model(saved):
    model, path = saved
    with torch.device("meta"):
        meta = _TinyNet()
    load_into(meta, path)
    assert all(t.device.type == "cpu" for t in (*meta.parameters(), *meta.buffers()))
    assert torch.equal(_out(meta), _out(model))
    _assert_tied(meta)


def test_load_into_a_gguf_model_fills_its_modules(saved):
    model, path = saved
    target = _gguf_net(seed=2)
    layer = target.biased["Q5_0"]
    load_into(target, path)
    assert target.biased["Q5_0"] is layer  # filled in place
    assert torch.equal(layer.qh, model.biased["Q5_0"].qh) and torch.equal(layer.bias, model.biased["Q5_0"].bias)
    assert torch.equal(_out(target), _out(model))
    _assert_tied(target)


def test_bfloat16_model_round_trip(tmp_path):
    model = _gguf_net().to(torch.bfloat16)
    assert model.embed.dtype == torch.bfloat16 and model.narrow.scale.dtype == torch.float16
    path = save_quantized(model, tmp_path / "bf16.safetensors")
    dense = _TinyNet(seed=3).to(torch.bfloat16)
    load_into(dense, path)
    assert dense.embed.dtype == torch.bfloat16 and dense.narrow.bias.dtype == torch.bfloat16
    assert torch.equal(_out(dense), _out(model))


def test_activation_bits_travel_with_the_checkpoint(tmp_path):
    model = _gguf_net()
    model.plain["Q5_0"].activation_bits = 8  # int8 activations change the outputs
    ref = _out(model)
    assert not torch.equal(ref, _out(_gguf_net()))
    path = save_quantized(model, tmp_path / "a8.safetensors")
    assert load_quantized(path).gguf["plain.Q5_0"]["activation_bits"] == 8
    dense = _TinyNet(seed=1)
    load_into(dense, path)
    in_place = _gguf_net(seed=2)
    in_place.plain["Q4_0"].activation_bits = 8  # the checkpoint's setting wins
    load_into(in_place, path)
    for loaded in (dense, in_place):
        assert {n: m.activation_bits for n, m in loaded.plain.items()} == {q: 8 if q == "Q5_0" else 16 for q in QTYPES}
        assert torch.equal(_out(loaded), ref)


def test_entry_without_activation_bits_reads_as_16(saved):
    _, path = saved
    tensors, header = _read(path)
    entry = json.loads(header["kbit_linear.gguf"])
    for meta in entry.values():
        meta.pop("activation_bits", None)
    header["kbit_linear.gguf"] = json.dumps(entry)
    _forge(path, tensors, header)
    assert {m.get("activation_bits") for m in load_quantized(path).gguf.values()} == {16, None}  # None: the embedding


def test_header_entry_only_with_gguf_modules(saved, tmp_path):
    _, path = saved
    _, header = _read(path)
    assert json.loads(header["kbit_linear.gguf"]) == load_quantized(path).gguf
    kbit = nn.Sequential(nn.Linear(64, 33), nn.GELU(), nn.Linear(33, 8)).eval()
    quantize_model(kbit, bits=4, progress=False)
    plain = save_quantized(kbit, tmp_path / "kbit.safetensors")
    _, header = _read(plain)
    assert "kbit_linear.gguf" not in header
    assert load_quantized(plain).gguf == {}


def test_save_state_dict_with_gguf(tmp_path):
    model = _gguf_net()
    meta = {name: gguf_metadata(m) for name, m in _gguf_prefixes(model).items()}
    path = save_quantized(model.state_dict(), tmp_path / "sd.safetensors", gguf=meta)
    assert load_quantized(path).gguf == meta
    with pytest.raises(CheckpointError, match=r"'embed.qs', 'head.qs'.* look like the arrays of GGUF modules .*pass gguf="):
        save_quantized(model.state_dict(), tmp_path / "bad.safetensors")
    with pytest.raises(TypeError, match="gguf= are only for a state dict"):
        save_quantized(model, tmp_path / "bad.safetensors", gguf=meta)


def test_save_refuses_a_non_finite_scale(tmp_path):
    model = _gguf_net()
    model.plain["Q4_1"].scale[3, 1] = float("nan")
    path = tmp_path / "nan.safetensors"
    with pytest.raises(CheckpointError, match=r"layer 'plain.Q4_1': 'scale' holds a non-finite value \(row 3, block 1"):
        save_quantized(model, path)
    assert not path.exists()


def test_prefix_listed_as_kbit_layer_and_gguf_module(tmp_path):
    kbit = nn.Sequential(nn.Linear(64, 33)).eval()
    quantize_model(kbit, bits=3, progress=False)
    state = dict(kbit.state_dict())
    weight = _blocks(torch.randn(33, 64), "Q8_0")
    state.update({"0.qs": weight.qs, "0.scale": weight.scale})
    gguf_meta = {"0": {"kind": "linear", "qtype": "Q8_0", "out_features": 33, "in_features": 64, "bias": True}}
    with pytest.raises(CheckpointError, match=r"\['0'\] are listed both as GGUF modules and as kbit layers"):
        save_quantized(state, tmp_path / "both.safetensors", layers={"0": ser.layer_metadata(kbit[0])}, gguf=gguf_meta)


def test_a_loader_without_the_format_fails_loudly(saved):
    """No ``weight`` is stored for a GGUF module: a strict plain load names what is missing and unexpected."""
    _, path = saved
    tensors = load_quantized(path).tensors
    with pytest.raises(RuntimeError, match=r'(?s)Missing key\(s\).*"embed.weight".*Unexpected key\(s\).*"embed.qs"'):
        _TinyNet().load_state_dict(tensors, strict=True)


# ---------------------------------------------------------------------------------------
# damaged and mismatched files
# ---------------------------------------------------------------------------------------


def test_flipped_byte_of_an_array_fails_its_checksum(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8 : 8 + header_len])["biased.Q5_0.qh"]["data_offsets"]
    data[8 + header_len + start + 5] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'biased.Q5_0.qh' fails its sha256 check"):
        load_quantized(path)


def test_edited_gguf_entry_fails_the_header_digest(saved):
    _, path = saved
    tensors, header = _read(path)
    entry = json.loads(header["kbit_linear.gguf"])
    entry["plain.Q8_0"]["qtype"] = "Q4_0"
    header["kbit_linear.gguf"] = json.dumps(entry, sort_keys=True)
    safetensors.torch.save_file(tensors, str(path), metadata=header)  # digest and sums untouched
    with pytest.raises(CheckpointError, match="header metadata fails its sha256 check"):
        load_quantized(path)


def _gguf_edit(prefix, key, value):
    def edit(tensors, header):
        entry = json.loads(header["kbit_linear.gguf"])
        if value is _DELETE:
            del entry[prefix][key]
        else:
            entry[prefix][key] = value
        header["kbit_linear.gguf"] = json.dumps(entry)

    return edit


def _drop_entry(prefix):
    def edit(tensors, header):
        entry = json.loads(header["kbit_linear.gguf"])
        del entry[prefix]
        header["kbit_linear.gguf"] = json.dumps(entry)

    return edit


def _tensor_edit(name, fn):
    def edit(tensors, header):
        if fn is None:
            del tensors[name]
        else:
            tensors[name] = fn(tensors.get(name))

    return edit


def _header_edit(key, value):
    def edit(tensors, header):
        header[key] = value

    return edit


def _infinite_scale(scale):
    scale = scale.clone()
    scale[5, 1] = float("inf")
    return scale


_DELETE = object()

CORRUPTIONS = {
    "wrong-qtype": (_gguf_edit("biased.Q4_0", "qtype", "Q4_1"), r"layer 'biased.Q4_0': tensors \['mins'\] are missing"),
    "wrong-qtype-same-fields": (_gguf_edit("plain.Q4_0", "qtype", "Q8_0"), r"layer 'plain.Q4_0': qs must be torch.int8 \(64, 64\)"),
    "unknown-qtype": (_gguf_edit("plain.Q4_0", "qtype", "Q4_K"), r"layer 'plain.Q4_0': GGUF metadata: qtype must be one of"),
    "wrong-out-features": (_gguf_edit("narrow", "out_features", 51), r"layer 'narrow': qs must be torch.uint8 \(51, 32\)"),
    "wrong-in-features": (_gguf_edit("narrow", "in_features", 96), r"layer 'narrow': qs must be torch.uint8 \(50, 48\)"),
    "in-features-off-block": (_gguf_edit("narrow", "in_features", 48), r"layer 'narrow': GGUF metadata: in_features=48 is not a multiple"),
    "wrong-kind": (_gguf_edit("narrow", "kind", "conv"), r"layer 'narrow': GGUF metadata 'kind' must be one of"),
    "missing-key": (_gguf_edit("narrow", "qtype", _DELETE), r"layer 'narrow': GGUF metadata lacks 'qtype'"),
    "bias-flag": (_gguf_edit("biased.Q8_0", "bias", False), r"layer 'biased.Q8_0': unexpected tensors \['bias'\]"),
    "missing-bias": (_gguf_edit("plain.Q8_0", "bias", True), r"layer 'plain.Q8_0': tensors \['bias'\] are missing"),
    "embedding-bias": (_gguf_edit("embed", "bias", True), r"layer 'embed': .*embeddings have none"),
    "activation-bits": (_gguf_edit("narrow", "activation_bits", 4), r"layer 'narrow': GGUF metadata 'activation_bits' must be 8 or 16"),
    "activation-bits-on-embedding": (_gguf_edit("embed", "activation_bits", 8), r"layer 'embed': GGUF metadata 'activation_bits' belongs to a linear"),
    "embed-scale-not-a-number": (_gguf_edit("embed", "embed_scale", "x"), r"layer 'embed': GGUF metadata 'embed_scale' must be a finite"),
    "wrong-scale-shape": (_tensor_edit("plain.Q8_0.scale", lambda t: t[:, :1].contiguous()),
                          r"layer 'plain.Q8_0': scale must be torch.float16 \(64, 2\)"),
    "wrong-qs-dtype": (_tensor_edit("biased.Q4_1.qs", lambda t: t.view(torch.int8)), r"layer 'biased.Q4_1': qs must be torch.uint8"),
    "wrong-bias-shape": (_tensor_edit("narrow.bias", lambda t: t[:7].contiguous()), r"layer 'narrow': 'bias' has shape \(7,\)"),
    "missing-qh": (_tensor_edit("plain.Q5_1.qh", None), r"layer 'plain.Q5_1': tensors \['qh'\] are missing"),
    "extra-weight": (_tensor_edit("plain.Q4_0.weight", lambda _: torch.zeros(HIDDEN, HIDDEN)),
                     r"layer 'plain.Q4_0': unexpected tensors \['weight'\]"),
    "extra-qh": (_tensor_edit("plain.Q4_0.qh", lambda _: torch.zeros(HIDDEN, 2, dtype=torch.int32)),
                 r"layer 'plain.Q4_0': unexpected tensors \['qh'\]"),
    "non-finite-scale": (_tensor_edit("biased.Q5_1.scale", _infinite_scale), r"layer 'biased.Q5_1': 'scale' holds a non-finite value"),
    "non-finite-min": (_tensor_edit("plain.Q4_1.mins", _infinite_scale), r"layer 'plain.Q4_1': 'mins' holds a non-finite value"),
    "unlisted-arrays": (_drop_entry("narrow"), r"\['narrow.qs'\] look like the arrays of GGUF modules"),
    "bad-gguf-json": (_header_edit("kbit_linear.gguf", "{not json"), r"'kbit_linear.gguf' is not valid JSON"),
    "gguf-entry-not-an-object": (_header_edit("kbit_linear.gguf", "[]"), r"'kbit_linear.gguf' must be a JSON object"),
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


def test_partly_shared_arrays_are_refused(saved):
    _, path = saved
    tensors, header = _read(path)
    tensors["head.scale"] = tensors["embed.scale"].clone()
    header[ser._KEY_ALIASES] = json.dumps({"head.qs": "embed.qs"})
    _forge(path, tensors, header)
    with pytest.raises(CheckpointError, match=r"layer 'head' shares 'qs' with 'embed' but not 'scale'"):
        load_into(_TinyNet(), path)


class _SubLinear(nn.Linear):
    pass


class _ScaledEmbedding(nn.Embedding):
    """A scaled word embedding: ``embedding(ids) * embed_scale``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(8.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _narrow_linear(out_features: int = NARROW) -> nn.Module:
    return nn.Linear(HIDDEN, out_features)


MISMATCHES = {
    "other-shape": (lambda m: setattr(m, "narrow", _narrow_linear(51)), r"layer 'narrow' is 50x64 in the checkpoint but 51x64 in the model"),
    "subclass": (lambda m: setattr(m, "narrow", _SubLinear(HIDDEN, NARROW)), r"layer 'narrow' is a _SubLinear in the model.*never swapped"),
    "other-qtype": (lambda m: m.biased.__setitem__("Q4_0", GGUFLinear(HIDDEN, HIDDEN, "Q8_0", bias=True)),
                    r"layer 'biased.Q4_0' is GGUFLinear \(qtype, out, in, bias\)=\('Q4_0', 64, 64, True\) in the checkpoint "
                    r"but \('Q8_0', 64, 64, True\)"),
    "no-module": (lambda m: delattr(m, "narrow"), r"layer 'narrow' has no module in the model"),
    "linear-for-embedding": (lambda m: setattr(m, "embed", nn.Linear(HIDDEN, VOCAB)), r"layer 'embed' is a Linear in the model, not nn.Embedding"),
    "scaled-embedding": (lambda m: setattr(m, "embed", _ScaledEmbedding(VOCAB, HIDDEN)),
                         r"layer 'embed' is a _ScaledEmbedding in the model \(a subclass of nn.Embedding\), but the checkpoint holds a plain"),
    "max-norm": (lambda m: setattr(m, "embed", nn.Embedding(VOCAB, HIDDEN, max_norm=1.0)), r"layer 'embed': the model's embedding renormalizes"),
    "bias-dropped": (lambda m: setattr(m, "narrow", nn.Linear(HIDDEN, NARROW, bias=False)),
                     r"layer 'narrow' has a bias in the checkpoint but none in the model"),
}


def test_load_into_refuses_another_embed_scale(tmp_path):
    weight = _blocks(torch.randn(40, 64), "Q8_0")
    path = save_quantized(nn.Sequential(GGUFEmbedding.from_weight(weight, embed_scale=8.0)), tmp_path / "scaled.safetensors")
    with pytest.raises(CheckpointError, match=r"embed_scale is 8.0 in the checkpoint but 2.0 in the model"):
        load_into(nn.Sequential(GGUFEmbedding(40, 64, "Q8_0", embed_scale=2.0)), path)
    load_into(nn.Sequential(GGUFEmbedding(40, 64, "Q8_0", embed_scale=8.0)), path)  # the same factor loads


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_load_into_mismatched_model(saved, case):
    _, path = saved
    change, pattern = MISMATCHES[case]
    model = _TinyNet()
    change(model)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_into(model, path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------------------
# transformers models
# ---------------------------------------------------------------------------------------


def _to_gguf(model: nn.Module, types: list[str]) -> None:
    """Every linear of the decoder layers (types in turn) and the embedding (Q8_0) as GGUF modules;
    a tied head shares the embedding's arrays, an untied one is Q4_1."""
    from kbit_linear.patch import replace_module

    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    for i, name in enumerate(linears):
        module = model.get_submodule(name)
        replace_module(model, name, GGUFLinear.from_weight(_blocks(module.weight, types[i % len(types)]), bias=module.bias))
    old = model.get_input_embeddings()
    scale = getattr(old, "embed_scale", None)
    emb = GGUFEmbedding.from_weight(_blocks(old.weight, "Q8_0"), padding_idx=old.padding_idx, embed_scale=scale)
    tied = model.lm_head.weight is old.weight
    model.set_input_embeddings(emb)
    model.lm_head = GGUFLinear.from_weight(emb.weight_format() if tied else _blocks(model.lm_head.weight, "Q4_1"))


def _llama_config(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, attention_bias=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_round_trip(tmp_path, tied):
    cfg = _llama_config(tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _to_gguf(model, QTYPES)
    ref = _out(model)
    path = save_quantized(model, tmp_path / "llama.safetensors")
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(cfg).eval()
    load_into(fresh, path)
    assert torch.equal(_out(fresh), ref)
    if tied:
        _assert_tied(fresh, "lm_head", "model.embed_tokens")
        fresh.tie_weights()  # transformers' own tying leaves the GGUF pair alone
        _assert_tied(fresh, "lm_head", "model.embed_tokens")
        assert torch.equal(_out(fresh), ref)
    else:
        assert fresh.lm_head.qs is not fresh.model.embed_tokens.qs and fresh.lm_head.qtype == "Q4_1"


def test_gemma3_scaled_embedding_round_trip(tmp_path):
    cfg = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    _to_gguf(model, ["Q4_0", "Q5_1"])
    ref = _out(model)
    path = save_quantized(model, tmp_path / "gemma.safetensors")
    assert load_quantized(path).gguf["model.embed_tokens"]["embed_scale"] == 8.0  # sqrt(hidden_size)
    torch.manual_seed(1)
    fresh = transformers.Gemma3ForCausalLM(cfg).eval()
    load_into(fresh, path)
    emb = fresh.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding) and float(emb.embed_scale) == 8.0
    assert torch.equal(_out(fresh), ref)
    _assert_tied(fresh, "lm_head", "model.embed_tokens")
    unscaled = transformers.Gemma3ForCausalLM(cfg).eval()
    unscaled.model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
    with pytest.raises(CheckpointError, match=r"layer 'model.embed_tokens': .*embed_scale=8.0, but the model's Embedding has no embed_scale"):
        load_into(unscaled, path)


def test_plugin_refuses_to_save_or_load_gguf_modules(tmp_path):
    from transformers import AutoModelForCausalLM

    from kbit_linear import KbitConfig

    cfg = _llama_config(tied=False)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(cfg).eval()
    dense.save_pretrained(tmp_path / "dense")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=KbitConfig(bits=4)).eval()
    assert isinstance(model.model.layers[0].mlp.down_proj, KbitLinear)
    model.save_pretrained(tmp_path / "kbit")  # a kbit folder: config.json says quant_method "kbit"
    down = dense.model.layers[0].mlp.down_proj.weight
    model.model.layers[0].mlp.down_proj = GGUFLinear.from_weight(_blocks(down, "Q8_0"))
    with pytest.raises(ValueError, match=r"save_pretrained cannot write GGUF modules \(model.layers.0.mlp.down_proj\).*save_quantized"):
        model.save_pretrained(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.safetensors"))
    # a save_quantized file with GGUF modules in a kbit folder: from_pretrained refuses it too
    save_quantized(model, tmp_path / "kbit" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"holds GGUF modules \(model.layers.0.mlp.down_proj\).*load_into"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "kbit")


@pytest.mark.parametrize("output", [None, "Q5_1"], ids=["tied", "untied"])
def test_load_gguf_save_load(tmp_path, output):
    from test_gguf_loader import TOKENS, write_tiny_llama
    from transformers import AutoModelForCausalLM

    from kbit_linear.gguf_loader import load_gguf

    model = load_gguf(write_tiny_llama(tmp_path / "tiny.gguf", output=output), progress=False)
    kinds = {type(m) for m in model.modules()}
    assert {GGUFLinear, GGUFEmbedding, KbitLinear, nn.Linear} <= kinds  # kept, requantized (Q4_K) and dense (F16)
    ref = _out(model, TOKENS)
    path = save_quantized(model, tmp_path / "tiny.safetensors")
    ckpt = load_quantized(path)
    for name, t in model.state_dict().items():
        assert torch.equal(ckpt.tensors[name], t), name
    fresh = AutoModelForCausalLM.from_config(model.config).eval()
    load_into(fresh, path)
    assert {n: type(m) for n, m in fresh.named_modules()} == {n: type(m) for n, m in model.named_modules()}
    assert torch.equal(_out(fresh, TOKENS), ref)
    if output is None:
        _assert_tied(fresh, "lm_head", "model.embed_tokens")


def test_gguf_linear_names_a_zero_dimensional_input():
    layer = GGUFLinear.from_weight(_blocks(torch.randn(8, 64), "Q8_0"))
    with pytest.raises(ValueError, match="in_features=64"):
        layer(torch.tensor(1.0))
