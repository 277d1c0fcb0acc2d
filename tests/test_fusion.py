"""Horizontal fusion of sibling projections (kbit_linear.fusion): one GEMM per group, the same
results, state dicts and checkpoints as the unfused layers.

The CPU tests run the reference GEMM; the ``cuda`` tests compare the fused kernels' output with
the unfused layers' on the GPU (relative Frobenius error; another plan may sum in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kbit_linear
from kbit_linear.fusion import FusedKbitLinear, KbitLinearSlice, fuse_projections, kbit_layers, unfuse_projections

HAS_CUDA = torch.cuda.is_available()
try:
    import cupy  # noqa: F401
except ImportError:
    HAS_CUDA = False


class _Attention(nn.Module):
    """The call pattern of a decoder layer: q/k/v on one input (q viewed as heads), gate/up on
    another, then the output projections."""

    def __init__(self, hidden: int = 256, kv: int = 192, inter: int = 320, bias: bool = True) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, kv, bias=bias)
        self.v_proj = nn.Linear(hidden, kv, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(*x.shape[:-1], 4, -1).transpose(-2, -3)
        k, v = self.k_proj(x), self.v_proj(x)
        h = x + self.o_proj(q.transpose(-2, -3).flatten(-2)) + (k * v).sum(-1, keepdim=True) / k.shape[-1]
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class _Model(nn.Module):
    def __init__(self, layers: int = 2, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attention(**kw) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _quantized(bits: int = 4, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **kw) -> _Model:
    torch.manual_seed(seed)
    model = _Model(**kw).to(device=device, dtype=dtype)
    kbit_linear.quantize_model(model, bits=bits, codebook=None, progress=False)
    return model


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_fused_model_matches_the_unfused_one(bits: int) -> None:
    model = _quantized(bits)
    ref_model = copy.deepcopy(model)
    summary = fuse_projections(model)
    assert set(summary.fused) == {f"layers.{i}.{g}" for i in range(2) for g in ("q_proj/k_proj/v_proj", "gate_proj/up_proj")}
    assert not summary.skipped
    layer = model.layers[0]
    assert isinstance(layer.q_proj, KbitLinearSlice) and isinstance(layer.fused_q_k_v, FusedKbitLinear)
    # k_proj (192 wide) keeps its padding: v starts on the next 128-feature tile
    assert layer.fused_q_k_v.offsets == (0, 256, 512) and layer.fused_q_k_v.out_features == 512 + 192
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(model(x), ref_model(x), rtol=1e-5, atol=1e-5)


def _in_one_parent_call(parent: nn.Module, calls) -> list:
    """Run ``calls`` (callables) inside one call of ``parent`` (its hooks run around them), as
    its own forward would."""
    parent.forward = lambda: [c() for c in calls]
    try:
        return parent()
    finally:
        del parent.forward


def test_each_part_equals_its_own_layer_and_the_group_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _quantized()
    ref = copy.deepcopy(model.layers[0])
    fuse_projections(model)
    layer = model.layers[0]
    fused = layer.fused_q_k_v
    calls = []
    forward = FusedKbitLinear.forward
    monkeypatch.setattr(FusedKbitLinear, "forward", lambda self, x: calls.append(1) or forward(self, x))
    x, other = torch.randn(4, 256), torch.randn(4, 256)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    # any order; each part once on the same tensor within one call of the parent: one GEMM
    out = _in_one_parent_call(layer, [lambda n=n: getattr(layer, n)(x) for n in ("v_proj", "q_proj", "k_proj")])
    for got, n in zip(out, ("v_proj", "q_proj", "k_proj")):
        close(got, getattr(ref, n)(x))
    assert len(calls) == 1
    assert not fused.holds_product and not fused.in_parent_call
    # a part called twice on one tensor, or on another tensor, computes again (and is still right)
    calls.clear()
    out = _in_one_parent_call(layer, [lambda: layer.q_proj(x), lambda: layer.q_proj(x), lambda: layer.k_proj(other),
                                      lambda: layer.v_proj(x)])
    for got, want in zip(out, (ref.q_proj(x), ref.q_proj(x), ref.k_proj(other), ref.v_proj(x))):
        close(got, want)
    assert len(calls) == 4  # q, q again, k on another tensor, v (the pending product is k's input's)
    # an input changed in place between the parts: computed again
    calls.clear()
    y = x.clone()
    out = _in_one_parent_call(layer, [lambda: layer.q_proj(y), lambda: y.mul_(2), lambda: layer.k_proj(y)])
    close(out[2], ref.k_proj(2 * x))
    assert len(calls) == 2
    # another grad mode: computed again, with the grad mode's result
    calls.clear()
    z = x.clone().requires_grad_()

    def q_without_grad():
        with torch.no_grad():
            return layer.q_proj(z)

    out = _in_one_parent_call(layer, [q_without_grad, lambda: layer.k_proj(z)])
    assert not out[0].requires_grad and out[1].requires_grad and len(calls) == 2
    # outside a call of the parent nothing is shared (and nothing is held)
    calls.clear()
    for n in ("q_proj", "k_proj", "v_proj"):
        close(getattr(layer, n)(x), getattr(ref, n)(x))
    assert len(calls) == 3 and not fused.holds_product
    with pytest.raises(ValueError, match="in_features=256"):
        layer.q_proj(torch.randn(2, 255))


def test_pending_product_is_dropped_when_the_parent_call_ends_or_the_weights_change() -> None:
    model = _quantized(seed=2)
    other = _quantized(seed=8)
    fuse_projections(model)
    layer = model.layers[0]
    x = torch.randn(3, 256)
    _in_one_parent_call(layer, [lambda: layer.q_proj(x)])  # k and v never called
    assert not layer.fused_q_k_v.holds_product
    # weights loaded between two parts of one call: the second part sees the new weights
    sd = other.state_dict()
    out = _in_one_parent_call(layer, [lambda: layer.q_proj(x), lambda: model.load_state_dict(sd), lambda: layer.k_proj(x)])
    torch.testing.assert_close(out[2], other.layers[0].k_proj(x), rtol=1e-5, atol=1e-5)


def test_state_dict_load_and_unfuse_are_bit_identical() -> None:
    model = _quantized(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    # load another model's state dict into the fused model: it computes as that model
    other = _quantized(seed=4)
    model.load_state_dict(other.state_dict())
    x = torch.randn(2, 256)
    torch.testing.assert_close(model(x), other(x), rtol=1e-5, atol=1e-5)
    assert unfuse_projections(model) == 10
    assert not any(isinstance(m, (KbitLinearSlice, FusedKbitLinear)) for m in model.modules())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_loading_a_mismatched_state_dict_fails_loudly() -> None:
    model = _quantized()
    fuse_projections(model)
    sd = model.state_dict()
    bad = dict(sd)
    bad["layers.0.k_proj.codebook"] = bad["layers.0.k_proj.codebook"] * 0.5
    with pytest.raises(RuntimeError, match="unfuse_projections"):
        model.load_state_dict(bad)
    bad = dict(sd)
    bad["layers.0.v_proj.weight"] = bad["layers.0.v_proj.weight"][:, :1]
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad)
    bad = dict(sd)
    del bad["layers.1.up_proj.absmax"]
    with pytest.raises(RuntimeError, match="layers.1.up_proj.absmax"):
        model.load_state_dict(bad)
    bad = dict(sd)
    bad["layers.0.q_proj.absmax"] = bad["layers.0.q_proj.absmax"].float()
    with pytest.raises(RuntimeError, match="dtype"):
        model.load_state_dict(bad)


def test_groups_that_cannot_share_a_gemm_are_left_apart_with_the_reason() -> None:
    torch.manual_seed(0)
    model = _Model(layers=1)
    kbit_linear.quantize_model(model, bits=4, codebook="fitted", progress=False)  # levels per weight
    summary = fuse_projections(model)
    assert not summary.fused
    assert "different codebooks" in summary.skipped["layers.0.q_proj/k_proj/v_proj"]
    model = _Model(layers=1)
    kbit_linear.quantize_model(model, bits=4, codebook=None, progress=False, skip=["k_proj"])
    model.layers[0].up_proj = kbit_linear.KbitLinear.from_linear(nn.Linear(256, 320), bits=3)
    summary = fuse_projections(model)
    assert "not a KbitLinear" in summary.skipped["layers.0.q_proj/k_proj/v_proj"]
    assert "bits=3" in summary.skipped["layers.0.gate_proj/up_proj"]
    with pytest.raises(TypeError, match="groups"):
        fuse_projections(model, groups="q_proj")
    with pytest.raises(ValueError, match="two distinct"):
        fuse_projections(model, groups=[("q_proj", "q_proj")])
    with pytest.raises(TypeError, match="model"):
        fuse_projections("model")


def test_dtype_casts_keep_the_format_and_the_group() -> None:
    model = _quantized()
    fuse_projections(model)
    x = torch.randn(2, 256)
    ref = model(x)
    model.to(torch.bfloat16)
    fused = model.layers[0].fused_q_k_v
    assert fused.codebook.dtype == torch.float32 and fused.tensor_scale.dtype == torch.float32
    assert fused.bias.dtype == torch.bfloat16 and model.layers[0].q_proj.bias.dtype == torch.bfloat16
    assert _rel_err(model(x.bfloat16()), ref) < 3e-2


def test_quantize_model_fuse_shares_fitted_levels_per_group() -> None:
    torch.manual_seed(1)
    model = _Model(layers=2)
    ref = copy.deepcopy(model)
    summary = kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)  # default: fitted levels
    assert len(summary.fusion.fused) == 4 and not summary.fusion.skipped
    assert "fused 4 groups" in str(summary)
    layer = model.layers[0]
    assert not torch.equal(layer.fused_q_k_v.codebook, layer.fused_gate_up.codebook)  # fitted per group
    # one set of levels fitted to the group is about as good as one per layer
    apart = copy.deepcopy(ref)
    kbit_linear.quantize_model(apart, bits=4, progress=False)
    x = torch.randn(8, 256)
    err_fused, err_apart = _rel_err(model(x), ref(x)), _rel_err(apart(x), ref(x))
    assert err_fused < 1.5 * err_apart
    with pytest.raises(ValueError, match="hadamard_search"):
        kbit_linear.quantize_model(copy.deepcopy(ref), bits=3, fuse=True, hadamard=True, hadamard_search=2, progress=False)
    with pytest.raises(TypeError, match="fuse"):
        kbit_linear.quantize_model(copy.deepcopy(ref), bits=3, fuse=1, progress=False)


def test_quantize_model_fuse_with_hadamard_shares_the_rotation() -> None:
    torch.manual_seed(2)
    model = _Model(layers=1)
    ref = copy.deepcopy(model)
    summary = kbit_linear.quantize_model(model, bits=3, fuse=True, hadamard=True, progress=False)
    assert len(summary.fusion.fused) == 2
    assert model.layers[0].fused_q_k_v.hadamard_signs is not None
    x = torch.randn(4, 256)
    assert _rel_err(model(x), ref(x)) < 0.3


def test_save_quantized_and_load_into_a_fused_model(tmp_path) -> None:
    model = _quantized(seed=5)
    unfused_sd = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    path = kbit_linear.save_quantized(model, tmp_path / "m.safetensors")
    # into a dense model: the layers come back as KbitLinear, equal to the unfused ones
    torch.manual_seed(9)
    dense = _Model()
    kbit_linear.load_into(dense, path)
    for k, v in unfused_sd.items():
        assert torch.equal(dense.state_dict()[k], v), k
    # into a fused model (another one): it computes as the saved one
    target = _quantized(seed=6)
    fuse_projections(target)
    kbit_linear.load_into(target, path)
    x = torch.randn(2, 256)
    torch.testing.assert_close(target(x), model(x), rtol=1e-5, atol=1e-5)
    names = [n for n, _ in kbit_layers(model)]
    assert "layers.0.q_proj" in names and "layers.1.down_proj" in names and len(names) == 14


def test_compiled_model_calls_one_gemm_per_group() -> None:
    model = _quantized(seed=7)
    x = torch.randn(3, 256)
    with torch.no_grad():
        ref = model(x)
    fuse_projections(model)
    gemms: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        gemms.append(sum(1 for n in gm.graph.nodes if "kbit_linear.gemm" in str(n.target)))
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert gemms == [2 * 4]  # per layer: q/k/v, o, gate/up, down
    assert not model.layers[0].fused_q_k_v.holds_product


# ---------------------------------------------------------------------------------------
# transformers models
# ---------------------------------------------------------------------------------------


def _tiny_llama(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_transformers_llama_fused_generates_as_unfused() -> None:
    model = _tiny_llama()
    summary = kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)
    assert len(summary.fusion.fused) == 4  # two layers: q/k/v (k/v 48 wide, padded) and gate/up
    apart = copy.deepcopy(model)
    unfuse_projections(apart)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, apart(ids).logits, rtol=1e-4, atol=1e-4)
        kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(model.generate(ids, **kw), apart.generate(ids, **kw))


def test_transformers_save_and_reload_with_fuse(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    _tiny_llama(seed=2).save_pretrained(tmp_path / "dense")
    config = kbit_linear.KbitConfig(bits=4, codebook=None, fuse=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), quantization_config=config)
    assert len(model.kbit_fusion.fused) == 4 and isinstance(model.model.layers[0].self_attn.k_proj, KbitLinearSlice)
    model.save_pretrained(tmp_path / "q")
    stored = (tmp_path / "q" / "config.json").read_text()
    assert '"fuse": true' in stored and "fused_q_k_v" not in stored
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"))
    assert len(again.kbit_fusion.fused) == 4
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
    # the stored config fuses again at load (transformers keeps a checkpoint's own quantization
    # config); unfuse_projections gives the separate layers back
    assert unfuse_projections(again) == 10
    assert type(again.model.layers[0].self_attn.k_proj) is kbit_linear.KbitLinear
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------
# GPU: the fused kernels against the unfused layers
# ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and CuPy")
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_kernels_match_the_unfused_layers_on_the_gpu(bits: int, dtype: torch.dtype) -> None:
    model = _quantized(bits, device="cuda", dtype=dtype, seed=bits, hidden=512, kv=192, inter=1408)
    ref = copy.deepcopy(model)
    assert len(fuse_projections(model).fused) == 4
    for m in (1, 5, 16, 17, 40, 300):
        x = torch.randn(m, 512, device="cuda", dtype=dtype)
        with torch.no_grad():
            y, r = model(x), ref(x)
        assert torch.isfinite(y).all()
        assert _rel_err(y, r) < 2e-2, (m, _rel_err(y, r))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and CuPy")
def test_fused_model_under_cuda_graphs_and_device_moves() -> None:
    model = _quantized(4, device="cuda", dtype=torch.float16, seed=11, hidden=512, kv=128, inter=1024)
    ref = copy.deepcopy(model)
    fuse_projections(model)
    x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        want = ref(x)
        model(x)  # compile the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        out.fill_(float("nan"))
        graph.replay()
    assert _rel_err(out, want) < 2e-2
    # to the CPU (planes) and back (pair codes at 4 bits): still one copy, still right
    model.cpu()
    assert model.layers[0].fused_q_k_v.weight.dtype == torch.int32
    model.cuda()
    with torch.no_grad():
        assert _rel_err(model(x), want) < 2e-2


def test_transformers_quantize_at_load_fits_each_group_together(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    dense = _tiny_llama(seed=4)
    dense.save_pretrained(tmp_path / "dense")
    ref = copy.deepcopy(dense)
    summary = kbit_linear.quantize_model(ref, bits=4, fuse=True, progress=False)  # fitted levels, one set per group
    assert len(summary.fusion.fused) == 4
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"),
                                                              quantization_config=kbit_linear.KbitConfig(bits=4, fuse=True))
    assert len(model.kbit_fusion.fused) == 4 and not model.kbit_fusion.skipped
    # the same tensors as quantize_model's (the loader's order does not matter)
    got, want = model.state_dict(), ref.state_dict()
    for k, v in want.items():
        if "layers" in k and "proj" in k:
            assert torch.equal(got[k], v), k
    with pytest.raises(ValueError, match="hadamard_search"):
        kbit_linear.KbitConfig(bits=3, fuse=True, hadamard=True, hadamard_search=2)


def test_transformers_quantize_at_load_with_a_sibling_missing_from_the_checkpoint(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    _tiny_llama(seed=5).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    kept_q = tensors["model.layers.0.self_attn.q_proj.weight"].clone()
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=kbit_linear.KbitConfig(bits=4, fuse=True))
    # q_proj waited for v_proj, which never came: it is quantized from its real weight after loading
    q = model.model.layers[0].self_attn.q_proj
    assert _rel_err(q.dequantize(), kept_q) < 0.15


def test_adapters_need_the_unfused_layers() -> None:
    peft = pytest.importorskip("peft")
    from kbit_linear.integrations.peft import register_lora_layers

    model = _quantized()
    fuse_projections(model)
    with pytest.raises(ValueError, match="unfuse_projections"):
        register_lora_layers(peft.LoraConfig(r=4, target_modules="all-linear"), model)
    # named targets and no model to check: PEFT reaches the fused part and gets the same advice
    config = register_lora_layers(peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    with pytest.raises(ValueError, match="unfuse_projections"):
        peft.get_peft_model(model, config)
    model = _quantized()
    fuse_projections(model)
    unfuse_projections(model)
    config = register_lora_layers(peft.LoraConfig(r=4, target_modules="all-linear"), model)
    assert "layers.0.q_proj" in config.target_modules
    peft.get_peft_model(model, config)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_models_fuse_their_attention_projections(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config = (transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=40, head_dim=16, num_experts=6,
                                          num_experts_per_tok=3) if family == "qwen3_moe"
              else transformers.MixtralConfig(**common, intermediate_size=80, num_local_experts=4, num_experts_per_tok=2))
    model, summary = _fused_from_config(transformers, config)
    assert set(summary.fusion.fused) == {f"model.layers.{i}.self_attn.q_proj/k_proj/v_proj" for i in range(2)}
    assert len(summary.experts) == 2  # the experts are quantized as before, not fused


def _fused_from_config(transformers, config) -> tuple[nn.Module, object]:
    """A random model of ``config`` quantized with ``fuse=True``, its logits checked against the
    same model unfused; the model and the quantization summary."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    summary = kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)
    apart = copy.deepcopy(model)
    unfuse_projections(apart)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, apart(ids).logits, rtol=1e-4, atol=1e-4)
    return model, summary


