"""GPU tests of the 8-bit append kernels (``kernels/kv_append.cu``) against the reference
(:mod:`kbit_linear.kv_format`): every field bit for bit.

``kbit_kv_append8`` (:func:`~kbit_linear.kv_format.append_tokens8`, a grown bucket): old buckets
are drawn fresh per case with uneven rows (an empty one among them); new keys and values come in
the layout attention hands the cache (``[B, q, H, D]`` transposed, so not contiguous), in each
dtype the kernel has, with groups that are all zero, too small for an fp16 scale, exactly
half-way between two codes, and (fp32) too large for one. The kernel's outputs are allocated
pre-filled with values it never writes (int8 -128, fp16 NaN, int32 -1), so a field it does not
write shows; and its result also equals the reference run on the CPU.

``kbit_kv_append8_in_place`` (:func:`~kbit_linear.kv_format.append_tokens8_in_place`, a
replayable cache's store): the same new tokens, several appends in a row into a store whose free
slots hold those never-written values, against the reference on a copy of the store (the store's
tensors, ``length`` and the overflow flag bit for bit), steps that do not fit (capacity 0 too),
the ticket counter left at zero, and a step captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kbit_linear import _kv_ops
from kbit_linear.backends.cuda import kv_append, loader, workspace
from kbit_linear.kv_format import KVBucket, KVStore8, append_tokens8, append_tokens8_in_place, channel_group, quantize_tokens
from test_workspace import _read_words

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


# ---- the in-place append into a store --------------------------------------------------------------

def _store(batch: int, heads: int, d: int, counts: list[int], room: int, seed: int) -> KVStore8:
    """A CUDA store of ``counts[r]`` tokens in row ``r`` and ``room`` free slots in the fullest
    row; every free slot holds values no append writes (int8 -128, fp16 NaN, int32 -1)."""
    store = KVStore8.from_bucket(_old_bucket(batch, heads, d, counts, seed), room)
    free = (torch.arange(store.capacity, device="cuda") >= store.count.unsqueeze(1)).reshape(-1)
    for name in ("k", "v", "k_scale", "v_scale", "pos"):
        t = getattr(store, name)
        t[free] = _NEVER_WRITTEN[t.dtype]
    return store


def _copy(store: KVStore8, device: str = "cuda") -> KVStore8:
    return KVStore8(store.capacity, **{name: t.to(device, copy=True) for name, t in store.tensors().items()})


def _assert_same_store(got: KVStore8, want: KVStore8) -> None:
    """Every tensor of two stores equal bit for bit (NaN fp16 compared by its bits)."""
    assert got.capacity == want.capacity
    for name, x in want.tensors().items():
        y = got.tensors()[name].to(x.device)
        assert y.dtype == x.dtype and y.shape == x.shape, name
        if x.dtype == torch.float16:
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(y, x), (name, (y != x).nonzero()[:5].tolist())


def _ticket() -> int:
    """The in-place kernel's ticket on the current stream, as an int32 read back from the device."""
    stream = torch.cuda.current_stream()
    _, ptr = workspace.zeroed_scratch("kv_append", stream.device.index, stream.cuda_stream, 0, 1)
    return _read_words(ptr, 1)[0]


def _kernel_in_place(store: KVStore8, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor) -> None:
    assert kv_append.append_tokens8_in_place_cuda(store, k, v, length), "the kernel did not take the append"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("counts", [[5], [4, 0, 9]], ids=lambda c: "b{}".format(len(c)))
def test_in_place_kernel_matches_the_reference_bit_for_bit(counts: list[int], q: int, d: int, dtype: torch.dtype) -> None:
    batch, heads, steps = len(counts), 2, 3
    seed = zlib.crc32(repr((counts, q, d, str(dtype))).encode()) % 10_000
    got = _store(batch, heads, d, counts, steps * q + 1, seed)
    want, on_cpu = _copy(got), _copy(got, "cpu")
    length = torch.tensor([200], dtype=torch.int32, device="cuda")
    want_length, cpu_length = length.clone(), length.to("cpu", copy=True)
    addresses = {name: t.data_ptr() for name, t in got.tensors().items()}
    for step in range(steps):
        k, v = _new_tokens(batch, heads, q, d, dtype, seed + 1 + step)  # strided: a transpose of [B, q, H, D]
        _kernel_in_place(got, k, v, length)
        append_tokens8_in_place(want, k, v, want_length)
        append_tokens8_in_place(on_cpu, k.cpu(), v.cpu(), cpu_length)
        _assert_same_store(got, want)
        _assert_same_store(got, on_cpu)  # the spec computes the same on either device
        assert length.tolist() == want_length.tolist() == cpu_length.tolist() == [200 + (step + 1) * q]
        assert got.count.tolist() == [n + (step + 1) * q for n in counts] and got.overflow.tolist() == [0]
    assert {name: t.data_ptr() for name, t in got.tensors().items()} == addresses
    assert _ticket() == 0


def test_in_place_kernel_reads_keys_at_any_strides() -> None:
    # keys and values sliced out of wider tensors (every stride but the channels' > the shape's)
    store = _store(3, 2, 64, [1, 6, 2], 4, 11)
    want, length = _copy(store), torch.tensor([50], dtype=torch.int32, device="cuda")
    want_length = length.clone()
    g = torch.Generator().manual_seed(12)
    wide = torch.randn(5, 4, 7, 96, generator=g).to("cuda", torch.bfloat16)
    k, v = wide[1:4, 1:3, 2:6, 16:80], wide[0:3, 2:4, 3:7, 8:72]
    assert not k.is_contiguous() and k.stride(-1) == 1
    _kernel_in_place(store, k, v, length)
    append_tokens8_in_place(want, k, v, want_length)
    _assert_same_store(store, want)
    assert length.tolist() == want_length.tolist() == [54]


