"""GPU tests of the 8-bit append kernel (``kernels/kv_append.cu``) against the reference
(:func:`kbit_linear.kv_format.append_tokens8`): every field of the grown bucket bit for bit.

Old buckets are drawn fresh per case with uneven rows (an empty one among them); new keys and
values come in the layout attention hands the cache (``[B, q, H, D]`` transposed, so not
contiguous), in each dtype the kernel has, with groups that are all zero, too small for an fp16
scale, exactly half-way between two codes, and (fp32) too large for one. The kernel's outputs are
allocated pre-filled with values it never writes (int8 -128, fp16 NaN, int32 -1), so a field it
does not write shows; and its result also equals the reference run on the CPU.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kbit_linear import _kv_ops
from kbit_linear.backends.cuda import kv_append
from kbit_linear.kv_format import KVBucket, append_tokens8, channel_group, quantize_tokens

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (batch, heads, head_dim, new tokens, old entries per row)
CASES = [
    (1, 8, 128, 1, [70]),
    (1, 1, 64, 1, [0]),
    (3, 2, 96, 1, [5, 0, 9]),
    (2, 4, 32, 7, [3, 12]),
    (1, 2, 256, 64, [33]),
    (4, 1, 160, 3, [0, 1, 0, 2]),
]


def _old_bucket(batch: int, heads: int, d: int, counts: list[int], seed: int) -> KVBucket:
    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.full((c,), r) for r, c in enumerate(counts)]).long()
    pos = torch.cat([torch.sort(torch.randperm(200, generator=g)[:c]).values for c in counts]).long()
    n = rows.numel()
    bk = quantize_tokens(torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g) * 3, 8, rows, pos, batch)
    return KVBucket(8, **{name: x.cuda() for name, x in bk.tensors().items()})


def _new_tokens(batch: int, heads: int, q: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, H, q, D] as attention passes them: a transpose of [B, q, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    g = channel_group(d)
    k = torch.randn(batch, q, heads, d, generator=gen) * 2
    v = torch.randn(batch, q, heads, d, generator=gen)
    k[0, 0, 0, :g] = 0.0  # an all-zero group: scale 0, codes 0
    # a group whose amax is 127: scale 1 exactly, and values half-way between codes (round to even)
    k[-1, -1, -1, -g:] = torch.tensor([127.0, -126.5, 2.5, -3.5] + [0.5 + i for i in range(g - 4)])
    v[-1, -1, -1, -g:] = 1e-9  # the scale underflows to 0 in fp16
    if dtype == torch.float32:
        v[0, 0, 0, :g] = 1e7  # amax / 127 past fp16's largest: the scale is clamped to 65504
    return k.to(dtype).cuda().transpose(1, 2), v.to(dtype).cuda().transpose(1, 2)


_NEVER_WRITTEN = {torch.int8: -128, torch.float16: float("nan"), torch.int32: -1}


def _prefilled(monkeypatch) -> None:
    """Make the kernel's output allocations hold values no output element can have."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(_NEVER_WRITTEN[t.dtype]) if t.dtype in _NEVER_WRITTEN else t

    monkeypatch.setattr(kv_append.torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(kv_append.torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}-d{}-q{}-n{}".format(c[0], c[1], c[2], c[3], "_".join(map(str, c[4]))))
def test_kernel_matches_the_reference_bit_for_bit(case, dtype: torch.dtype, monkeypatch) -> None:
    batch, heads, d, q, counts = case
    seed = zlib.crc32(repr((case, str(dtype))).encode()) % 10_000
    old = _old_bucket(batch, heads, d, counts, seed)
    k, v = _new_tokens(batch, heads, q, d, dtype, seed + 1)
    pos0 = 200
    want = append_tokens8(old, k, v, pos0)
    on_cpu = append_tokens8(KVBucket(8, **{n: x.cpu() for n, x in old.tensors().items()}), k.cpu(), v.cpu(), pos0)
    with monkeypatch.context() as m:
        _prefilled(m)
        got = kv_append.append_tokens8_cuda(old, k, v, pos0)
    assert got is not None
    for name, x in want.tensors().items():
        y = got.tensors()[name]
        assert y.dtype == x.dtype and y.shape == x.shape, name
        assert torch.equal(y, x), (name, (y != x).nonzero()[:5].tolist())
        assert torch.equal(y.cpu(), on_cpu.tensors()[name]), name  # the spec computes the same on either device
    assert got.v_zero is None


def test_the_edge_groups_are_what_they_claim() -> None:
    # the edge groups of _new_tokens reach the cases they name (so the test above covers them)
    k, v = _new_tokens(1, 2, 1, 64, torch.float32, 0)
    out = kv_append.append_tokens8_cuda(_old_bucket(1, 2, 64, [0], 0), k, v, 0)
    assert float(out.k_scale[0, 0, 0]) == 0.0 and not out.k[0, 0].any()
    assert float(out.k_scale[0, 1, 0]) == 1.0
    assert out.k[0, 1, :4].tolist() == [127, -126, 2, -4]
    assert float(out.v_scale[0, 1, 0]) == 0.0 and not out.v[0, 1].any()
    assert float(out.v_scale[0, 0, 0]) == 65504.0


def test_entry_point_takes_the_kernel_and_falls_back_for_other_layouts() -> None:
    old = _old_bucket(2, 2, 64, [3, 1], 5)
    k, v = _new_tokens(2, 2, 1, 64, torch.bfloat16, 6)
    want = append_tokens8(old, k, v, 200)
    calls = []
    real = _kv_ops._append_backends["cuda"]
    try:
        def counted(*a):
            out = real(*a)
            calls.append(out is not None)  # whether the kernel took it
            return out

        _kv_ops._append_backends["cuda"] = counted
        got = _kv_ops.append_tokens8(old, k, v, 200)
        # channels not contiguous: the kernel declines, the reference runs
        wide = torch.zeros(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype, device=k.device)
        wide[..., ::2] = k
        strided = _kv_ops.append_tokens8(old, wide[..., ::2], v, 200)
    finally:
        _kv_ops._append_backends["cuda"] = real
    assert calls == [True, False]
    for name, x in want.tensors().items():
        assert torch.equal(got.tensors()[name], x), name
        assert torch.equal(strided.tensors()[name], x), name


def test_bad_arguments_name_what_is_wrong() -> None:
    old = _old_bucket(1, 2, 64, [2], 1)
    k, v = _new_tokens(1, 2, 1, 64, torch.float16, 2)
    with pytest.raises(ValueError, match="pos0"):
        _kv_ops.append_tokens8(old, k, v, -1)
    with pytest.raises(ValueError, match="k and v"):
        _kv_ops.append_tokens8(old, k, v[..., :32], 5)
    with pytest.raises(ValueError, match="does not fit"):
        _kv_ops.append_tokens8(old, k[:, :1], v[:, :1], 5)
    four = KVBucket(4, old.row_start, old.pos, old.k, old.v, old.v_scale, v_zero=old.v_scale)
    with pytest.raises(ValueError, match="8-bit"):
        _kv_ops.append_tokens8(four, k, v, 5)
    with pytest.raises(ValueError, match="q >= 1"):
        _kv_ops.append_tokens8(old, k[:, :, :0], v[:, :, :0], 5)
    with pytest.raises(ValueError, match="one device"):
        _kv_ops.append_tokens8(old, k, v.cpu(), 5)
    with pytest.raises(ValueError, match="one device"):
        _kv_ops.append_tokens8(KVBucket(8, **{n: x.cpu() for n, x in old.tensors().items()}), k, v, 5)
    with pytest.raises(ValueError, match="dtype"):
        _kv_ops.append_tokens8(KVBucket(8, old.row_start, old.pos.long(), old.k, old.v, old.v_scale, k_scale=old.k_scale), k, v, 5)
