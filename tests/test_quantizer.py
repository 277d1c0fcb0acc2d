"""``quantize_weight`` on CPU: the one path from a dense weight to the stored tensors."""

from __future__ import annotations

import pytest
import torch

from kbit_linear import format as fmt
from kbit_linear import quantizer
from kbit_linear import calibration
from kbit_linear.linear import KbitLinear
from kbit_linear.quantizer import KbitTensors, group_quantization, quantize_weight


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("n, k", [(33, 100), (192, 576), (1, 1), (130, 65)], ids=str)
def test_matches_the_format_reference(bits, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k + bits))
    q = quantize_weight(w, bits)
    ref = fmt.quantize(w, bits)
    assert isinstance(q, KbitTensors)
    for got, want in zip(q, (ref.packed, ref.absmax, ref.codebook, ref.tensor_scale)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert (q.packed.shape, q.absmax.shape) == fmt.tiled_shapes(n, k, bits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights(dtype):
    w = torch.randn(48, 96).to(dtype)
    q = quantize_weight(w, 3)
    assert torch.equal(q.packed, fmt.quantize(w, 3).packed)


def test_user_codebook_is_copied_not_aliased():
    cb = torch.tensor([-1.0, -0.3, 0.2, 1.0])
    q = quantize_weight(torch.randn(8, 40), 2, cb)
    assert torch.equal(q.codebook, cb) and q.codebook.data_ptr() != cb.data_ptr()
    # the default codebook is a fresh tensor too (the cached one must never be handed out)
    a, b = quantize_weight(torch.randn(8, 40), 2), quantize_weight(torch.randn(8, 40), 2)
    assert a.codebook.data_ptr() != b.codebook.data_ptr()


def test_meta_weight_gives_meta_tensors_of_the_tiled_shapes():
    q = quantize_weight(torch.empty(300, 200, device="meta"), 5)
    assert all(t.device.type == "meta" for t in q)
    assert (q.packed.shape, q.absmax.shape) == fmt.tiled_shapes(300, 200, 5)
    assert q.codebook.shape == (32,) and q.tensor_scale.shape == (1,)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(bits=6), ValueError, "bits"),
        (dict(bits=4.0), TypeError, "bits"),
        (dict(bits=True), TypeError, "bits"),
        (dict(bits=2, codebook=torch.tensor([1.0, 0.5, 0.0, -1.0])), ValueError, "codebook must be sorted"),
        (dict(bits=2, codebook=torch.tensor([-2.0, -0.5, 0.5, 2.0])), ValueError, r"codebook values must lie in \[-1, 1\]"),
        (dict(bits=3, codebook=torch.linspace(-1, 1, 16)), ValueError, r"codebook must have shape \[8\]"),
        (dict(bits=2, codebook=[-1.0, 0.0, 0.5, 1.0]), TypeError, "codebook must be a torch.Tensor"),
        (dict(bits=2, codebook=torch.tensor([-1, 0, 1, 2])), TypeError, "codebook must be a floating-point"),
        (dict(weight=torch.tensor([[1.0, float("nan")]])), ValueError, "weight contains NaN or Inf"),
        (dict(weight=torch.tensor([[1.0, float("inf")]])), ValueError, "weight contains NaN or Inf"),
        (dict(weight=torch.randint(0, 3, (4, 32))), TypeError, "weight must be a floating-point"),
        (dict(weight=torch.randn(32)), ValueError, "weight must be 2-D"),
        (dict(weight=torch.randn(0, 32)), ValueError, "weight must not be empty"),
        (dict(weight=[[1.0]]), TypeError, "weight must be a torch.Tensor"),
        # checked without a hessian too, not only where it is used
        (dict(damp=5), ValueError, r"damp must be in \(0, 1\)"),
        (dict(damp="0.01"), TypeError, "damp"),
        (dict(lazy_block=48), ValueError, "lazy_block must be a multiple of 32"),
        (dict(lazy_block=0), ValueError, "lazy_block"),
        (dict(hessian=torch.eye(32), damp=0.0), ValueError, "damp"),
    ],
    ids=["bits-6", "bits-float", "bits-bool", "cb-descending", "cb-range", "cb-size", "cb-list", "cb-int",
         "nan", "inf", "int-weight", "1-d", "empty", "list", "damp-no-hessian", "damp-str", "lazy-block-48",
         "lazy-block-0", "damp-with-hessian"],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, error, match):
    args = dict(weight=torch.randn(4, 32), bits=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        quantize_weight(**args)


def test_error_messages_use_the_given_name():
    with pytest.raises(ValueError, match=r"model.q_proj.weight contains NaN"):
        quantize_weight(torch.full((2, 32), float("nan")), 4, name="model.q_proj.weight")


def test_values_are_validated_once(monkeypatch):
    """One NaN/Inf scan of the weight and one codebook check per call; the ops check metadata only."""
    calls = {"scan": 0, "codebook": 0}
    check_weight, validate_codebook = fmt.check_weight, fmt.validate_codebook

    def counting_check_weight(weight, name="weight", *, finite=True):
        calls["scan"] += finite
        return check_weight(weight, name, finite=finite)

    def counting_validate_codebook(codebook, bits, name="codebook"):
        calls["codebook"] += 1
        return validate_codebook(codebook, bits, name)

    monkeypatch.setattr(fmt, "check_weight", counting_check_weight)
    monkeypatch.setattr(fmt, "validate_codebook", counting_validate_codebook)
    q = quantize_weight(torch.randn(40, 96), 3, torch.linspace(-1, 1, 8))
    assert calls == {"scan": 1, "codebook": 1}
    assert q.packed.dtype == torch.int32


def test_runs_the_quantize_and_repack_ops(monkeypatch):
    # through the torch ops, so a backend registered for the weight's device (CUDA) runs
    seen = []
    for attr in ("_QUANTIZE", "_REPACK"):
        op = getattr(quantizer, attr)
        assert op in (torch.ops.kbit_linear.quantize.default, torch.ops.kbit_linear.repack.default)
        monkeypatch.setattr(quantizer, attr, lambda *args, _op=op: seen.append(_op) or _op(*args))
    quantize_weight(torch.randn(8, 40), 4)
    assert seen == [torch.ops.kbit_linear.quantize.default, torch.ops.kbit_linear.repack.default]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_cuda_matches_the_cpu_reference_bit_for_bit(bits):
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(bits)).to(torch.bfloat16)
    cb = torch.linspace(-1, 1, 1 << bits)
    got = quantize_weight(w.cuda(), bits, cb)
    want = quantize_weight(w, bits, cb)
    for g, r in zip(got, want):
        assert g.is_cuda and torch.equal(g.cpu(), r)
    with pytest.raises(ValueError, match="weight contains NaN"):
        quantize_weight(torch.full((4, 64), float("nan"), device="cuda"), bits)


