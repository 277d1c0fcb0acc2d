"""The CPU implementation of ``kbit_linear::gemm`` (``kbit_linear/backends/cpu.py``): equal to the
reference within float32 rounding through the op and through the eager fast path
(``kbit_linear._ops.gemm``), which calls it without the dispatcher; when that path is taken; its
key cache, input checks, autograd through it, and no dense weight."""

from __future__ import annotations

import gc
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import kbit_linear  # noqa: F401  (registers the ops and the CPU backend)
from kbit_linear import _ops
from kbit_linear import format as fmt
from kbit_linear.backends import cpu
from kbit_linear.linear import KbitLinear

ops = torch.ops.kbit_linear

# (out_features, in_features): tile multiples, sizes of SmolLM2's layers, and odd sizes that
# fill no tile (K below one block, K not a multiple of 32 or 64, N below one n-tile)
SHAPES = [(128, 64), (192, 576), (576, 1536), (33, 100), (130, 65), (1, 1), (257, 31), (100, 33)]
LEADING = [(), (1,), (2,), (3,), (2, 5)]  # M = 1, 1, 2, 3 and 10: both products
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATHS = ["op", "eager"]  # torch.ops.kbit_linear.gemm (the dispatcher) or kbit_linear._ops.gemm (fast path)


@pytest.fixture(autouse=True)
def _fresh_cache():
    cpu.set_cache_enabled(True)
    cpu.clear_cache()
    yield
    cpu.set_cache_enabled(True)
    cpu.clear_cache()


def _layer(n: int, k: int, bits: int, seed: int = 0) -> fmt.KbitWeight:
    g = torch.Generator().manual_seed(seed)
    return fmt.quantize(torch.randn(n, k, generator=g) * 0.05, bits)


def _gemm(x: torch.Tensor, qw: fmt.KbitWeight, bias: torch.Tensor | None = None, path: str = "op") -> torch.Tensor:
    fn = ops.gemm if path == "op" else _ops.gemm
    return fn(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, qw.bits, qw.out_features, bias)


