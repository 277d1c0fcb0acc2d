"""The one-kernel MoE router: ``kbit_linear::router_top_k`` (reference, checks) and :func:`kbit_linear.fuse_routers`.

The reference is checked against transformers' own routers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
whose outputs differ in renormalisation and the scores' dtype), ties against a brute-force pick,
and the fused models against the unfused ones: same router outputs, same logits, state dicts,
``isinstance`` (transformers records router logits by class), pickling and unfusing.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

import kbit_linear  # noqa: E402
from kbit_linear import _router_ops  # noqa: E402
from kbit_linear.router import FusedTopKRouter, router_options  # noqa: E402
from moe_configs import VOCAB, tiny_moe_config  # noqa: E402

# (family, norm_topk_prob)
CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False), ("olmoe", False), ("olmoe", True)]


def _model(family: str, norm: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family, norm)).to(dtype).eval()


def _routers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if "router" in type(m).__name__.lower()}


@pytest.mark.parametrize("family,norm", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_routers_match_transformers_routers(family, norm, dtype):
    model = _model(family, norm, dtype)
    originals = {n: copy.deepcopy(m) for n, m in _routers(model).items()}
    assert originals
    summary = kbit_linear.fuse_routers(model)
    assert sorted(summary.fused) == sorted(originals) and not summary.skipped, str(summary)
    for name, fused in _routers(model).items():
        orig = originals[name]
        assert isinstance(fused, FusedTopKRouter) and isinstance(fused, type(orig))
        want_norm = True if family == "mixtral" else norm
        assert fused.router_normalize == want_norm
        # whether the scores stay float32 under 16-bit logits, as the installed transformers does it
        # (Mixtral's did in some versions); read in bfloat16
        half = copy.deepcopy(orig).to(torch.bfloat16)
        assert fused.router_scores_float == (half(torch.randn(1, 64, dtype=torch.bfloat16))[1].dtype == torch.float32)
        for tokens in (1, 3, 17):
            x = torch.randn(tokens, 64, dtype=dtype) * 3
            got, want = fused(x), orig(x)
            assert [t.dtype for t in got] == [t.dtype for t in want]
            assert torch.equal(got[0], want[0])  # the same F.linear on CPU
            torch.testing.assert_close(got[1], want[1], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
            # the same probabilities chosen (which of two tied experts is chosen may differ)
            probs = torch.softmax(want[0].float(), -1)
            assert torch.equal(probs.gather(1, got[2]).sort(-1).values, probs.gather(1, want[2]).sort(-1).values)


@pytest.mark.parametrize("family,norm", CASES[:3])
def test_a_fused_model_generates_as_before_and_keeps_its_state_dict(family, norm):
    model = _model(family, norm)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kbit_linear.fuse_routers(model)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)


def test_router_logits_are_still_recorded():
    model = _model("qwen3_moe", True)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        want = model(ids, output_router_logits=True)
        kbit_linear.fuse_routers(model)
        got = model(ids, output_router_logits=True)
    assert got.router_logits is not None and len(got.router_logits) == len(want.router_logits) == 2
    for g, w in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(got.aux_loss, want.aux_loss)


def test_unfuse_pickle_and_deepcopy():
    model = _model("mixtral", True)
    kbit_linear.fuse_routers(model)
    again = kbit_linear.fuse_routers(model)
    assert not again.fused and set(again.skipped.values()) == {"already fused"}
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        routers = _routers(clone)
        assert routers and all(isinstance(m, FusedTopKRouter) and m.router_normalize for m in routers.values())
        ids = torch.randint(0, VOCAB, (1, 4))
        with torch.no_grad():
            torch.testing.assert_close(clone(ids).logits, model(ids).logits)
    assert kbit_linear.unfuse_routers(model) == 2
    for m in _routers(model).values():
        assert type(m) is transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter
        assert not hasattr(m, "router_normalize")
    assert kbit_linear.unfuse_routers(model) == 0


class SigmoidRouter(nn.Module):
    """A router whose scores are not softmax top-k (DeepSeek-V3 style): must be left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.weight = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        scores, index = torch.topk(logits.sigmoid(), self.top_k, dim=-1)
        return logits, scores, index


class OddRouter(nn.Module):
    def __init__(self, top_k=2, returns=3) -> None:
        super().__init__()
        self.top_k, self.returns = top_k, returns
        self.weight = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        return (logits,) * self.returns


class ExtraArgRouter(OddRouter):
    def forward(self, x, correction):
        return super().forward(x)


class BiasRouter(SigmoidRouter):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8))  # zero at the probe: still not a router the op computes


class FailingRouter(SigmoidRouter):
    def forward(self, x):
        raise RuntimeError("needs its own inputs")