def test_parts_with_different_ranges_share_the_largest_tensor_scale() -> None:
    torch.manual_seed(3)
    model = _Model(layers=1)
    with torch.no_grad():  # tensor scales 2**s with max|W| / 2**s <= 31: these differ per part
        model.layers[0].k_proj.weight.mul_(300.0)
        model.layers[0].up_proj.weight.mul_(0.01)
    ref = copy.deepcopy(model)
    apart = copy.deepcopy(model)
    kbit_linear.quantize_model(apart, bits=4, progress=False)
    assert not torch.equal(apart.layers[0].q_proj.tensor_scale, apart.layers[0].k_proj.tensor_scale)
    summary = kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)
    assert len(summary.fusion.fused) == 2, summary.fusion.skipped
    fused = model.layers[0].fused_q_k_v
    assert torch.equal(fused.tensor_scale, apart.layers[0].k_proj.tensor_scale)  # the largest
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        w = getattr(ref.layers[0], name).weight
        err_fused = _rel_err(getattr(model.layers[0], name).dequantize(), w)
        err_apart = _rel_err(getattr(apart.layers[0], name).dequantize(), w)
        assert err_fused < 1.1 * err_apart, (name, err_fused, err_apart)


def test_what_fusion_leaves_alone() -> None:
    class CrossAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder_attn = _Attention(hidden=64, kv=64, inter=64)
            self.crossattention = CrossAttention()
            self.self_attn = _Attention(hidden=64, kv=64, inter=64)

    model = Decoder()
    kbit_linear.quantize_model(model, bits=4, codebook=None, progress=False)
    seen = []
    model.self_attn.gate_proj.register_forward_hook(lambda *a: seen.append(1))
    summary = fuse_projections(model)
    assert "cross-attention" in summary.skipped["encoder_attn.q_proj/k_proj/v_proj"]
    assert "cross-attention" in summary.skipped["crossattention.q_proj/k_proj/v_proj"]
    assert "hooks" in summary.skipped["self_attn.gate_proj/up_proj"]
    assert set(summary.fused) == {"self_attn.q_proj/k_proj/v_proj"}
    assert fuse_projections(model).skipped["self_attn.q_proj/k_proj/v_proj"] == "already fused"
    accelerate = pytest.importorskip("accelerate")
    other = _quantized()
    accelerate.hooks.add_hook_to_module(other.layers[1].k_proj, accelerate.hooks.ModelHook())
    assert "accelerate" in fuse_projections(other).skipped["layers.1.q_proj/k_proj/v_proj"]


