"""KbitExperts on CPU: routing, the reference forward against dense experts with the same
(dequantized) weights, quantize_model and the transformers plug-in on tiny random Mixtral,
Qwen3-MoE and OLMoE models, checkpoints (bit-identical round trips, corrupted files), bad inputs.

"Fake-quantized reference": a dense copy of the model whose every quantized weight is replaced by
its kbit dequantization; the kbit model must agree with it to float32 rounding.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kbit_linear import _grouped_ops
from kbit_linear import format as fmt
from kbit_linear.experts import (
    PROJECTIONS,
    KbitExperts,
    experts_layout_problem,
    looks_like_experts,
    quantize_experts_weight,
    route_tokens,
)
from kbit_linear.linear import KbitLinear
from kbit_linear.patch import convertible_experts, experts_placeholder, quantize_model
from kbit_linear.quantizer import quantize_weight
from kbit_linear.serialization import CheckpointError, load_into, parse_header, save_quantized

transformers = pytest.importorskip("transformers")

from kbit_linear.integrations.transformers import KbitConfig  # noqa: E402
from moe_configs import VOCAB, tiny_moe_config  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one thread is faster, and keeps the file quick on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

EXPERT_TENSORS = tuple(p + s for p in PROJECTIONS for s in ("", "_absmax", "_codebook", "_tensor_scale"))
FP32 = {"rtol": 1e-5, "atol": 1e-6}


FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


def _model(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)).eval()


def _experts_names(model: nn.Module) -> list[str]:
    return [f"model.layers.{i}.mlp.experts" for i in range(len(model.model.layers))]


def _ids(seed: int = 1, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _fake_quantized(dense: nn.Module, quantized: nn.Module) -> nn.Module:
    """``dense`` with every quantized weight of ``quantized`` replaced by its dequantization."""
    ref = copy.deepcopy(dense)
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, KbitLinear):
                ref.get_submodule(name).weight.copy_(m.dequantize())
            elif isinstance(m, KbitExperts):
                for proj, w in m.dequantize().items():
                    getattr(ref.get_submodule(name), proj).copy_(w)
    return ref


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _dense_experts(family: str = "qwen3_moe", seed: int = 0) -> nn.Module:
    return _model(family, seed).model.layers[0].mlp.experts


def _dense_twin(kbit: KbitExperts, like: nn.Module) -> nn.Module:
    """A copy of the dense experts module ``like`` holding ``kbit``'s dequantized weights."""
    twin = copy.deepcopy(like)
    with torch.no_grad():
        for proj, w in kbit.dequantize().items():
            getattr(twin, proj).copy_(w)
    return twin


# ---------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------


def _brute_force_routing(index: torch.Tensor, num_experts: int) -> tuple[list[int], list[int]]:
    slots = index.reshape(-1).tolist()
    perm = [s for e in range(num_experts + 1) for s, x in enumerate(slots) if x == e]  # stable by construction
    counts = [slots.count(e) for e in range(num_experts)]
    return counts, perm


@pytest.mark.parametrize(
    "index",
    [
        [[2, 0], [1, 2], [0, 2], [2, 1]],
        [[3, 3], [3, 3], [3, 3]],  # every slot to one expert, the others empty
        [[0, 4], [4, 1], [1, 0]],  # 4 = num_experts: no expert (transformers' convention)
        [[1]],  # one token, top-1
        [],  # no tokens
    ],
    ids=["mixed", "one-expert", "sentinel", "one-token", "empty"],
)
def test_route_tokens_matches_a_brute_force_grouping(index):
    t = torch.tensor(index, dtype=torch.int64).reshape(len(index), -1 if index else 2)
    r = route_tokens(t, 4)
    counts, perm = _brute_force_routing(t, 4)
    assert r.counts.dtype == r.offsets.dtype == torch.int32 and r.perm.dtype == torch.int64
    assert r.counts.tolist() == counts
    assert r.offsets.tolist() == [0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()]
    assert r.perm.tolist() == perm