def _fp32_bound(x: torch.Tensor, qw: fmt.KbitWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """A safe float32 rounding bound per output: 2 K eps sum_k |x_k| |w_nk| for the sum, plus
    2 eps (|sum| + |bias|) for adding the bias and the last rounding."""
    eps = torch.finfo(torch.float32).eps
    w = fmt.dequantize(qw).double()
    xs = x.reshape(-1, qw.in_features).double()
    bound = 2 * qw.in_features * eps * (xs.abs() @ w.abs().t()) + 2 * eps * (xs @ w.t()).abs()
    return bound + (0 if bias is None else 2 * eps * bias.double().abs()) + 1e-30


def _assert_matches_reference(y: torch.Tensor, x: torch.Tensor, qw: fmt.KbitWeight, bias: torch.Tensor | None) -> None:
    ref = fmt.matmul(x, qw, bias)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if y.dtype == torch.float32:
        # both are within float32 rounding of the exact product
        truth = x.reshape(-1, qw.in_features).double() @ fmt.dequantize(qw).double().t()
        if bias is not None:
            truth = truth + bias.double()
        bound = _fp32_bound(x, qw, bias)
        assert ((y.reshape(truth.shape).double() - truth).abs() <= bound).all()
        assert ((ref.reshape(truth.shape).double() - truth).abs() <= bound).all()
    else:
        # float32 results within rounding of each other, then rounded to a 16-bit float: at
        # most one unit in the last place apart
        eps = torch.finfo(y.dtype).eps
        torch.testing.assert_close(y.float(), ref.float(), rtol=eps, atol=eps * ref.float().abs().max().item() * 1e-2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_reference_fp32(shape, bits, path):
    n, k = shape
    qw = _layer(n, k, bits, seed=n + k + bits)
    for i, lead in enumerate(LEADING):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(*lead, k, generator=g)
        bias = torch.randn(n, generator=g) if i % 2 else None
        _assert_matches_reference(_gemm(x, qw, bias, path), x, qw, bias)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_matches_reference_half_dtypes(bits, dtype, path):
    for (n, k), lead in zip([(192, 576), (33, 100), (130, 65)], [(1,), (2, 5), ()]):
        qw = _layer(n, k, bits, seed=bits)
        x = torch.randn(*lead, k).to(dtype)
        bias = torch.randn(n).to(dtype)
        for b in (None, bias):
            _assert_matches_reference(_gemm(x, qw, b, path), x, qw, b)


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_fast_path_and_op_agree_bit_for_bit(bits):
    # both run the same implementation: the path must not change a single bit
    qw = _layer(130, 200, bits, seed=bits)
    for lead in LEADING:
        for dtype in DTYPES:
            x = torch.randn(*lead, 200).to(dtype)
            assert torch.equal(_gemm(x, qw, path="eager"), _gemm(x, qw, path="op"))


def _count_fast_calls(monkeypatch) -> list[int]:
    """Count the calls that reach the CPU backend through the fast path (not the dispatcher)."""
    calls = [0]
    fast = _ops._eager_gemm["cpu"]

    def counted(*args):
        calls[0] += 1
        return fast(*args)

    monkeypatch.setitem(_ops._eager_gemm, "cpu", counted)
    return calls


def test_when_the_fast_path_is_taken(monkeypatch):
    calls = _count_fast_calls(monkeypatch)
    layer = KbitLinear.from_linear(torch.nn.Linear(96, 40), bits=4)
    x = torch.randn(2, 96)
    ref = fmt.matmul(x, layer.kbit_weight(), layer.bias)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    assert calls[0] == 1
    # the bias is a trainable Parameter: autograd records, so the op (with its backward) runs
    y = layer(x)
    assert calls[0] == 1 and y.requires_grad
    with torch.inference_mode():
        layer(x)
    assert calls[0] == 2
    # a Python dispatch mode or a torch-function mode must see the op itself
    with torch.no_grad(), torch.device("cpu"):
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), FlopCounterMode(display=False):
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(torch.vmap(layer)(x.unsqueeze(1)).squeeze(1), ref, rtol=1e-5, atol=1e-5)
    assert calls[0] == 2


def test_fake_tensors_and_compile_go_through_the_op(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = _count_fast_calls(monkeypatch)
    layer = KbitLinear.from_linear(torch.nn.Linear(100, 33, bias=False), bits=3)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        y = layer(mode.from_tensor(torch.randn(4, 100)))
    assert y.shape == (4, 33) and calls[0] == 0
    x = torch.randn(1, 100)
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), layer(x))
    assert calls[0] == 1  # the eager call only


@pytest.mark.parametrize("path", PATHS)
def test_bad_arguments_are_caught_after_the_layer_is_cached(path):
    # the weight's checks run once per cache entry: what changes between calls must still be seen
    qw = _layer(300, 200, 3)
    good = dict(x=torch.randn(1, 200), packed=qw.packed, absmax=qw.absmax, codebook=qw.codebook,
                tensor_scale=qw.tensor_scale, bits=3, out_features=300, bias=None)
    fn = ops.gemm if path == "op" else _ops.gemm
    fn(**good)
    assert cpu.cache_nbytes() > 0
    cases = [
        (dict(bits=4), "bits=4"),
        (dict(out_features=400), "out_features=400"),
        (dict(codebook=torch.zeros(16)), r"shape \[8\]"),
        (dict(codebook=torch.zeros(8, dtype=torch.float64)), "float32"),
        (dict(tensor_scale=torch.ones(2)), "tensor_scale"),
        (dict(absmax=qw.absmax.to(torch.int32)), "uint8"),
        (dict(x=torch.randn(1, 130)), "last dimension 130"),
        (dict(x=torch.randint(0, 3, (1, 200))), "floating point"),
        (dict(bias=torch.zeros(7)), r"bias must have shape \[300\]"),
    ]
    for change, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            fn(**{**good, **change})
    # and the good call still works from the same entry
    torch.testing.assert_close(fn(**good), fmt.matmul(good["x"], qw), rtol=1e-5, atol=1e-5)


def test_float64_input_computed_in_float32_like_the_reference():
    qw = _layer(40, 96, 4)
    x = torch.randn(3, 96, dtype=torch.float64)
    y = _gemm(x, qw)
    assert y.dtype == torch.float64
    _assert_matches_reference(y.float(), x.float(), qw, None)