# ---------------------------------------------------------------------------------------
# block scale search
# ---------------------------------------------------------------------------------------


def _relative_error(q, w: torch.Tensor, bits: int) -> float:
    qw = fmt.KbitWeight(q.packed, q.absmax, q.codebook, q.tensor_scale, bits, *w.shape)
    return float((fmt.dequantize(qw) - w).pow(2).sum() / w.pow(2).sum())


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_scale_search_lowers_the_error_of_every_block(bits):
    torch.manual_seed(bits)
    w = torch.randn(67, 200) * torch.logspace(-3, 1, 67).unsqueeze(1)
    w[3, :32] = 0.0  # an all-zero block keeps code 0
    plain = quantize_weight(w, bits)
    searched = quantize_weight(w, bits, scale_search=True)
    assert _relative_error(searched, w, bits) < _relative_error(plain, w, bits)
    # per block: never a larger scale than the round-up absmax, never a larger error
    cb, ts = plain.codebook, plain.tensor_scale
    codes = fmt.search_block_codes(w, cb, ts)
    p0, c0, _ = fmt.quantize_blockwise(w, bits, cb, ts)
    assert bool((codes <= c0).all()) and int(codes[3, 0]) == 0
    def block_err(c):
        blocks = fmt.KbitWeight(*fmt.tile_blocks(fmt.quantize_with_codes(w, bits, cb, ts, c), c, bits), cb, ts, bits, 67, 200)
        d = torch.nn.functional.pad(fmt.dequantize(blocks) - w, (0, 24)).reshape(67, -1, 32)
        return d.pow(2).sum(-1)
    assert bool((block_err(codes) <= block_err(c0) * (1 + 1e-5) + 1e-12).all())  # fp32 sums in another order
    # the stored tensors are what quantize_with_codes gives
    packed, absmax = fmt.tile_blocks(fmt.quantize_with_codes(w, bits, cb, ts, codes), codes, bits)
    assert torch.equal(searched.packed, packed) and torch.equal(searched.absmax, absmax)


def test_scale_search_with_one_candidate_is_the_round_up_code():
    w = torch.randn(10, 96)
    cb = fmt.create_normal_float_codebook(3)
    ts = fmt.compute_tensor_scale(w)
    _, c0, _ = fmt.quantize_blockwise(w, 3, cb, ts)
    assert torch.equal(fmt.search_block_codes(w, cb, ts, candidates=1), c0)
    with pytest.raises(ValueError, match="candidates"):
        fmt.search_block_codes(w, cb, ts, candidates=0)