def test_other_routers_are_left_alone_with_a_reason():
    mixtral_gate = _routers(_model("mixtral", True))["model.layers.0.mlp.gate"]
    wrapped = copy.deepcopy(mixtral_gate)
    wrapped.forward = lambda x: type(wrapped).forward(wrapped, x)  # what accelerate's hooks do
    holder = nn.ModuleDict({"sig": SigmoidRouter(), "one": OddRouter(returns=1), "k": OddRouter(top_k=9),
                            "extra": ExtraArgRouter(), "bias": BiasRouter(), "fails": FailingRouter(), "wrapped": wrapped})
    summary = kbit_linear.fuse_routers(holder)
    assert not summary.fused
    assert "not the top-k softmax" in summary.skipped["sig"]
    assert "does not return" in summary.skipped["one"]
    assert "top_k=9" in summary.skipped["k"]
    assert "takes ['x', 'correction']" in summary.skipped["extra"]
    assert "more than a weight (bias)" in summary.skipped["bias"]
    assert "RuntimeError: needs its own inputs" in summary.skipped["fails"]
    assert "replaced on the instance" in summary.skipped["wrapped"]
    meta = copy.deepcopy(holder["sig"]).to("meta")
    assert "meta" in router_options(meta)
    with pytest.raises(TypeError, match="model"):
        kbit_linear.fuse_routers("model")
    with pytest.raises(TypeError, match="model"):
        kbit_linear.unfuse_routers(None)


def _brute_force(x, w, top_k, normalize):
    logits = F.linear(x, w)
    probs = torch.softmax(logits.float(), -1)
    rows_s, rows_i = [], []
    for p in probs.tolist():
        order = sorted(range(len(p)), key=lambda e: (-p[e], e))[:top_k]  # larger first, then the lower expert
        s = torch.tensor([p[e] for e in order])
        rows_s.append(s / s.sum() if normalize else s)
        rows_i.append(order)
    return logits, torch.stack(rows_s), torch.tensor(rows_i)


@pytest.mark.parametrize("normalize", [True, False])
def test_reference_ties_go_to_the_lower_expert(normalize):
    w = torch.zeros(12, 8)
    w[[2, 5, 7, 9]] = 1.0  # four equal best experts, the rest tied below them
    w[[0, 11]] = 0.5
    x = torch.ones(3, 8)
    logits, scores, index = _router_ops.router_top_k_reference(x, w, 5, normalize, True)
    _, want_s, want_i = _brute_force(x, w, 5, normalize)
    assert index.tolist() == want_i.tolist() == [[2, 5, 7, 9, 0]] * 3
    torch.testing.assert_close(scores, want_s)


def test_reference_matches_brute_force_on_random_inputs():
    g = torch.Generator().manual_seed(3)
    for t, e, h, k in ((1, 8, 16, 2), (5, 60, 24, 4), (9, 128, 32, 8), (2, 3, 8, 3)):
        x, w = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g)
        logits, scores, index = _router_ops.router_top_k_reference(x, w, k, True, True)
        want_l, want_s, want_i = _brute_force(x, w, k, True)
        assert torch.equal(logits, want_l) and index.tolist() == want_i.tolist()
        torch.testing.assert_close(scores, want_s)
        fake = torch.ops.kbit_linear.router_top_k(x.to("meta"), w.to("meta"), k, True, False)
        assert [tuple(f.shape) for f in fake] == [(t, e), (t, k), (t, k)] and fake[1].dtype == x.dtype


def test_bad_arguments_name_themselves():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    op = torch.ops.kbit_linear.router_top_k
    with pytest.raises(ValueError, match="top_k"):
        op(x, w, 0, True, True)
    with pytest.raises(ValueError, match="top_k"):
        op(x, w, 9, True, True)
    with pytest.raises(TypeError, match="weight"):
        op(x, w.half(), 2, True, True)
    with pytest.raises(TypeError, match="x must be"):
        op(x.int(), w.int(), 2, True, True)
    with pytest.raises(ValueError, match="weight"):
        op(x, torch.randn(8, 15), 2, True, True)
    with pytest.raises(ValueError, match="weight"):
        op(x[0], w, 2, True, True)
    with pytest.raises((TypeError, RuntimeError), match="normalize|bool"):
        _router_ops.router_top_k_reference(x, w, 2, 1, True)
    # the public function checks before the op's dispatcher turns True into 1 or None into False
    with pytest.raises(TypeError, match="top_k must be an int"):
        _router_ops.router_top_k(x, w, True, True, True)
    with pytest.raises(TypeError, match="normalize"):
        _router_ops.router_top_k(x, w, 2, None, True)