@pytest.mark.parametrize("counts, room, q", [([2, 4], 3, 4), ([0], 0, 1), ([0, 0, 0], 0, 2), ([7], 0, 1)],
                         ids=["one-row-short", "capacity-0", "capacity-0-b3", "full"])
def test_an_in_place_step_that_does_not_fit_writes_nothing_and_sets_overflow(counts: list[int], room: int, q: int) -> None:
    store = _store(len(counts), 2, 64, counts, room, 3)
    kept = _copy(store)
    want = _copy(store)
    length = torch.tensor([90], dtype=torch.int32, device="cuda")
    want_length = length.clone()
    k, v = _new_tokens(len(counts), 2, q, 64, torch.float16, 4)
    _kernel_in_place(store, k, v, length)
    append_tokens8_in_place(want, k, v, want_length)
    _assert_same_store(store, want)
    assert store.overflow.tolist() == [1] and length.tolist() == want_length.tolist() == [90]
    kept.overflow.fill_(1)
    _assert_same_store(store, kept)  # nothing else moved
    assert _ticket() == 0
    if room:  # a later step that fits is written, and the flag stays set
        k, v = k[:, :, :room], v[:, :, :room]
        _kernel_in_place(store, k, v, length)
        append_tokens8_in_place(want, k, v, want_length)
        _assert_same_store(store, want)
        assert length.tolist() == [90 + room] and store.overflow.tolist() == [1]


def test_many_in_place_launches_leave_the_ticket_at_zero() -> None:
    # each launch's last block resets the ticket; if one did not, no block of the next launch
    # would be last and its counters would never move
    store = _store(3, 1, 64, [0, 3, 1], 40, 8)
    length = torch.tensor([10], dtype=torch.int32, device="cuda")
    for i in range(20):
        q = 1 + i % 2
        k, v = _new_tokens(3, 1, q, 64, torch.float32, 100 + i)
        _kernel_in_place(store, k, v, length)
    assert store.count.tolist() == [30, 33, 31] and length.tolist() == [40] and _ticket() == 0


@pytest.mark.parametrize("q", [1, 4])
def test_an_in_place_step_replays_in_a_cuda_graph(q: int) -> None:
    # one step captured, replayed with new keys each time: the same store as eager appends, the
    # positions taken from the length the previous replay advanced; one replay past the capacity
    # sets the flag and writes nothing
    batch, heads, d, replays = 3, 2, 128, 5
    store = _store(batch, heads, d, [3, 0, 6], (replays + 1) * q, 21)
    length = torch.tensor([300], dtype=torch.int32, device="cuda")
    k_in = torch.zeros(batch, q, heads, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)  # attention's layout
    v_in = torch.zeros_like(k_in)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile, and the ticket of this stream, before the capture
        _kernel_in_place(store, k_in, v_in, length)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    want, want_length = _copy(store), length.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        _kernel_in_place(store, k_in, v_in, length)
    torch.cuda.synchronize()
    _assert_same_store(store, want)  # capturing ran nothing
    for step in range(replays + 1):
        k, v = _new_tokens(batch, heads, q, d, torch.bfloat16, 400 + step)
        k_in.copy_(k)
        v_in.copy_(v)
        graph.replay()
        append_tokens8_in_place(want, k, v, want_length)
        torch.cuda.synchronize()
        _assert_same_store(store, want)
        assert length.tolist() == want_length.tolist()
    assert length.tolist() == [300 + (replays + 1) * q] and store.overflow.tolist() == [1]  # the last replay did not fit
    with torch.cuda.stream(stream):
        assert _ticket() == 0


def test_in_place_entry_point_takes_the_kernel_and_falls_back_for_other_layouts() -> None:
    store = _store(2, 2, 64, [3, 1], 4, 5)
    want, length = _copy(store), torch.tensor([60], dtype=torch.int32, device="cuda")
    want_length = length.clone()
    k, v = _new_tokens(2, 2, 1, 64, torch.float16, 6)
    calls = []
    real = _kv_ops._append_in_place_backends["cuda"]
    try:
        def counted(*a):
            took = real(*a)
            calls.append(took)
            return took

        _kv_ops._append_in_place_backends["cuda"] = counted
        _kv_ops.append_tokens8_in_place(store, k, v, length)
        append_tokens8_in_place(want, k, v, want_length)
        wide = torch.zeros(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype, device=k.device)
        wide[..., ::2] = k
        _kv_ops.append_tokens8_in_place(store, wide[..., ::2], v, length)  # channels not contiguous: the reference
        append_tokens8_in_place(want, k, v, want_length)
        _kv_ops.append_tokens8_in_place(store, k.float(), v, length)  # keys and values of two dtypes: the reference
        append_tokens8_in_place(want, k.float(), v, want_length)
    finally:
        _kv_ops._append_in_place_backends["cuda"] = real
    assert calls == [True, False, False]
    _assert_same_store(store, want)
    assert length.tolist() == want_length.tolist() == [63]