def test_unfuse_gives_back_the_training_flags_and_trainable_biases() -> None:
    model = _quantized()
    model.layers[0].q_proj.bias.requires_grad_(True)
    model.layers[0].k_proj.bias.requires_grad_(False)
    model.eval()
    fuse_projections(model)
    assert not model.layers[0].fused_q_k_v.training and not model.layers[0].q_proj.training
    assert not model.layers[0].fused_q_k_v.bias.requires_grad  # frozen while fused
    unfuse_projections(model)
    layer = model.layers[0]
    assert not layer.q_proj.training and layer.q_proj.bias.requires_grad and not layer.k_proj.bias.requires_grad
    assert not layer._forward_pre_hooks and not layer._forward_hooks  # the parent's hooks are gone too


def test_strict_loading_reports_unexpected_keys_under_a_fused_part() -> None:
    model = _quantized()
    fuse_projections(model)
    sd = dict(model.state_dict())
    sd["layers.0.q_proj.lora_A"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match="lora_A"):
        model.load_state_dict(sd)
    model.load_state_dict(sd, strict=False)


def test_latent_attention_fuses_its_down_projections() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1)
    model, summary = _fused_from_config(transformers, config)
    assert {f"model.layers.{i}.self_attn.q_a_proj/kv_a_proj_with_mqa" for i in range(2)} <= set(summary.fusion.fused)
    assert isinstance(model.model.layers[1].self_attn.fused_q_a_kv_a_proj_with_mqa, FusedKbitLinear)