def test_keys_decode_back_to_the_indices():
    # the keys of every width hold each weight's codebook index exactly once
    for bits in fmt.SUPPORTED_BITS:
        s = cpu.SCHEMES[bits]
        qw = _layer(200, 130, bits, seed=bits)
        kt = qw.packed.shape[0]
        keys = torch.empty((kt, 2, s.spacing, 4, qw.out_features), dtype=torch.int64)
        cpu._keys(qw.packed, bits, 0, kt, keys)
        mask = (1 << bits) - 1
        slots = torch.stack([(keys >> (s.spacing * g)) & mask for g in range(s.group)], -1)  # [kt, 2, S, 4, N, G]
        # weight r + S (G l + g) of block (kt, kb) -> [N, kt, 2, 32]
        got = torch.empty(qw.out_features, kt, 2, 32, dtype=torch.int64)
        for r, lane, g in itertools.product(range(s.spacing), range(4), range(s.group)):
            got[..., r + s.spacing * (lane * s.group + g)] = slots[:, :, r, lane, :, g].permute(2, 0, 1)
        flat, _ = fmt.untile_blocks(qw.packed, qw.absmax, bits, qw.out_features, qw.in_features)
        want = fmt.unpack_bitplanes(flat, bits).long()  # [N, ceil(K/32), 32]
        assert torch.equal(got.reshape(qw.out_features, -1, 32)[:, : want.shape[1]], want), bits
        assert int(keys.max()) < s.nkeys


def test_cache_on_and_off_give_the_same_bits():
    qw = _layer(300, 200, 3)
    x1, x4 = torch.randn(1, 200), torch.randn(4, 200)
    on = [_gemm(x1, qw), _gemm(x4, qw)]
    assert cpu.cache_nbytes() > 0
    cpu.set_cache_enabled(False)
    assert cpu.cache_nbytes() == 0
    off = [_gemm(x1, qw), _gemm(x4, qw)]
    assert cpu.cache_nbytes() == 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_cache_size_is_one_key_byte_per_group_plus_scales():
    for bits, (n, k) in [(2, (256, 512)), (4, (192, 576)), (5, (100, 33))]:
        cpu.clear_cache()
        qw = _layer(n, k, bits)
        _gemm(torch.randn(1, k), qw)
        s = cpu.SCHEMES[bits]
        k_pad = qw.packed.shape[0] * fmt.TILE_K
        assert cpu.cache_nbytes() == n * k_pad // s.group + n * k_pad // 32 * 4


def test_cache_follows_replaced_tensors():
    # new absmax / tensor_scale tensors (which may reuse a freed tensor's address and version)
    a, b = _layer(64, 128, 4, seed=1), _layer(64, 128, 4, seed=2)
    layer = KbitLinear(128, 64, bits=4, bias=False)
    layer.load_state_dict({"weight": a.packed, "absmax": a.absmax, "codebook": a.codebook, "tensor_scale": a.tensor_scale})
    x = torch.randn(1, 128)
    with torch.no_grad():
        layer(x)
        layer.absmax = b.absmax.clone()
        want = fmt.matmul(x, fmt.KbitWeight(a.packed, b.absmax, a.codebook, a.tensor_scale, 4, 64, 128))
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        layer.tensor_scale = a.tensor_scale * 2
        want = fmt.matmul(x, fmt.KbitWeight(a.packed, b.absmax, a.codebook, a.tensor_scale * 2, 4, 64, 128))
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_cache_follows_in_place_changes_and_dies_with_the_tensors():
    a, b = _layer(64, 128, 4, seed=1), _layer(64, 128, 4, seed=2)
    layer = KbitLinear(128, 64, bits=4, bias=False)
    layer.load_state_dict({"weight": a.packed, "absmax": a.absmax, "codebook": a.codebook, "tensor_scale": a.tensor_scale})
    x = torch.randn(1, 128)
    with torch.no_grad():
        assert torch.allclose(layer(x), fmt.matmul(x, a), rtol=1e-5, atol=1e-5)
        # load_state_dict copies in place into the same tensors: the cache must notice
        layer.load_state_dict({"weight": b.packed, "absmax": b.absmax, "codebook": b.codebook, "tensor_scale": b.tensor_scale})
        assert torch.allclose(layer(x), fmt.matmul(x, b), rtol=1e-5, atol=1e-5)
    assert cpu.cache_nbytes() > 0
    del layer
    gc.collect()
    assert cpu.cache_nbytes() == 0