def test_route_tokens_on_many_tokens_is_stable():
    index = torch.randint(0, 8, (4096, 2), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    r = route_tokens(index, 8)
    counts, perm = _brute_force_routing(index, 8)
    assert r.counts.tolist() == counts and r.perm.tolist() == perm


# ---------------------------------------------------------------------------------------
# the module on its own
# ---------------------------------------------------------------------------------------


def test_layout_of_the_stored_tensors():
    dense = _dense_experts()
    e, two_i, h = dense.gate_up_proj.shape
    k = KbitExperts.from_experts(dense, bits=3)
    assert (k.num_experts, k.hidden_dim, k.intermediate_dim, k.bits) == (e, h, two_i // 2, 3)
    for proj, (n, kk) in (("gate_up_proj", (two_i, h)), ("down_proj", (h, two_i // 2))):
        packed_shape, absmax_shape = fmt.tiled_shapes(n, kk, 3)
        assert getattr(k, proj).shape == (e, *packed_shape) and getattr(k, proj).dtype == torch.int32
        assert getattr(k, proj + "_absmax").shape == (e, *absmax_shape)
        assert getattr(k, proj + "_tensor_scale").shape == (e,)
        assert getattr(k, proj).is_contiguous()
        # expert i's slice is exactly what KbitLinear / quantize_weight store for that matrix
        for i in range(e):
            q = quantize_weight(getattr(dense, proj)[i].detach(), 3)
            assert torch.equal(getattr(k, proj)[i], q.packed)
            assert torch.equal(getattr(k, proj + "_absmax")[i], q.absmax)
            assert torch.equal(getattr(k, proj + "_tensor_scale")[i : i + 1], q.tensor_scale)
            assert torch.equal(getattr(k, proj + "_codebook"), q.codebook)
    assert isinstance(k.gate_up_proj, nn.Parameter) and not k.gate_up_proj.requires_grad
    assert {n for n, _ in k.named_buffers()} == set(EXPERT_TENSORS) - set(PROJECTIONS)
    assert k.act_fn is dense.act_fn
    assert "num_experts=6, hidden_dim=64, intermediate_dim=40, bits=3" in repr(k)


def _routing(tokens: int, top_k: int, num_experts: int, case: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(tokens, top_k, generator=g)
    if case == "random":
        index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    elif case == "one-expert":  # every slot of every token to expert 1; the others get none
        index = torch.full((tokens, top_k), 1)
    elif case == "empty-expert":  # expert 0 never chosen
        index = torch.stack([1 + torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    elif case == "ties":  # equal weights and the same expert twice for a token
        index = torch.randint(0, num_experts, (tokens, top_k), generator=g)
        index[:, 1] = index[:, 0]
        weights = torch.full((tokens, top_k), 1.0 / top_k)
    elif case == "sentinel":  # some slots to no expert (id num_experts)
        index = torch.randint(0, num_experts + 1, (tokens, top_k), generator=g)
    else:
        raise ValueError(case)
    return index, weights


@pytest.mark.parametrize("case", ["random", "one-expert", "empty-expert", "ties", "sentinel"])
@pytest.mark.parametrize("tokens", [1, 64], ids=["batch1", "batch64"])
def test_forward_matches_dense_experts_with_the_dequantized_weights(case, tokens):
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=4)
    twin = _dense_twin(k, dense)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    index, weights = _routing(tokens, 3, 6, case)
    got = k(x, index, weights)
    assert got.shape == x.shape and got.dtype == x.dtype
    if case != "sentinel":  # transformers' grouped_mm leaves no-expert slots unwritten outside expert parallelism
        torch.testing.assert_close(got, twin(x, index, weights), **FP32)
    # and the eager loop of transformers (in float32 it adds in the same dtype)
    twin.config._experts_implementation = "eager"
    if case == "sentinel":
        # a slot to no expert adds nothing: the same as expert 0 with weight 0 (any transformers version)
        routed = index < 6
        torch.testing.assert_close(got, twin(x, torch.where(routed, index, 0), weights * routed), **FP32)
        none = (~routed).all(dim=1)  # a token whose slots all go to no expert gets zeros
        assert bool((got[none] == 0).all())
        try:  # the loop's own handling of the no-expert id, where this transformers has it
            own = twin(x, index, weights)
        except RuntimeError as e:  # older loops one-hot the ids over num_experts classes only
            if "num_classes" not in str(e):
                raise
            return
        torch.testing.assert_close(got, own, **FP32)
        return
    torch.testing.assert_close(got, twin(x, index, weights), **FP32)


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_every_width_and_a_user_codebook(bits):
    dense = _dense_experts("mixtral")
    cb = fmt.create_normal_float_codebook(bits) * 0.9
    k = KbitExperts.from_experts(dense, bits=bits, codebook=cb)
    assert torch.equal(k.gate_up_proj_codebook, cb) and torch.equal(k.down_proj_codebook, cb)
    assert k.gate_up_proj_codebook.data_ptr() != cb.data_ptr()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(bits))
    index, weights = _routing(5, 2, 4, "random", seed=bits)
    torch.testing.assert_close(k(x, index, weights), _dense_twin(k, dense)(x, index, weights), **FP32)
    # the quantization error shrinks with the width
    rel = (k(x, index, weights) - dense(x, index, weights)).norm() / dense(x, index, weights).norm()
    assert rel < {2: 0.9, 3: 0.5, 4: 0.25, 5: 0.15}[bits], rel


def test_scale_search_is_applied_per_expert():
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=2, scale_search=True)
    for i in range(dense.gate_up_proj.shape[0]):
        q = quantize_weight(dense.down_proj[i].detach(), 2, scale_search=True)
        assert torch.equal(k.down_proj[i], q.packed) and torch.equal(k.down_proj_absmax[i], q.absmax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_activations(dtype):
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=4)
    twin = _dense_twin(k, dense)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    index, weights = _routing(16, 3, 6, "random")
    got = k(x, index, weights.to(dtype))
    assert got.dtype == dtype
    ref = twin(x.float(), index, weights)
    assert (got.float() - ref).norm() / ref.norm() < 1e-2


def test_gradients_reach_the_input_and_the_routing_weights():
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=4)
    twin = _dense_twin(k, dense).requires_grad_(False)
    index, w0 = _routing(8, 3, 6, "random")
    x0 = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    grads = []
    for module in (k, twin):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        module(x, index, w).square().sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)
    assert k.gate_up_proj.grad is None


def test_dtype_casts_and_state_dict_round_trip():
    k = KbitExperts.from_experts(_dense_experts(), bits=3)
    before = {n: t.clone() for n, t in k.state_dict().items()}
    k.to(torch.bfloat16)
    for n, t in k.state_dict().items():
        assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n
    # a meta placeholder filled by load_state_dict is the same module
    placeholder = experts_placeholder(_dense_experts(), 3, device="meta")
    placeholder.load_state_dict(before, assign=True)
    _assert_same_state(placeholder, k)
    x = torch.randn(4, 64)
    index, weights = _routing(4, 3, 6, "random")
    assert torch.equal(placeholder(x, index, weights), k(x, index, weights))
    # copies (and pickles) carry no stale per-expert views
    twin = copy.deepcopy(k)
    assert torch.equal(twin(x, index, weights), k(x, index, weights))


def test_load_state_dict_refuses_wrong_dtypes_and_shapes():
    k = KbitExperts.from_experts(_dense_experts(), bits=3)
    sd = k.state_dict()
    with pytest.raises(RuntimeError, match="gate_up_proj: expected dtype torch.int32"):
        k.load_state_dict({**sd, "gate_up_proj": sd["gate_up_proj"].float()})
    with pytest.raises(RuntimeError, match="down_proj_absmax"):
        k.load_state_dict({**sd, "down_proj_absmax": sd["down_proj_absmax"][:-1]})


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantize_model_gives_the_experts_class_back(family, tmp_path):
    from kbit_linear.patch import dequantize_model

    dense = _model(family)
    cls = type(dense.model.layers[0].mlp.experts)
    model = copy.deepcopy(dense)
    quantize_model(model, bits=4, progress=False)
    ids = _ids()
    want = _logits(_fake_quantized(dense, model), ids)
    kbit = {n: m.dequantize() for n, m in model.named_modules() if isinstance(m, KbitExperts)}
    assert kbit and dequantize_model(model) > len(kbit)
    for name, weights in kbit.items():
        experts = model.get_submodule(name)
        assert type(experts) is cls and experts.gate_up_proj.dtype == torch.float32
        assert all(torch.equal(getattr(experts, p), w) for p, w in weights.items())
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path)  # a dense model again: transformers saves and reloads it
    reloaded = type(model).from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_dequantize_model_after_a_dtype_cast_gives_experts_in_that_dtype(impl):
    from kbit_linear.patch import dequantize_model

    model = _model("mixtral")
    model.set_experts_implementation(impl)
    quantize_model(model, bits=4, progress=False)
    model.to(torch.bfloat16)  # the experts' dense dtype follows the cast, as KbitLinear's compute_dtype
    experts = model.model.layers[0].mlp.experts
    assert experts.to_dense().gate_up_proj.dtype == torch.bfloat16
    assert experts.gate_up_proj_codebook.dtype == torch.float32  # the format's buffers stay float32
    dequantize_model(model)
    for name in _experts_names(model):
        dense = model.get_submodule(name)
        assert {p.dtype for p in dense.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(_ids()).logits.dtype == torch.bfloat16  # eager experts: no dtype mismatch


def test_the_dense_outline_follows_half_and_float_round_trips():
    k = KbitExperts.from_experts(_dense_experts(), bits=4)
    k.half()
    assert k.to_dense().down_proj.dtype == torch.float16
    k.float()
    assert k.to_dense().down_proj.dtype == torch.float32
    k.to("cpu")  # a device move keeps the dtype
    assert k.to_dense().down_proj.dtype == torch.float32
    assert k.to_dense(torch.float64).down_proj.dtype == torch.float64  # an explicit dtype wins


@pytest.mark.parametrize("dtype", ["bfloat16", torch.int8, 16], ids=repr)
def test_to_dense_checks_its_dtype(dtype):
    k = KbitExperts.from_experts(_dense_experts(), bits=4)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        k.to_dense(dtype)


def _bad_input_cases() -> dict[str, callable]:
    from kbit_linear.fusion import is_cross_attention
    from kbit_linear.patch import convertible_layers, kbit_placeholder, module_bytes

    return {
        "experts_layout_problem": (lambda: experts_layout_problem(None), "module must be an nn.Module"),
        "looks_like_experts": (lambda: looks_like_experts(None), "module must be an nn.Module"),
        "set_projection": (lambda: KbitExperts(2, 64, 32).set_projection("down_proj", (1, 2)), "tensors must be a KbitTensors"),
        "convertible_layers": (lambda: convertible_layers(None), "model must be an nn.Module"),
        "convertible_experts": (lambda: convertible_experts(None), "model must be an nn.Module"),
        "module_bytes": (lambda: module_bytes(None), "model must be an nn.Module"),
        "kbit_placeholder": (lambda: kbit_placeholder(None, 4), "linear must be an nn.Linear"),
        "is_cross_attention": (lambda: is_cross_attention(None, None), "name must be a str"),
        "is_cross_attention-module": (lambda: is_cross_attention("attn", None), "module must be an nn.Module"),
    }


@pytest.mark.parametrize("case", list(_bad_input_cases()))
def test_bad_inputs_raise_a_named_type_error(case):
    call, match = _bad_input_cases()[case]
    with pytest.raises(TypeError, match=match):
        call()


def test_load_state_dict_refuses_another_shape_and_values_experts_cannot_hold():
    """An intermediate size that pads to the same tiles stores alike: the state dict's record of the
    module's shape refuses it. Levels out of order and tensor scales that are not powers of two are
    refused by name, as for a KbitLinear."""
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=4)
    narrow = KbitExperts(k.num_experts, k.hidden_dim, k.intermediate_dim - 8, bits=4)
    sd = k.state_dict()
    assert {n: tuple(v.shape) for n, v in sd.items()} == {n: tuple(v.shape) for n, v in narrow.state_dict().items()}
    with pytest.raises(RuntimeError, match=f"size mismatch for the module: the state dict is of a KbitExperts .*"
                                           f"intermediate_dim={k.intermediate_dim}, this one has .*intermediate_dim={k.intermediate_dim - 8}"):
        narrow.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="gate_up_proj_codebook"):
        k.load_state_dict({**sd, "gate_up_proj_codebook": sd["gate_up_proj_codebook"].flip(0)})
    with pytest.raises(RuntimeError, match="down_proj_tensor_scale must be a positive finite power of two"):
        k.load_state_dict({**sd, "down_proj_tensor_scale": sd["down_proj_tensor_scale"] * 3})
    twin = KbitExperts(k.num_experts, k.hidden_dim, k.intermediate_dim, bits=4)
    twin.load_state_dict(sd)
    assert all(torch.equal(twin.dequantize()[p], w) for p, w in k.dequantize().items())


# ---------------------------------------------------------------------------------------
# which modules qualify
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_supported_families_qualify(family):
    dense = _dense_experts(family)
    assert experts_layout_problem(dense) is None and looks_like_experts(dense)


def _qwen2_moe_experts() -> nn.Module:
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    return transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.experts


def test_qwen2_moe_qualifies():
    assert experts_layout_problem(_qwen2_moe_experts()) is None


class _ScaledExperts(nn.Module):
    """Same parameters as the transformers experts, another forward: must not be quantized."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = inner.gate_up_proj, inner.down_proj, inner.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return 2 * hidden_states


def _variant(flag: str, value) -> nn.Module:
    m = _dense_experts()
    setattr(m, flag, value)
    return m


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: _ScaledExperts(_dense_experts()), "not a transformers experts class"),
        (lambda: _variant("is_transposed", True), "is_transposed=True"),
        (lambda: _variant("has_bias", True), "has_bias=True"),
        (lambda: _variant("has_gate", False), "has_gate=False"),
        (lambda: _variant("is_concatenated", False), "is_concatenated=False"),
        (lambda: _variant("has_post_expert_norm", True), "has_post_expert_norm=True"),
        (lambda: _variant("_is_expert_parallel", True), "expert parallelism"),
        (lambda: KbitExperts(2, 64, 32), "already a KbitExperts"),
    ],
    ids=["other-forward", "transposed", "bias", "no-gate", "interleaved", "post-norm", "expert-parallel", "kbit"],
)
def test_unknown_layouts_are_refused_with_a_reason(make, reason):
    module = make()
    assert reason in experts_layout_problem(module)
    with pytest.raises(ValueError, match="cannot be quantized as kbit experts"):
        KbitExperts.from_experts(module)


def test_a_class_with_its_own_forward_or_gate_is_refused():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class OwnGate(Qwen3MoeExperts):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate).clamp(max=7) * up

    module = OwnGate(tiny_moe_config("qwen3_moe"))
    assert "own gate function" in experts_layout_problem(module)
    # the decorated forward of a class whose eager loop is different code
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class Different(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 2
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))
            self.down_proj = nn.Parameter(torch.zeros(2, 4, 4))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    assert "not transformers' standard experts loop" in experts_layout_problem(Different(tiny_moe_config("qwen3_moe")))


def test_quantize_model_skips_an_unknown_layout_with_a_reason():
    model = _model("mixtral")
    model.model.layers[1].mlp.experts = _ScaledExperts(model.model.layers[1].mlp.experts)
    summary = quantize_model(model, bits=4, progress=False)
    assert summary.experts == ["model.layers.0.mlp.experts"]
    assert "experts stay dense" in summary.skipped["model.layers.1.mlp.experts"]
    assert type(model.model.layers[1].mlp.experts) is _ScaledExperts


# ---------------------------------------------------------------------------------------
# quantize_model on whole models
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_the_fake_quantized_reference(family):
    model = _model(family)
    dense = copy.deepcopy(model)
    ids = _ids()
    summary = quantize_model(model, bits=4, progress=False)
    assert summary.experts == _experts_names(model)
    assert all(isinstance(model.get_submodule(n), KbitExperts) for n in summary.experts)
    # bytes: before = the dense 3-D weights, after = every stored tensor of the KbitExperts
    before = sum(getattr(dense.get_submodule(n), p).nbytes for n in summary.experts for p in PROJECTIONS)
    after = sum(t.nbytes for n in summary.experts for t in model.get_submodule(n).state_dict().values())
    assert (summary.experts_bytes_before, summary.experts_bytes_after) == (before, after)
    assert f"experts ({len(summary.experts)} modules): {before:,} -> {after:,} bytes" in str(summary)
    torch.testing.assert_close(_logits(model, ids), _logits(_fake_quantized(dense, model), ids), **FP32)
    # one token at a time (decode) as well
    one = _ids(seed=2, batch=1, length=1)
    torch.testing.assert_close(_logits(model, one), _logits(_fake_quantized(dense, model), one), **FP32)


def test_skip_rules_apply_to_experts():
    model = _model("qwen3_moe")
    summary = quantize_model(model, bits=3, skip=["lm_head", "layers.0.mlp.experts"], progress=False)
    assert summary.experts == ["model.layers.1.mlp.experts"]
    assert summary.skipped["model.layers.0.mlp.experts"] == "matches skip rule 'layers.0.mlp.experts'"
    assert experts_layout_problem(model.model.layers[0].mlp.experts) is None  # still dense
    names, skipped = convertible_experts(_model("qwen3_moe"), ["re:experts"])
    assert names == [] and set(skipped) == set(_experts_names(model))


def test_quantize_model_device_argument_and_meta_model():
    model = _model("olmoe")
    quantize_model(model, bits=4, progress=False, device="cpu")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("olmoe"))
    summary = quantize_model(meta, bits=4, progress=False)
    assert summary.experts == _experts_names(meta)
    assert meta.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"
    meta.load_state_dict(model.state_dict(), assign=True, strict=False)
    _assert_same_state(meta.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts)


# ---------------------------------------------------------------------------------------
# single-file checkpoints
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory) -> tuple[nn.Module, Path]:
    model = _model("mixtral")
    quantize_model(model, bits=3, progress=False)
    return model, save_quantized(model, tmp_path_factory.mktemp("experts") / "mixtral.safetensors")


def test_save_quantized_round_trip_is_bit_identical(mixtral_file):
    model, path = mixtral_file
    target = load_into(_model("mixtral", seed=7), path)  # a dense model of another seed
    _assert_same_state(target, model)
    assert all(isinstance(target.get_submodule(n), KbitExperts) for n in _experts_names(target))
    ids = _ids()
    assert torch.equal(_logits(target, ids), _logits(model, ids))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("mixtral")).eval()
    with pytest.warns(UserWarning, match="meta device"):  # rotary inv_freq is in no state dict
        load_into(meta, path)
    for n in _experts_names(meta):
        _assert_same_state(meta.get_submodule(n), model.get_submodule(n))


def _rewrite(src: Path, dst: Path, edit_tensors=None, edit_header=None) -> Path:
    """A copy of a safetensors file with tensors and/or header entries edited (the header's own
    digest is recomputed, the tensor checksums are not)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kbit_linear import serialization as ser

    with safe_open(str(src), "pt") as f:
        header = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_tensors:
        edit_tensors(tensors)
    if edit_header:
        edit_header(header)
    header[ser._KEY_HEADER_SHA256] = ser._header_digest(header)
    save_file(tensors, str(dst), metadata=header)
    return dst


EXP = "model.layers.0.mlp.experts"


def _bump_tensor(name: str, idx) -> callable:
    def edit(tensors):
        t = tensors[name].clone()
        t[idx] += 1
        tensors[name] = t

    return edit


def _experts_meta_edit(key: str, value):
    def edit(header):
        experts = json.loads(header["kbit_linear.experts"])
        experts[EXP][key] = value
        header["kbit_linear.experts"] = json.dumps(experts)

    return edit


@pytest.mark.parametrize(
    "edit_tensors, edit_header, match",
    [
        (_bump_tensor(f"{EXP}.gate_up_proj", (1, 0, 0, 0, 0, 0)), None, "fails its sha256 check"),
        (None, _experts_meta_edit("num_experts", 5), "expected torch.int32"),
        (None, _experts_meta_edit("bits", 7), "bits=7 is not supported"),
        (None, _experts_meta_edit("hidden_dim", "64"), "must be a positive int"),
        (None, _experts_meta_edit("projections", {}), "does not match this format"),
        (lambda t: t.pop(f"{EXP}.down_proj_absmax"), None, "missing"),
        (lambda t: t.update({f"{EXP}.gate_up_proj": t[f"{EXP}.gate_up_proj"][:3].clone()}), None, "expected torch.int32"),
    ],
    ids=["flipped-planes", "wrong-expert-count", "bad-bits", "non-int", "bad-projections", "missing-tensor", "wrong-shape"],
)
def test_corrupted_experts_checkpoints_fail_loudly(mixtral_file, tmp_path, edit_tensors, edit_header, match):
    _, path = mixtral_file
    bad = _rewrite(path, tmp_path / "bad.safetensors", edit_tensors, edit_header)
    # the checksums catch every edited tensor first; without them the structural checks still do
    with pytest.raises(CheckpointError, match=match):
        load_into(_model("mixtral"), bad, verify_checksums="sha256" in match)


@pytest.mark.parametrize(
    "name, idx, value, match",
    [
        ("gate_up_proj_tensor_scale", (2,), 3.0, "power of two"),
        ("down_proj_absmax", (1, -1, 0, 0, 1), 9, "absmax is not zero in the padding"),  # intermediate 80: block column 2 of 4 is padding
        ("gate_up_proj", (0, 0, 1, -1, 0, 0), 1, "weight planes are not zero in the padding"),  # rows 160..255 pad
        ("down_proj_codebook", (0,), 2.0, "invalid codebook"),
    ],
    ids=["tensor-scale", "absmax-padding", "plane-padding", "codebook"],
)
def test_value_checks_name_the_expert(mixtral_file, tmp_path, name, idx, value, match):
    """Edited tensors with matching checksums: the value checks catch them, per expert."""
    from kbit_linear.serialization import tensor_sha256

    _, path = mixtral_file
    key = f"{EXP}.{name}"
    edited = {}

    def edit_tensors(tensors):
        t = tensors[key].clone()
        t[idx] = value
        tensors[key] = edited[key] = t

    def edit_header(header):
        sums = json.loads(header["kbit_linear.sha256"])
        sums[key] = tensor_sha256(edited[key])
        header["kbit_linear.sha256"] = json.dumps(sums)

    bad = _rewrite(path, tmp_path / "bad.safetensors", edit_tensors, edit_header)
    with pytest.raises(CheckpointError, match=match) as err:
        load_into(_model("mixtral"), bad)
    expert = idx[0] if name not in ("down_proj_codebook",) else 0
    assert f"[expert {expert}]" in str(err.value) and EXP in str(err.value)


def test_load_into_a_model_with_other_experts_refuses(mixtral_file):
    _, path = mixtral_file
    cfg = tiny_moe_config("mixtral")
    cfg.num_local_experts = 3
    torch.manual_seed(0)
    with pytest.raises(CheckpointError, match="experts, hidden, intermediate"):
        load_into(transformers.AutoModelForCausalLM.from_config(cfg), path)
    other = _model("mixtral")
    quantize_model(other, bits=2, skip=["lm_head", "self_attn"], progress=False)
    with pytest.raises(CheckpointError, match="bits, experts, hidden, intermediate"):
        load_into(other, path)
    scaled = _model("mixtral")
    scaled.model.layers[0].mlp.experts = _ScaledExperts(scaled.model.layers[0].mlp.experts)
    with pytest.raises(CheckpointError, match="cannot be loaded into this model's _ScaledExperts"):
        load_into(scaled, path)


def test_save_quantized_state_dict_needs_experts_metadata(mixtral_file, tmp_path):
    from kbit_linear.serialization import experts_metadata, layer_metadata

    model, _ = mixtral_file
    layers = {n: layer_metadata(m) for n, m in model.named_modules() if isinstance(m, KbitLinear)}
    with pytest.raises(CheckpointError, match="experts="):
        save_quantized(model.state_dict(), tmp_path / "a.safetensors", layers=layers)
    experts = {n: experts_metadata(model.get_submodule(n)) for n in _experts_names(model)}
    path = save_quantized(model.state_dict(), tmp_path / "b.safetensors", layers=layers, experts=experts)
    target = _model("mixtral", seed=3)
    load_into(target, path)
    assert torch.equal(_logits(target, _ids()), _logits(model, _ids()))
    with pytest.raises(TypeError, match="experts="):
        save_quantized(model, tmp_path / "c.safetensors", experts=experts)


# ---------------------------------------------------------------------------------------
# the transformers plug-in
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        out[family] = tmp_path_factory.mktemp(f"dense_{family}")
        _model(family).save_pretrained(out[family])
    return out


def _load(path, **kwargs) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_quantizes_experts_saves_and_reloads_bit_identically(family, dense_dirs, tmp_path):
    q = _load(dense_dirs[family], quantization_config=KbitConfig(bits=4))
    ref = _load(dense_dirs[family])
    dense = copy.deepcopy(ref)
    quantize_model(ref, bits=4, progress=False)
    assert [n for n, m in q.named_modules() if isinstance(m, KbitExperts)] == _experts_names(q)
    _assert_same_state(q, ref)  # quantize at load == quantize_model
    assert not any(p.requires_grad for m in q.modules() if isinstance(m, KbitExperts) for p in m.parameters())
    ids = _ids()
    logits = _logits(q, ids)
    torch.testing.assert_close(logits, _logits(_fake_quantized(dense, q), ids), **FP32)

    q.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        parsed = parse_header(dict(f.metadata()), "model.safetensors")
    assert set(parsed.experts) == set(_experts_names(q))
    assert {f"{n}.{t}" for n in _experts_names(q) for t in EXPERT_TENSORS} <= keys & set(parsed.sha256)
    r = _load(tmp_path)
    _assert_same_state(r, q)
    assert torch.equal(_logits(r, ids), logits)
    out = r.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
    # reloaded (a pre-quantized checkpoint, placeholders filled): model.dequantize() gives the dense class back
    dense_class = type(dense.get_submodule(_experts_names(dense)[0]))
    r = r.dequantize()
    assert all(type(r.get_submodule(n)) is dense_class for n in _experts_names(dense))
    torch.testing.assert_close(_logits(r, ids), logits, **FP32)


def test_from_pretrained_skip_modules_keep_experts_dense_and_round_trip(dense_dirs, tmp_path):
    cfg = KbitConfig(bits=3, skip_modules=["re:layers\\.0\\.mlp\\.experts"])
    q = _load(dense_dirs["mixtral"], quantization_config=cfg)
    assert isinstance(q.model.layers[1].mlp.experts, KbitExperts)
    dense_experts = q.model.layers[0].mlp.experts
    assert experts_layout_problem(dense_experts) is None
    q.save_pretrained(tmp_path)
    r = _load(tmp_path)
    assert experts_layout_problem(r.model.layers[0].mlp.experts) is None
    _assert_same_state(r, q)
    # a reload whose skip list differs from the one saved is refused
    path2 = tmp_path.parent / "other"
    path2.mkdir()
    for f in tmp_path.iterdir():
        (path2 / f.name).write_bytes(f.read_bytes())
    config = json.loads((path2 / "config.json").read_text())
    config["quantization_config"]["skip_modules"] = None
    (path2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="experts 'model.layers.0.mlp.experts' should be quantized"):
        _load(path2)


def test_sharded_checkpoint_and_no_dense_expert_weight_left_alive(dense_dirs, tmp_path):
    import gc

    q = _load(dense_dirs["mixtral"], quantization_config=KbitConfig(bits=4))
    gc.collect()
    e = q.model.layers[0].mlp.experts
    shapes = {(e.num_experts, 2 * e.intermediate_dim, e.hidden_dim), (e.num_experts, e.hidden_dim, e.intermediate_dim)}
    alive = [o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter) and o.is_floating_point()
             and o.device.type != "meta" and tuple(o.shape) in shapes]
    assert alive == []
    q.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _assert_same_state(_load(tmp_path), q)