def test_threads_share_a_fused_model_and_copies_hold_no_product() -> None:
    import io
    import threading

    model = _quantized(seed=12)
    ref = copy.deepcopy(model)
    fuse_projections(model)
    inputs = [torch.randn(2, 256) for _ in range(4)]
    with torch.no_grad():
        want = [ref(x) for x in inputs]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(30):
            with torch.no_grad():
                if not torch.allclose(model(inputs[i]), want[i], rtol=1e-5, atol=1e-5):
                    errors.append(f"thread {i}: another thread's product")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # deepcopy and pickle: the copy's parts and hooks are its own
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        layer = other.layers[0]
        assert layer.q_proj.fused is layer.fused_q_k_v and not layer.fused_q_k_v.holds_product
        with torch.no_grad():
            torch.testing.assert_close(other(inputs[0]), want[0], rtol=1e-5, atol=1e-5)


def test_meta_models_and_far_apart_scales_are_left_apart_with_the_reason() -> None:
    with torch.device("meta"):
        meta = _Model(layers=1)
    summary = kbit_linear.quantize_model(meta, bits=4, fuse=True, progress=False)
    assert summary.fusion.skipped["layers.0.q_proj/k_proj/v_proj"] == "its tensors are on the meta device"
    torch.manual_seed(4)
    model = _Model(layers=1)
    with torch.no_grad():
        model.layers[0].v_proj.weight.mul_(1e-5)  # a tensor scale 2**17 below the others'
    summary = kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)
    assert "tensor scales" in summary.fusion.skipped["layers.0.q_proj/k_proj/v_proj"]
    assert "layers.0.gate_proj/up_proj" in summary.fusion.fused