def test_scale_search_argument_is_checked_and_meta_works():
    with pytest.raises(TypeError, match="scale_search"):
        quantize_weight(torch.randn(4, 32), 3, scale_search=1)
    q = quantize_weight(torch.empty(300, 100, device="meta"), 2, scale_search=True)
    assert q.packed.device.type == "meta" and tuple(q.packed.shape) == fmt.tiled_shapes(300, 100, 2)[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_scale_search_on_cuda_agrees_with_cpu(bits):
    """The search runs in PyTorch on the weight's device. GPU sums may order their additions
    differently, so a near tie can go the other way: nearly every code agrees, and the planes
    always match the codes the GPU chose."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(bits))
    got = quantize_weight(w.cuda(), bits, scale_search=True)
    want = quantize_weight(w, bits, scale_search=True)
    assert got.packed.is_cuda
    assert float((got.absmax.cpu() == want.absmax).float().mean()) > 0.99
    codes = fmt.untile_blocks(got.packed.cpu(), got.absmax.cpu(), bits, 300, 200)[1]
    planes = fmt.quantize_with_codes(w, bits, want.codebook, want.tensor_scale, codes)
    assert torch.equal(fmt.tile_blocks(planes, codes, bits)[0], got.packed.cpu())


# ---------------------------------------------------------------------------------------
# a given tensor scale, and what a fused group shares
# ---------------------------------------------------------------------------------------


def test_a_given_tensor_scale_is_used_and_checked():
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    own = fmt.compute_tensor_scale(w)
    q = quantize_weight(w, 4, tensor_scale=own * 4)
    assert torch.equal(q.tensor_scale, own * 4)
    err = lambda q: float((fmt.dequantize(fmt.KbitWeight(*q, 4, 96, 128)) - w).norm() / w.norm())  # noqa: E731
    assert err(q) < 1.05 * err(quantize_weight(w, 4))  # a larger power of two costs (almost) nothing
    with pytest.raises(ValueError, match="too small"):
        quantize_weight(w * 1000, 4, tensor_scale=own)
    with pytest.raises(ValueError, match="power of two"):
        quantize_weight(w, 4, tensor_scale=own * 3)
    with pytest.raises(TypeError, match="tensor_scale"):
        quantize_weight(w, 4, tensor_scale=2.0)


def test_group_quantization_shares_levels_and_the_largest_scale():
    torch.manual_seed(1)
    a, b = torch.randn(64, 96), torch.randn(32, 96) * 100
    shared = quantizer.group_quantization([a, b], 4, "fitted")
    assert torch.equal(shared.tensor_scale, torch.maximum(fmt.compute_tensor_scale(a), fmt.compute_tensor_scale(b)))
    assert shared.codebook.shape == (16,) and torch.equal(shared.codebook, shared.codebook.sort().values)
    fixed = quantizer.group_quantization([a, b], 3, None)
    assert torch.equal(fixed.codebook, fmt.create_normal_float_codebook(3))
    with pytest.raises(ValueError, match="at least one"):
        quantizer.group_quantization([], 4)
    with pytest.raises(ValueError, match="in_features"):
        quantizer.group_quantization([a, torch.randn(4, 32)], 4)


def test_tensor_scale_shape_and_meta_are_refused_and_far_apart_groups_keep_their_own():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="one value"):
        quantize_weight(w, 4, tensor_scale=torch.ones(2))
    with pytest.raises(ValueError, match="meta"):
        quantize_weight(w, 4, tensor_scale=torch.ones(1, device="meta"))
    shared = quantizer.group_quantization([w, w * 1e-5], 4)
    assert shared.tensor_scale is None  # 2**17 apart: more than GROUP_SCALE_SPREAD_MAX


def test_a_bad_hessian_is_named_before_the_rotation():
    lin = torch.nn.Linear(64, 128)
    with pytest.raises(ValueError, match="hessian must have shape"):
        KbitLinear.from_linear(lin, hadamard=True, hessian=torch.eye(32))
    with pytest.raises(TypeError, match="hessian must be a floating-point"):
        KbitLinear.from_linear(lin, hadamard=True, hessian=torch.eye(64, dtype=torch.int64))


def test_given_tensor_scales_are_checked_where_they_are_taken():
    w = torch.randn(64, 64)
    for bad in (torch.tensor([2.0**-10]), torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([3.0])):
        with pytest.raises(ValueError, match="tensor_scale"):
            fmt.quantize_blockwise(w, 4, tensor_scale=bad)
        with pytest.raises(ValueError, match="tensor_scale"):
            calibration.gptq_quantize_blocks(w, torch.eye(64), 4, tensor_scale=bad)
    with pytest.raises(TypeError, match="tensor_scale"):
        calibration.gptq_quantize_blocks(w, torch.eye(64), 4, tensor_scale=1.0)
    ts = fmt.compute_tensor_scale(w)
    assert fmt.quantize_blockwise(w, 4, tensor_scale=ts.double())[2].dtype == torch.float32


def test_group_quantization_checks_the_signs():
    with pytest.raises(ValueError, match="hadamard_signs"):
        group_quantization([torch.randn(32, 64)], 4, hadamard_signs=torch.ones(1, dtype=torch.int8))
    with pytest.raises(ValueError, match="hadamard_signs must hold only"):
        group_quantization([torch.randn(32, 64)], 4, hadamard_signs=torch.full((64,), 10, dtype=torch.int8))


@pytest.mark.parametrize("weights", [torch.randn(2, 4, 32), torch.randn(4, 32), {"a": torch.randn(4, 32)}],
                         ids=["3-d-tensor", "2-d-tensor", "dict"])
def test_group_quantization_wants_a_list_of_weights(weights):
    # a stacked tensor used to fail deep inside (the truth value of a tensor), a dict passed its keys
    with pytest.raises(TypeError, match="weights must be a list or tuple"):
        group_quantization(weights, 3)