def test_quantize_model_and_from_pretrained_with_fuse_fuse_the_routers(tmp_path):
    model = _model("qwen3_moe", True)
    ids = torch.randint(0, VOCAB, (1, 6))
    summary = kbit_linear.quantize_model(model, bits=4, fuse=True, progress=False)
    assert sorted(summary.routers.fused) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert "fused 2 routers" in str(summary)
    assert kbit_linear.quantize_model(_model("qwen3_moe", True), bits=4, progress=False).routers is None
    dense = _model("qwen3_moe", True)
    dense.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=kbit_linear.KbitConfig(bits=4, fuse=True), dtype=torch.float32)
    assert len(loaded.kbit_router_fusion.fused) == 2
    assert all(isinstance(m, FusedTopKRouter) for m in _routers(loaded).values())
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()
    loaded.dequantize()  # the routers are restored: the report of what was fused goes with them
    assert not hasattr(loaded, "kbit_router_fusion") and not hasattr(loaded, "kbit_fusion")
    assert not any(isinstance(m, FusedTopKRouter) for m in loaded.modules())
    kbit_linear.fuse_routers(model)
    model.kbit_router_fusion = summary.routers  # as a fused load records it
    assert kbit_linear.unfuse_routers(model) == 2 and not hasattr(model, "kbit_router_fusion")


@pytest.mark.parametrize("normalize,scores_float", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_are_the_references(normalize, scores_float, dtype):
    # The op's backward against autograd through the reference's own torch code.
    g = torch.Generator().manual_seed(7)
    x0, w0 = torch.randn(5, 24, generator=g).to(dtype), (torch.randn(10, 24, generator=g) * 0.3).to(dtype)
    r_logits, r_scores = torch.randn(5, 10, generator=g), torch.randn(5, 3, generator=g)
    grads = []
    for fn in (torch.ops.kbit_linear.router_top_k, _router_ops.router_top_k_reference):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        logits, scores, index = fn(x, w, 3, normalize, scores_float)
        assert not index.requires_grad
        ((logits.float() * r_logits).sum() + (scores.float() * r_scores).sum()).backward()
        grads.append((x.grad, w.grad))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(grads[0], grads[1]):
        torch.testing.assert_close(got, want, **tol)
    # only the scores' gradient: the logits' output unused
    x, w = x0.clone().requires_grad_(True), w0.clone()
    _, scores, _ = torch.ops.kbit_linear.router_top_k(x, w, 3, normalize, scores_float)
    scores.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_fused_router_trains_as_the_original():
    # Router fine-tuning (and the auxiliary load-balancing loss) must see the same gradients.
    ids = torch.randint(0, VOCAB, (2, 6))
    grads = []
    for fuse in (False, True):
        model = _model("qwen3_moe", True)
        model.config.output_router_logits = True
        if fuse:
            assert len(kbit_linear.fuse_routers(model).fused) == 2
        out = model(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        grads.append([model.model.layers[i].mlp.gate.weight.grad.clone() for i in range(2)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_module_hooks_run_around_a_fused_router():
    # transformers adds such hooks to record router logits; they must neither block fusing nor be skipped
    gate = copy.deepcopy(_routers(_model("qwen3_moe", True))["model.layers.0.mlp.gate"])
    seen = []
    gate.register_forward_hook(lambda mod, args, out: seen.append(out[0].shape))
    assert kbit_linear.fuse_routers(gate).fused == [""]
    gate(torch.randn(3, 64))
    assert seen == [torch.Size([3, 6])]  # the fused call's, not the probe's


def test_other_dtypes_and_autocast_take_the_original_forward():
    model = _model("mixtral", True)  # float32: the scores' rule is read in bfloat16 (Mixtral's stay float32 or not)
    gate = model.model.layers[0].mlp.gate
    orig = copy.deepcopy(gate)
    kbit_linear.fuse_routers(model)
    half_scores = orig.to(torch.bfloat16)(torch.randn(2, 64, dtype=torch.bfloat16))[1].dtype
    orig.float()
    assert gate.router_scores_float == (half_scores == torch.float32)
    model.to(torch.bfloat16)  # fused in float32, run in bfloat16: the scores' dtype as the original's
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert gate(x)[1].dtype == half_scores
    x32 = torch.randn(4, 64)
    with pytest.raises(RuntimeError):  # another dtype than the weight: the original forward, and its error
        orig.to(torch.bfloat16)(x32)
    with pytest.raises(RuntimeError):
        gate(x32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate(x)
    assert got[0].dtype == torch.bfloat16


def test_router_options_refuses_a_non_module_by_name():
    # (it returned a reason string for None, as for a module that is no router)
    with pytest.raises(TypeError, match="module must be an nn.Module, got NoneType"):
        router_options(None)


def test_fused_router_names_non_tensor_hidden_states():
    model = _model("qwen3_moe", True)
    kbit_linear.fuse_routers(model)
    router = next(m for m in model.modules() if isinstance(m, FusedTopKRouter))
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor, got list"):
        router([[0.0] * router.weight.shape[1]])