def test_cross_attention_by_name_is_neither_fused_nor_quantized_together() -> None:
    from kbit_linear.fusion import is_cross_attention
    from kbit_linear.patch import sibling_groups

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cross_attention = _Attention(hidden=64, kv=64, inter=64)
            self.encoder_decoder_attention = _Attention(hidden=64, kv=64, inter=64)

    model = Block()
    assert is_cross_attention("cross_attention", model.cross_attention)
    assert is_cross_attention("x.encoder_decoder_attention", model.encoder_decoder_attention)
    assert not is_cross_attention("self_attn", model.cross_attention)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sibling_groups(names, {}, 4, model) == {}
    assert sibling_groups(names, {}, 4)  # without the model only the names count
    kbit_linear.quantize_model(model, bits=4, codebook=None, progress=False)
    assert not fuse_projections(model).fused


def test_a_width_that_differs_is_the_reason_given() -> None:
    model = _quantized()
    model.layers[0].v_proj = kbit_linear.KbitLinear.from_linear(nn.Linear(256, 192, bias=False), bits=5)
    assert fuse_projections(model).skipped["layers.0.q_proj/k_proj/v_proj"] == "v_proj has bits=5, q_proj 4"


def test_fusion_arguments_are_checked() -> None:
    model = _quantized(layers=1)
    # a dotted path is never a child's name: it used to fuse nothing, silently
    with pytest.raises(ValueError, match="child names"):
        fuse_projections(model, groups=[("layers.0.q_proj", "layers.0.k_proj")])
    with pytest.raises(ValueError, match="child names"):
        fuse_projections(model, groups=[("", "q_proj")])
    attn = model.layers[0]
    # built directly, parts that cannot share a GEMM are refused, not fused with the first part's levels
    other = kbit_linear.KbitLinear.from_linear(nn.Linear(256, 192), bits=4, codebook="fitted")
    with pytest.raises(ValueError, match="different codebooks"):
        FusedKbitLinear([attn.q_proj, other])
    with pytest.raises(ValueError, match="in_features"):
        FusedKbitLinear([attn.q_proj, attn.down_proj])
    with pytest.raises(ValueError, match="two or more"):
        FusedKbitLinear([])
    with pytest.raises(TypeError, match="parts"):
        FusedKbitLinear(attn.q_proj)
    fused = FusedKbitLinear([attn.q_proj, attn.k_proj])
    with pytest.raises(ValueError, match="index"):
        KbitLinearSlice(fused, 2)
    with pytest.raises(TypeError, match="model"):
        list(kbit_layers("model"))