def test_tampered_saved_experts_fail_on_reload(dense_dirs, tmp_path):
    q = _load(dense_dirs["olmoe"], quantization_config=KbitConfig(bits=4))
    q.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    key = "model.layers.1.mlp.experts.down_proj"

    def flip(tensors):
        t = tensors[key].clone()
        t[2, 0, 0, 5, 0, 1] ^= 1
        tensors[key] = t

    _rewrite(file, file, edit_tensors=flip)
    with pytest.raises(CheckpointError, match="fails its sha256 check"):
        _load(tmp_path)

    def drop_experts_header(header):
        del header["kbit_linear.experts"]

    _rewrite(file, file, edit_header=drop_experts_header)
    with pytest.raises(CheckpointError, match="does not list them"):
        _load(tmp_path)


def test_a_loader_without_the_plug_in_refuses_the_experts(dense_dirs, tmp_path):
    """transformers without kbit_linear must not load the packed planes as dense experts."""
    q = _load(dense_dirs["qwen3_moe"], quantization_config=KbitConfig(bits=4))
    q.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # every packed tensor is a size mismatch
        _load(tmp_path)


# ---------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------


def _bad_call(case: str):
    k = KbitExperts(4, 64, 32, bits=2)
    x, index, weights = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    args = {"x": x, "index": index, "weights": weights}
    changes = {
        "x-not-tensor": ("x", x.tolist()),
        "x-int": ("x", x.long()),
        "x-3d": ("x", x[None]),
        "x-width": ("x", x[:, :32]),
        "index-float": ("index", index.float()),
        "index-bool": ("index", index.bool()),
        "index-1d": ("index", index[:, 0]),
        "index-rows": ("index", index[:2]),
        "index-negative": ("index", index - 1),
        "index-too-large": ("index", index + 5),
        "weights-int": ("weights", weights.long()),
        "weights-shape": ("weights", weights[:, :1]),
        "x-meta": ("x", x.to("meta")),
    }
    name, value = changes[case]
    args[name] = value
    return lambda: k(args["x"], args["index"], args["weights"])


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("x-not-tensor", TypeError, "hidden_states must be a torch.Tensor"),
        ("x-int", TypeError, "hidden_states must be floating point"),
        ("x-3d", ValueError, "hidden_states must have shape"),
        ("x-width", ValueError, "hidden_states must have shape"),
        ("index-float", TypeError, "top_k_index must be an integer"),
        ("index-bool", TypeError, "top_k_index must be an integer"),
        ("index-1d", ValueError, "top_k_index must have shape"),
        ("index-rows", ValueError, "top_k_index must have shape"),
        ("index-negative", ValueError, "top_k_index holds expert ids -1..-1"),
        ("index-too-large", ValueError, "valid ids are 0..3"),
        ("weights-int", TypeError, "top_k_weights must be floating point"),
        ("weights-shape", ValueError, "top_k_weights must have the shape"),
        ("x-meta", ValueError, "hidden_states is on meta"),
    ],
)
def test_forward_rejects_bad_inputs_naming_the_argument(case, error, match):
    with pytest.raises(error, match=match):
        _bad_call(case)()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_experts=0), ValueError, "num_experts"),
        (dict(hidden_dim=1.5), TypeError, "hidden_dim"),
        (dict(intermediate_dim=True), TypeError, "intermediate_dim"),
        (dict(bits=6), ValueError, "bits"),
        (dict(act_fn="silu"), TypeError, "act_fn"),
        (dict(codebook=torch.zeros(3)), ValueError, "codebook"),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, dict) else str(v),
)
def test_constructor_rejects_bad_arguments(kwargs, error, match):
    args = dict(num_experts=2, hidden_dim=64, intermediate_dim=32, bits=3, **{})
    args.update(kwargs)
    with pytest.raises(error, match=match):
        KbitExperts(**args)