def test_inference_tensors_work_uncached():
    with torch.inference_mode():
        layer = KbitLinear.from_linear(torch.nn.Linear(96, 40), bits=4)
        x = torch.randn(2, 96)
        y = layer(x)
    assert cpu.cache_nbytes() == 0
    torch.testing.assert_close(y, fmt.matmul(x, layer.kbit_weight(), layer.bias), rtol=1e-5, atol=1e-5)


def test_lookup_tables_are_reused_only_for_the_same_rows():
    # consecutive calls with the same x reuse the tables; x changed in place, or the same
    # numbers in another shape, must not
    a, b = _layer(50, 1152, 4, seed=1), _layer(50, 576, 4, seed=2)
    x = torch.randn(1, 1152)
    for _ in range(2):
        torch.testing.assert_close(_gemm(x, a), fmt.matmul(x, a), rtol=1e-5, atol=1e-5)
    x.mul_(-0.5)
    torch.testing.assert_close(_gemm(x, a), fmt.matmul(x, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_gemm(x.view(2, 576), b), fmt.matmul(x.view(2, 576), b), rtol=1e-5, atol=1e-5)


def test_empty_batch():
    qw = _layer(33, 100, 4)
    y = _gemm(torch.randn(0, 100), qw)
    assert y.shape == (0, 33)


def test_threads_share_no_scratch():
    qws = [_layer(n, 576, 4, seed=n) for n in (192, 576, 1536)]
    xs = [torch.randn(1, 576) for _ in range(12)]

    def run(i: int) -> bool:
        qw = qws[i % 3]
        return torch.allclose(_gemm(xs[i], qw), fmt.matmul(xs[i], qw), rtol=1e-5, atol=1e-4)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(12)))


@pytest.mark.parametrize("with_bias", [False, True])
def test_autograd_through_the_cpu_op(with_bias):
    lin = torch.nn.Linear(100, 33, bias=with_bias)
    layer = KbitLinear.from_linear(lin, bits=4)
    if with_bias:
        layer.bias.requires_grad_(True)
    x = torch.randn(2, 3, 100, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    w_hat = layer.dequantize()
    torch.testing.assert_close(x.grad, g @ w_hat, rtol=1e-5, atol=1e-5)
    if with_bias:
        torch.testing.assert_close(layer.bias.grad, g.reshape(-1, 33).sum(0), rtol=1e-5, atol=1e-5)


def test_the_cpu_kernel_is_registered():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kbit_linear::gemm", "CPU")


@pytest.mark.parametrize("cache", [True, False])
def test_no_dense_weight_is_allocated(cache):
    # random planes and scales of a 2048 x 4096 layer (no need to quantize: the op reads any bits)
    n, k, bits = 2048, 4096, 4
    p_shape, a_shape = fmt.tiled_shapes(n, k, bits)
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, p_shape, dtype=torch.int32, generator=g)
    absmax = torch.randint(1, 120, a_shape, dtype=torch.uint8, generator=g)
    cb, ts = fmt.create_normal_float_codebook(bits), torch.ones(1)
    cpu.set_cache_enabled(cache)
    dense = n * k * 4
    for m in (1, 8):
        x = torch.randn(m, k)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            y = ops.gemm(x, packed, absmax, cb, ts, bits, n, None)
        # every allocation inside the op (the op's own event adds them all up)
        largest = max((e.cpu_memory_usage for e in prof.events() if e.name != "kbit_linear::gemm"), default=0)
        assert 0 < largest <= dense // 4, (m, largest, dense)
        if m == 8:
            ref = F.linear(x, fmt.dequantize(fmt.KbitWeight(packed, absmax, cb, ts, bits, n, k)))
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("value", ["off", "0", 0, None])
def test_set_cache_enabled_takes_a_bool_only(value):
    # a string such as "off" once turned the cache on
    cpu.set_cache_enabled(False)
    try:
        with pytest.raises(TypeError, match="enabled must be a bool"):
            cpu.set_cache_enabled(value)
        assert cpu.cache_enabled() is False
    finally:
        cpu.set_cache_enabled(True)