class _QKV(nn.Module):
    """q/k/v siblings, k without a bias (Whisper-style) when ``bias_k`` is false."""

    def __init__(self, bias: bool, bias_k: bool = False, as_list: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 64, bias=bias)
        self.k_proj = nn.Linear(64, 64, bias=bias and bias_k)
        self.v_proj = nn.Linear(64, 64, bias=bias)
        self.as_list = as_list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_list:
            return self.q_proj(x.tolist())
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)


@pytest.mark.parametrize("bias, extra, strict", [
    (True, "k_proj.bias", False), (False, "k_proj.bias", False),
    (True, "q_proj.hadamard_signs", False), (True, "q_proj.hadamard_signs", True),
])
def test_a_part_never_takes_a_tensor_it_does_not_have(bias: bool, extra: str, strict: bool) -> None:
    """A state dict holding a bias for a part without one (or signs for an unrotated group) is
    unexpected for a fused part exactly as for a KbitLinear: ignored without strict, refused with
    it. A fused part used to write that bias into the fused GEMM's columns, or crash."""
    torch.manual_seed(0)
    fused = _QKV(bias)
    kbit_linear.quantize_model(fused, bits=4, fuse=True, progress=False)
    apart = copy.deepcopy(fused)
    kbit_linear.unfuse_projections(apart)
    sd = fused.state_dict()
    sd[extra] = torch.ones(64) if extra.endswith("bias") else torch.ones(64, dtype=torch.int8)
    x = torch.randn(2, 64)
    if strict:
        for m in (apart, fused):
            with pytest.raises(RuntimeError, match=f'Unexpected key.*"{extra}"'):
                m.load_state_dict(sd, strict=True)
    else:
        for m in (apart, fused):
            assert extra in m.load_state_dict(sd, strict=False).unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(fused(x), apart(x))


def test_a_part_names_a_non_tensor_input_inside_its_parents_call() -> None:
    model = _QKV(True, as_list=True)
    kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)
    with pytest.raises(TypeError, match="x must be a floating-point torch.Tensor"):
        model(torch.randn(2, 64))