def test_other_bad_arguments():
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        KbitExperts.from_experts("experts")
    dense = _dense_experts()
    with torch.no_grad():
        dense.down_proj[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"down_proj\[expert 3\] contains NaN"):
        KbitExperts.from_experts(dense, bits=4)
    with pytest.raises(ValueError, match="cannot quantize experts 'model.layers.0.mlp.experts'"):
        model = _model("qwen3_moe")
        with torch.no_grad():
            model.model.layers[0].mlp.experts.gate_up_proj[0, 0, 0] = float("inf")
        quantize_model(model, progress=False)
    with pytest.raises(ValueError, match="3-D"):
        quantize_experts_weight(torch.randn(4, 4), 4)
    k = KbitExperts(2, 64, 32)
    q = quantize_experts_weight(torch.randn(2, 64, 200), 4)  # another in_features
    with pytest.raises(ValueError, match="gate_up_proj must have shape"):
        k.set_projection("gate_up_proj", q)
    with pytest.raises(ValueError, match="proj must be one of"):
        k.projection_shape("up_proj")
    good = quantize_experts_weight(torch.randn(2, 64, 32), 4)
    with pytest.raises(ValueError, match="gate_up_proj_codebook"):  # NaN in the codebook
        k.set_projection("gate_up_proj", good._replace(codebook=torch.full((16,), float("nan"))))
    with pytest.raises(ValueError, match="one device"):
        k.set_projection("gate_up_proj", good._replace(codebook=good.codebook.to("meta")))
    x, index, weights = torch.randn(3, 32), torch.tensor([[0, 1], [1, 2], [2, 0]]), torch.rand(3, 2)
    k2 = KbitExperts(3, 32, 16)
    with pytest.raises(TypeError, match="hidden_states must be"):
        k2(x.to(torch.float8_e4m3fn), index, weights)
    for dtype in (torch.uint8, torch.int16, torch.uint16, torch.uint32):  # unsigned ids: range-checked, then run
        torch.testing.assert_close(k2(x, index.to(dtype), weights), k2(x, index, weights))
    with pytest.raises(ValueError, match="top_k_index holds expert ids"):
        k2(x, torch.tensor([[0, 1], [1, 2], [2, 9]], dtype=torch.uint16), weights)
    with pytest.raises(TypeError, match="dtype"):
        k.dequantize(torch.int32)


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["random", "one-expert", "empty-expert", "ties", "sentinel"])
@pytest.mark.parametrize("tokens", [1, 3, 5, 16])
def test_grouped_forward_matches_the_reference_forward(case, tokens):
    """The grouped path's routing on the device (groups of hit experts, slots gathered and summed
    back) through the grouped op's reference equals the per-expert reference, on the CPU, for
    any routing (max_rows = every slot)."""
    top_k = 3
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=3)
    index, weights = _routing(tokens, top_k, k.num_experts, case, seed=tokens)
    x = torch.randn(tokens, k.hidden_dim, generator=torch.Generator().manual_seed(1))
    want = k(x, index, weights)
    got = k._grouped_forward(x, index, weights, max_rows=tokens * top_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _route_cases(device: str = "cpu"):
    """(top_k_index, num_experts, groups) routings: random, one expert, sentinels and ids out of
    range, repeated experts per token, no slots for most experts, the most experts, prefill-sized."""
    g = torch.Generator().manual_seed(7)
    yield torch.randint(0, 8, (5, 2), generator=g), 8, 8
    yield torch.full((6, 3), 2), 4, 4
    yield torch.randint(-1, 10, (7, 3), generator=g), 8, 8  # -1 and 8, 9: no expert
    yield torch.randint(0, 128, (1, 8), generator=g), 128, 8
    yield torch.randint(0, 128, (16, 8), generator=g), 128, 128
    yield torch.randint(0, 1024, (256, 8), generator=g), 1024, 1024  # the kernel's limits
    yield torch.randint(0, 4, (300, 1), generator=g), 4, 4
    yield torch.randint(0, 128, (2048, 8), generator=g), 128, 128  # a prefill: 16384 slots
    yield torch.randint(-2, 12, (1500, 2), generator=g), 10, 10  # many slots with no expert


def test_route_experts_reference_orders_slots_and_lists_hit_experts():
    for index, e, groups in _route_cases():
        table, perm, tokens, position = torch.ops.kbit_linear.route_experts(index, e, groups)
        assert torch.equal(perm[position], torch.arange(perm.numel()))
        ids = index.reshape(-1).clone()
        ids[(ids < 0) | (ids >= e)] = e
        want_perm = sorted(range(ids.numel()), key=lambda s: (int(ids[s]), s))
        assert perm.tolist() == want_perm
        assert tokens.tolist() == [s // index.shape[1] for s in want_perm]
        hit = sorted(set(ids.tolist()) - {e})
        assert table[0, : len(hit)].tolist() == hit
        assert table[2, : len(hit)].tolist() == [int((ids == x).sum()) for x in hit]
        assert table[1, : len(hit)].tolist() == [int((ids < x).sum()) for x in hit]
        assert not table[:, len(hit):].any()
    with pytest.raises(ValueError, match="groups"):
        torch.ops.kbit_linear.route_experts(torch.zeros(4, 2, dtype=torch.long), 8, 4)
    with pytest.raises(TypeError, match="top_k_index"):
        torch.ops.kbit_linear.route_experts(torch.zeros(4, 2), 8, 8)


@pytest.mark.cuda
def test_cuda_route_experts_matches_the_reference():
    _needs_cuda_kernels()
    for index, e, groups in _route_cases():
        want = torch.ops.kbit_linear.route_experts(index, e, groups)
        got = torch.ops.kbit_linear.route_experts(index.cuda(), e, groups)
        for w, x in zip(want, got):
            assert x.is_cuda and torch.equal(x.cpu(), w)


def _combine_case(tokens: int, top_k: int, hidden: int, dtype: torch.dtype, wdtype: torch.dtype, device: str = "cpu",
                  seed: int = 0):
    """(y, position, top_k_weights) of a random routing: position a random permutation of the slots."""
    g = torch.Generator().manual_seed(seed)
    slots = tokens * top_k
    y = torch.randn(slots, hidden, generator=g).to(dtype)
    position = torch.randperm(slots, generator=g)
    weights = torch.rand(tokens, top_k, generator=g).to(wdtype)
    return y.to(device), position.to(device), weights.to(device)


def _combine_by_loop(y, position, weights):
    """out[t] = sum_k round(w[t, k]) * y[position[t * top_k + k]]: each step one fused
    multiply-add in float32 (emulated exactly in float64), k ascending, rounded once: the CUDA
    kernel's arithmetic."""
    tokens, top_k = weights.shape
    w = weights.to(y.dtype).double()
    acc = torch.zeros(tokens, y.shape[1], dtype=torch.float32)
    for k in range(top_k):
        rows = y[position[k::top_k]].double()
        acc = (w[:, k : k + 1] * rows + acc.double()).float()
    return acc.to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combine_experts_reference_is_the_weighted_sum_over_each_tokens_slots(dtype):
    y, position, weights = _combine_case(5, 3, 24, dtype, torch.float32)
    got = torch.ops.kbit_linear.combine_experts(y, position, weights)
    assert got.dtype == dtype and got.shape == (5, 24)
    step = 2**-7 if dtype == torch.bfloat16 else 1e-6  # one rounding step of the output
    torch.testing.assert_close(got, _combine_by_loop(y, position, weights), rtol=step, atol=1e-6)


def test_combine_experts_reference_refuses_positions_outside_the_rows():
    """A position outside ``y``'s rows is an indexing error in the reference, negative ones too
    (indexing would wrap them round to the last rows)."""
    y, weights = torch.randn(4, 8), torch.ones(2, 2)
    for bad in (4, -1):
        with pytest.raises(IndexError):
            torch.ops.kbit_linear.combine_experts(y, torch.tensor([0, 1, 2, bad]), weights)


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.cuda),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)])
def test_combine_experts_gradients_reach_the_rows_and_the_routing_weights(device, dtype):
    """Router training through frozen experts: the routing weights (and the rows) get the
    gradients of the batched-matmul formula (bf16 on a GPU: the kernel's forward)."""
    if device == "cuda":
        _needs_cuda_kernels()
    y, position, weights = _combine_case(6, 4, 16, dtype, torch.float32, device=device, seed=5)
    y.requires_grad_(True)
    weights.requires_grad_(True)
    out = torch.ops.kbit_linear.combine_experts(y, position, weights)
    g = torch.randn_like(out)
    gy, gw = torch.autograd.grad(out, (y, weights), g)
    y2, w2 = y.detach().clone().requires_grad_(True), weights.detach().clone().requires_grad_(True)
    ref = torch.bmm(w2.reshape(6, 1, 4).double(), y2[position].view(6, 4, 16).double()).view(6, 16)
    ry, rw = torch.autograd.grad(ref, (y2, w2), g.double())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gy, ry, **tol)
    torch.testing.assert_close(gw, rw, **tol)
    # only the weights asking for a gradient (the rows come from frozen experts)
    w3 = weights.detach().clone().requires_grad_(True)
    (gw3,) = torch.autograd.grad(torch.ops.kbit_linear.combine_experts(y.detach(), position, w3), (w3,), g)
    torch.testing.assert_close(gw3, rw, **tol)


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda y, p, w: (y.long(), p, w), ValueError, "y must be a floating-point"),
        (lambda y, p, w: (y, p.int(), w), ValueError, "position must be int64"),
        (lambda y, p, w: (y, p[:-1], w), ValueError, "position must be int64"),
        (lambda y, p, w: (y[:-1], p, w), ValueError, "y has 14 rows"),
        (lambda y, p, w: (y, p, w.reshape(-1)), ValueError, "top_k_weights must be a floating-point"),
        (lambda y, p, w: (y, p, w.long()), ValueError, "top_k_weights must be a floating-point"),
    ],
)
def test_combine_experts_rejects_bad_arguments_naming_them(edit, error, match):
    args = edit(*_combine_case(5, 3, 8, torch.float32, torch.float32))
    with pytest.raises(error, match=match):
        torch.ops.kbit_linear.combine_experts(*args)


def _needs_cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


def _poison_cache(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN in the caching allocator's free blocks (call it right before the op, after every
    input is on the GPU), so an output element the kernel does not write shows up as NaN."""
    torch.full((numel + 4096,), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 8, 2048), (3, 2, 4096), (5, 1, 64), (37, 8, 100), (300, 2, 13),
                                                   (1, 3, 8), (4, 0, 16), (0, 2, 16)])
def test_cuda_combine_experts_matches_the_reference(dtype, wdtype, tokens, top_k, hidden):
    """Every output element (poisoned memory first) bit for bit against the kernel's arithmetic
    on the CPU (weights rounded to the activations' dtype, float32 fused multiply-adds, one
    rounding), and within a rounding step of the batched-matmul reference: 16-byte accesses
    (hidden % 8 == 0) and element ones (hidden 100, 13), weights of every dtype, no slots."""
    _needs_cuda_kernels()
    y, position, weights = _combine_case(tokens, top_k, hidden, dtype, wdtype, seed=tokens * 7 + top_k)
    want = _combine_by_loop(y, position, weights)
    yc, pc, wc = y.cuda(), position.cuda(), weights.cuda()
    _poison_cache(tokens * hidden, dtype)
    got = torch.ops.kbit_linear.combine_experts(yc, pc, wc)
    assert got.is_cuda and got.dtype == dtype and got.shape == (tokens, hidden) and not got.isnan().any()
    assert torch.equal(got.cpu(), want)
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.cpu(), _grouped_ops.combine_experts_reference(y, position, weights), rtol=step, atol=1e-3)


@pytest.mark.cuda
def test_cuda_combine_experts_on_misaligned_views_bad_positions_and_fp32():
    """Views that start off a 16-byte boundary take the element-wise kernel; a position outside
    the slots adds nothing (no read outside y); float32 activations take the reference."""
    _needs_cuda_kernels()
    y, position, weights = _combine_case(4, 2, 64, torch.bfloat16, torch.float32, device="cuda", seed=3)
    y_off = torch.empty(y.numel() + 1, dtype=y.dtype, device="cuda")[1:].view_as(y)
    y_off.copy_(y)
    torch.testing.assert_close(torch.ops.kbit_linear.combine_experts(y_off, position, weights),
                               torch.ops.kbit_linear.combine_experts(y, position, weights), rtol=0, atol=0)
    bad = position.clone()
    bad[1] = 10**9
    bad[2] = -5
    got = torch.ops.kbit_linear.combine_experts(y, bad, weights)
    w = weights.clone()
    w.view(-1)[1] = 0
    w.view(-1)[2] = 0
    torch.testing.assert_close(got, torch.ops.kbit_linear.combine_experts(y, position, w), rtol=0, atol=0)
    y32 = y.float()
    torch.testing.assert_close(torch.ops.kbit_linear.combine_experts(y32, position, weights),
                               _grouped_ops.combine_experts_reference(y32, position, weights), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, inter, offset", [(1, 768, 0), (8, 14336, 0), (33, 100, 0), (5, 13, 0), (0, 64, 0),
                                                 (7, 64, 1)])
def test_cuda_swiglu_is_silu_gate_times_up_rounded_once(dtype, rows, inter, offset):
    """Against silu(gate) * up in float32 rounded once: every element within one rounding step
    (the GPU's exp against the CPU's) and nearly all equal (rounding twice, silu then the
    product, would differ in about a quarter); offset 1 starts the input off a 16-byte boundary."""
    _needs_cuda_kernels()
    from kbit_linear.backends.cuda import experts as cuda_experts

    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).to(dtype)
    src = torch.empty(gate_up.numel() + offset, dtype=dtype, device="cuda")[offset:].view_as(gate_up)
    src.copy_(gate_up)
    _poison_cache(rows * inter, dtype)
    got = cuda_experts.swiglu_cuda(src)
    assert got.shape == (rows, inter) and got.dtype == dtype and not got.isnan().any()
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.cpu(), want, rtol=step, atol=1e-3)
    if rows * inter >= 1000:
        assert (got.cpu() == want).float().mean() > 0.97
    with pytest.raises(ValueError, match="gate_up"):
        cuda_experts.swiglu_cuda(gate_up.float().cuda())


def test_grouped_swiglu_reference_is_silu_gate_times_up():
    k = KbitExperts.from_experts(_dense_experts(), bits=4)
    x = torch.randn(7, k.hidden_dim, generator=torch.Generator().manual_seed(4))
    groups = torch.tensor([[1, 4], [0, 3], [3, 4]], dtype=torch.int32)
    args = (x, *k.projection_tensors("gate_up_proj"), groups, 4)
    gate, up = torch.ops.kbit_linear.grouped_gemm(*args, 2 * k.intermediate_dim, 4).chunk(2, dim=-1)
    got = torch.ops.kbit_linear.grouped_swiglu(*args, k.intermediate_dim, 4)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="intermediate"):
        torch.ops.kbit_linear.grouped_swiglu(*args, 0, 4)
    with pytest.raises(ValueError, match="out_features"):
        torch.ops.kbit_linear.grouped_swiglu(*args, k.intermediate_dim + 100, 4)


def test_expert_products_refuse_gradients_and_tangents_by_name():
    """The grouped expert ops have no autograd: asked for a gradient or a tangent they raise,
    naming the op (a zero tangent under torch.func.jvp went unnoticed before); without either
    they run, under a forward-mode level too."""
    k = KbitExperts.from_experts(_dense_experts(), bits=4)
    x = torch.randn(7, k.hidden_dim, generator=torch.Generator().manual_seed(4))
    groups = torch.tensor([[1, 4], [0, 3], [3, 4]], dtype=torch.int32)
    gate_up, down = k.projection_tensors("gate_up_proj"), k.projection_tensors("down_proj")
    index = torch.tensor([[1, 4]])
    weights = torch.tensor([[0.75, 0.25]])
    calls = {
        "grouped_gemm": lambda x: torch.ops.kbit_linear.grouped_gemm(x, *gate_up, groups, 4, 2 * k.intermediate_dim, 4),
        "grouped_swiglu": lambda x: torch.ops.kbit_linear.grouped_swiglu(x, *gate_up, groups, 4, k.intermediate_dim, 4),
        "experts_one_token": lambda x: torch.ops.kbit_linear.experts_one_token(x[:1], index, weights, *gate_up, *down, 4,
                                                                               k.intermediate_dim),
    }
    for name, call in calls.items():
        want = call(x)
        with pytest.raises(NotImplementedError, match=f"gradients through kbit_linear::{name}"):
            call(x.clone().requires_grad_(True))
        with pytest.raises(NotImplementedError, match=f"forward-mode AD through kbit_linear::{name}"):
            torch.func.jvp(call, (x,), (torch.ones_like(x),))
        with torch.autograd.forward_ad.dual_level():
            torch.testing.assert_close(call(x), want, rtol=0, atol=0)
            with torch.no_grad():  # requires_grad without grad mode asks for nothing
                torch.testing.assert_close(call(x.clone().requires_grad_(True)), want, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(call(x.clone().requires_grad_(True)), want, rtol=0, atol=0)
        with pytest.raises(Exception, match=f"gradients through kbit_linear::{name}"):  # (compile wraps the error)
            torch.compile(call, backend="aot_eager", fullgraph=True)(x.clone().requires_grad_(True))
        torch.testing.assert_close(torch.compile(call, backend="aot_eager", fullgraph=True)(x), want, rtol=0, atol=0)
    # the module itself stays differentiable in both modes (it runs its reference then)
    out, tangent = torch.func.jvp(lambda x: k(x, torch.tensor([[1, 4]] * 7), torch.full((7, 2), 0.5)), (x,),
                                  (torch.ones_like(x),))
    assert tangent.abs().sum() > 0


def test_grouped_op_reference_checks_its_groups():
    k = KbitExperts.from_experts(_dense_experts(), bits=4)
    args = (torch.randn(4, k.hidden_dim), *k.projection_tensors("gate_up_proj"))
    n = 2 * k.intermediate_dim
    bad = torch.tensor([[0], [2], [3]], dtype=torch.int32)  # rows 2..4 of a 4-row x
    with pytest.raises(ValueError, match="group 0"):
        torch.ops.kbit_linear.grouped_gemm(*args, bad, 4, n, 4)
    with pytest.raises(ValueError, match="max_rows"):
        torch.ops.kbit_linear.grouped_gemm(*args, bad, 4, n, 0)
    with pytest.raises(ValueError, match="groups must be int32"):
        torch.ops.kbit_linear.grouped_gemm(*args, bad.long(), 4, n, 4)
    with pytest.raises(ValueError, match="out_features"):
        torch.ops.kbit_linear.grouped_gemm(*args, bad, 4, n + 200, 4)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 4, 16, 40, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_grouped_forward_and_graph(dtype, tokens):
    """On a GPU: the grouped launches (tokens 1, 4, 16: the decode kernel; 40 and 300: the
    tensor-core grouped kernel on compute capability 9.0, the reference loop elsewhere) against
    the CPU reference; at one token (and at 40 where the grouped kernel takes it) the forward
    captured in a CUDA graph and replayed on new routing."""
    _needs_cuda_kernels()
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=4)
    gpu = copy.deepcopy(k).cuda()
    top_k = 3
    large = _grouped_ops.large_groups_supported(torch.device("cuda"))
    for case in ("random", "empty-expert", "sentinel") + (("ties",) if tokens * top_k <= 16 or large else ()):
        index, weights = _routing(tokens, top_k, k.num_experts, case, seed=tokens)
        x = torch.randn(tokens, k.hidden_dim, generator=torch.Generator().manual_seed(2))
        ref = k(x.to(dtype).float(), index, weights)
        got = gpu(x.to("cuda", dtype), index.cuda(), weights.cuda())
        assert got.dtype == dtype
        assert float((got.float().cpu() - ref).norm() / ref.norm()) < 2e-2, case
    if tokens != 1 and not (tokens == 40 and large):
        return
    x = torch.randn(tokens, k.hidden_dim, device="cuda", dtype=dtype)
    index, weights = (t.cuda() for t in _routing(tokens, top_k, k.num_experts, "random"))
    gpu(x, index, weights)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(x, index, weights)
    for seed in range(3):
        new_index, new_weights = _routing(tokens, top_k, k.num_experts, "random", seed=seed + 10)
        index.copy_(new_index)
        weights.copy_(new_weights)
        x.copy_(torch.randn(tokens, k.hidden_dim, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = k(x.float().cpu(), new_index, new_weights)
        assert float((out.float().cpu() - ref).norm() / ref.norm()) < 2e-2
    compiled = torch.compile(gpu, fullgraph=True)  # no graph break: routing and GEMMs are ops with fake kernels
    got = compiled(x, index, weights)
    ref = k(x.float().cpu(), index.cpu(), weights.cpu())
    assert float((got.float().cpu() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_forward_matches_the_cpu_reference(dtype):
    _needs_cuda_kernels()
    dense = _dense_experts()
    k = KbitExperts.from_experts(dense, bits=4)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    index, weights = _routing(40, 3, 6, "empty-expert")
    ref = k(x, index, weights)
    gpu = copy.deepcopy(k).cuda()
    got = gpu(x.to("cuda", dtype), index.cuda(), weights.cuda())
    assert got.dtype == dtype
    assert float((got.float().cpu() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 2, 40])
def test_cuda_router_gradients_through_frozen_grouped_experts(tokens):
    """Activations without a gradient and routing weights with one (router training in front of
    frozen experts): the grouped GPU path runs (for one token too, where the one-token op, which
    has no gradient, steps aside) and the routing weights' gradient matches the CPU reference
    module's."""
    _needs_cuda_kernels()
    k = KbitExperts.from_experts(_dense_experts(), bits=4)
    gpu = copy.deepcopy(k).cuda()
    index, w0 = _routing(tokens, 3, k.num_experts, "random", seed=tokens)
    x = torch.randn(tokens, k.hidden_dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grads = []
    for module, dev in ((k, "cpu"), (gpu, "cuda")):
        w = w0.clone().to(dev).requires_grad_(True)
        xin = x.float() if dev == "cpu" else x.cuda()
        out = module(xin, index.to(dev), w)
        out.float().square().sum().backward()
        grads.append(w.grad.float().cpu())
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 3e-2


# ---------------------------------------------------------------------------------------
# target_bpw with experts modules
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codebook", [None, "fitted"])
def test_experts_relative_errors_match_the_quantized_module(codebook):
    """The allocation's error of a stacked projection is the error KbitExperts actually has at
    each width (same levels, same per-expert quantization)."""
    from kbit_linear import allocation

    dense = _dense_experts()
    errors = allocation.experts_relative_errors(dense.down_proj, codebook=codebook, bit_choices=(2, 4))
    w = dense.down_proj.detach().float()
    for bits in (2, 4):
        k = KbitExperts.from_experts(dense, bits=bits, codebook=codebook)
        got = float((k.dequantize()["down_proj"] - w).square().sum() / w.square().sum())
        assert errors[bits] == pytest.approx(got, rel=1e-5)
    assert errors[2] > errors[4] > 0
    with pytest.raises(ValueError, match="3-D"):
        allocation.experts_relative_errors(w[0])


def test_quantize_model_target_bpw_gives_experts_modules_a_width():
    model = _model("qwen3_moe")
    ids = _ids()
    summary = quantize_model(model, target_bpw=3.5, progress=False)
    experts = _experts_names(model)
    assert set(experts) <= set(summary.layer_bits) and summary.experts == experts
    sizes = {}
    for name, width in summary.layer_bits.items():
        module = model.get_submodule(name)
        assert module.bits == width, name
        if isinstance(module, KbitExperts):
            sizes[name] = module.num_experts * 3 * module.hidden_dim * module.intermediate_dim
        else:
            sizes[name] = module.in_features * module.out_features
    mean = sum(summary.layer_bits[n] * sizes[n] for n in sizes) / sum(sizes.values())
    assert mean <= 3.5 + 1e-9 and summary.mean_layer_bits == pytest.approx(mean)
    assert torch.isfinite(_logits(model, ids)).all()
    # the mixed widths survive a save and reload
    import kbit_linear

    path = kbit_linear.save_quantized(model, Path(pytest.importorskip("tempfile").mkdtemp()) / "moe.safetensors")
    fresh = _model("qwen3_moe", seed=5)
    kbit_linear.load_into(fresh, path)
    assert [fresh.get_submodule(n).bits for n in experts] == [model.get_submodule(n).bits for n in experts]
    assert torch.equal(_logits(fresh, ids), _logits(model, ids))
    meta = _model("qwen3_moe")
    meta.model.layers[0].mlp.experts.to("meta")
    with pytest.raises(ValueError, match="meta"):
        quantize_model(meta, target_bpw=3.5, progress=False)


@pytest.mark.parametrize("call, error, match", [
    (lambda: route_tokens([[0, 1]], 4), TypeError, "top_k_index"),
    (lambda: route_tokens(torch.zeros(3, 2), 4), TypeError, "top_k_index"),
    (lambda: route_tokens(torch.zeros(3, 2, dtype=torch.long), 0), ValueError, "num_experts"),
    (lambda: KbitExperts(2, 64, 64, 4, device="nope"), ValueError, "device"),
    (lambda: KbitExperts(2, 64, 64, 4, device=3.5), TypeError, "device"),
])
def test_routing_and_device_arguments_are_named(call, error, match) -> None:
    """A bad routing tensor or device names the argument (not an AttributeError or torch's own error)."""
    with pytest.raises(error, match=match):
        call()


def test_module_type_cast_of_experts_is_refused() -> None:
    """As for KbitLinear: ``Module.type(dtype)`` would cast the packed integer planes."""
    experts = KbitExperts(2, 64, 64, 4)
    packed = experts.gate_up_proj.clone()
    with pytest.raises(TypeError, match="cannot cast its packed integer tensors"):
        experts.type(torch.bfloat16)
    assert experts.gate_up_proj.dtype == torch.int32 and torch.equal(experts.gate_up_proj, packed)
