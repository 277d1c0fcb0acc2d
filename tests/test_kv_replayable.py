"""KbitKVCache(replayable=True) (CPU): the 8-bit store and its in-place append, the in-place mass
accumulation, and layers and models that give the default cache's results bit for bit while the
store's tensors keep their addresses between two allocator runs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kbit_linear import _kv_ops
from kbit_linear.kv_cache import KbitKVCache, KbitKVLayer, ReplayableKVLayer, cache_keyword
from kbit_linear.kv_format import (
    TIERS,
    KVBucket,
    KVStore8,
    accumulate_mass,
    append_tokens8,
    append_tokens8_in_place,
    causal_visible,
    quantize_tokens,
    visible_queries,
)
from test_kv_cache import _record_allocations, _tiny


def _bucket8(counts: list[int], heads: int = 2, d: int = 64, seed: int = 0) -> KVBucket:
    """An 8-bit bucket whose row ``r`` holds ``counts[r]`` random tokens at increasing positions below 50."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.full((n,), r) for r, n in enumerate(counts)]).long()
    pos = torch.cat([torch.sort(torch.randperm(50, generator=g)[:n]).values for n in counts]).long()
    n = rows.numel()
    return quantize_tokens(torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g), 8, rows, pos, len(counts))


def _entries(bucket: KVBucket) -> dict[str, torch.Tensor]:
    """A bucket's entries as a set: every field and the row, sorted by (row, position)."""
    rows = bucket.rows()
    order = torch.argsort(rows * (1 << 32) + bucket.pos.long())
    out = {name: val[order] for name, val in bucket.tensors().items() if name != "row_start"}
    out["rows"] = rows[order]
    return out


def _assert_same_entries(a: KVBucket, b: KVBucket) -> None:
    ea, eb = _entries(a), _entries(b)
    assert ea.keys() == eb.keys()
    for name, x in ea.items():
        assert x.dtype == eb[name].dtype and torch.equal(x, eb[name]), name


def _addresses(store: KVStore8) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in store.tensors().items()}


# ---- the store -----------------------------------------------------------------------------------

@pytest.mark.parametrize("counts", [[0], [5], [5, 0, 7]], ids=str)
def test_store_holds_the_bucket_with_room_in_its_fullest_row(counts: list[int]) -> None:
    bucket = _bucket8(counts)
    store = KVStore8.from_bucket(bucket, 3)
    assert store.capacity == max(counts) + 3 and store.count.tolist() == counts and store.overflow.tolist() == [0]
    assert store.k.shape == (len(counts) * store.capacity, 2, 64)
    for r, n in enumerate(counts):  # row r's entries from r * capacity on
        lo = int(bucket.row_start[r])
        assert torch.equal(store.pos[r * store.capacity:r * store.capacity + n], bucket.pos[lo:lo + n])
    back = store.bucket()
    for name, x in bucket.tensors().items():
        assert torch.equal(back.tensors()[name], x), name


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("counts", [[6], [5, 0, 7]], ids=str)
def test_in_place_append_equals_append_tokens8(q: int, counts: list[int]) -> None:
    # the same codes, scales and positions as the growing bucket, at the same addresses, with the
    # positions taken from the device length; keys in the model's layout (a strided view)
    b, steps = len(counts), 3
    bucket = _bucket8(counts)
    store = KVStore8.from_bucket(bucket, steps * q)
    before = _addresses(store)
    length = torch.tensor([50], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        k = torch.randn(b, q, 2, 64, generator=g).transpose(1, 2)
        v = torch.randn(b, 2, q, 64, generator=g, dtype=torch.float16)
        bucket = append_tokens8(bucket, k, v, 50 + step * q)
        _kv_ops.append_tokens8_in_place(store, k, v, length)
        assert _addresses(store) == before
        assert length.tolist() == [50 + (step + 1) * q] and store.count.tolist() == [n + (step + 1) * q for n in counts]
        _assert_same_entries(store.bucket(), bucket)
    assert store.overflow.tolist() == [0] and int(store.count.max()) == store.capacity


def test_a_store_needs_room_of_zero_or_more() -> None:
    with pytest.raises(ValueError, match="room"):
        KVStore8.from_bucket(_bucket8([3, 1]), -1)


@pytest.mark.parametrize("room", [0, 3])
def test_an_append_that_does_not_fit_writes_nothing_and_sets_overflow(room: int) -> None:
    store = KVStore8.from_bucket(_bucket8([2, 4]), room)
    kept = {name: t.clone() for name, t in store.tensors().items()}
    length = torch.tensor([50], dtype=torch.int32)
    k = torch.randn(2, 2, 4, 64)
    append_tokens8_in_place(store, k, k, length)  # 4 tokens: more than the fullest row has room for
    assert store.overflow.tolist() == [1] and length.tolist() == [50]
    for name, t in store.tensors().items():
        if name != "overflow":
            assert torch.equal(t, kept[name]), name
    if room:
        append_tokens8_in_place(store, k[:, :, :room], k[:, :, :room], length)
        assert length.tolist() == [50 + room]
    assert store.overflow.tolist() == [1]  # a later append that fits does not clear it


def test_in_place_append_refuses_what_does_not_fit() -> None:
    store = KVStore8.from_bucket(_bucket8([2, 4]), 4)
    k, length = torch.randn(2, 2, 1, 64), torch.tensor([50], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit"):
        _kv_ops.append_tokens8_in_place(store, k[:1], k[:1], length)
    with pytest.raises(ValueError, match="k and v"):
        _kv_ops.append_tokens8_in_place(store, k, k[..., :32], length)
    with pytest.raises(ValueError, match="length"):
        _kv_ops.append_tokens8_in_place(store, k, k, length.long())
    store.count = store.count.long()
    with pytest.raises(ValueError, match="count"):
        _kv_ops.append_tokens8_in_place(store, k, k, length)


@pytest.mark.parametrize("taken", [True, False])
def test_a_backend_takes_the_in_place_append_or_leaves_it_to_the_reference(monkeypatch: pytest.MonkeyPatch, taken: bool) -> None:
    calls = []
    monkeypatch.setattr(_kv_ops, "_append_in_place_backends", {})
    _kv_ops.register_append_tokens8_in_place("cpu", lambda *args: calls.append(args) or taken)
    store, length = KVStore8.from_bucket(_bucket8([2]), 1), torch.tensor([50], dtype=torch.int32)
    k = torch.randn(1, 2, 1, 64)
    _kv_ops.append_tokens8_in_place(store, k, k, length)
    assert len(calls) == 1 and calls[0][0] is store
    assert store.count.tolist() == [2 if taken else 3] and length.tolist() == [50 if taken else 51]


def test_the_cuda_kernel_takes_the_in_place_append_of_cuda_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from kbit_linear.backends.cuda import kv_append

    assert _kv_ops._append_in_place_backends.get("cuda") is kv_append.append_tokens8_in_place_cuda
    assert "cpu" not in _kv_ops._append_in_place_backends
    monkeypatch.setitem(_kv_ops._append_in_place_backends, "cuda", lambda *args: pytest.fail("the CUDA launcher got CPU tensors"))
    store, length = KVStore8.from_bucket(_bucket8([2]), 1), torch.tensor([50], dtype=torch.int32)
    k = torch.randn(1, 2, 1, 64)
    _kv_ops.append_tokens8_in_place(store, k, k, length)
    assert store.count.tolist() == [3] and length.tolist() == [51]


def test_the_cuda_launcher_declines_what_its_kernel_does_not_read() -> None:
    # decided before anything touches a device: each of these goes to the reference
    from kbit_linear.backends.cuda.kv_append import append_tokens8_in_place_cuda

    store, length = KVStore8.from_bucket(_bucket8([2, 0]), 2), torch.tensor([50], dtype=torch.int32)
    k = torch.randn(2, 2, 1, 64, dtype=torch.float16)
    wide = torch.randn(2, 2, 1, 128, dtype=torch.float16)
    assert not append_tokens8_in_place_cuda(store, k, k.float(), length)  # two dtypes
    assert not append_tokens8_in_place_cuda(store, k.double(), k.double(), length)  # no instance
    assert not append_tokens8_in_place_cuda(store, wide[..., ::2], k, length)  # channels not contiguous
    empty = KVStore8.from_bucket(KVBucket.empty(8, 0, 2, 64), 2)
    assert not append_tokens8_in_place_cuda(empty, k[:0], k[:0], length)  # no rows: no grid
    store.k = store.k.transpose(1, 2)  # a store the kernel could not write in place
    assert not append_tokens8_in_place_cuda(store, k, k, length)


# ---- mass ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("q", [1, 3])
def test_causal_visible_with_a_device_length_equals_visible_queries(q: int) -> None:
    got = causal_visible(torch.tensor([9], dtype=torch.int32), q, 16)
    assert torch.equal(got[:9], visible_queries(None, 1, q, 9)[0]) and not got[9:].any()


def test_accumulate_mass_rounds_as_adding_into_views() -> None:
    g = torch.Generator().manual_seed(0)
    mass, seen = torch.rand(2, 16, generator=g), torch.rand(2, 16, generator=g) * 100
    view_mass, view_seen = mass.clone(), seen.clone()
    step_mass = torch.rand(2, 11, generator=g) / 3  # values whose sums round
    step_seen = 4 * causal_visible(torch.tensor([11], dtype=torch.int32), 2, 16)
    view_mass[:, :11] += step_mass
    view_seen[:, :11] += 4 * visible_queries(None, 2, 2, 11)
    kept = mass.clone(), seen.clone()
    accumulate_mass(mass, seen, step_mass, step_seen, torch.tensor([False]))
    assert torch.equal(mass, kept[0]) and torch.equal(seen, kept[1])
    accumulate_mass(mass, seen, step_mass, step_seen, torch.tensor([True]))
    assert torch.equal(mass, view_mass) and torch.equal(seen, view_seen)


# ---- layers --------------------------------------------------------------------------------------

class _Twins:
    """A default and a replayable layer fed the same random tokens and queries (2 KV heads of 32
    channels, 6 query heads; a left-padding mask when ``pad`` is given), checked equal after
    every call."""

    def __init__(self, batch: int, pad: list[int] | None, mass_interval: int = 1, kv_bits: float = 3) -> None:
        kw = dict(window=6, sink_tokens=2, block_size=16, hysteresis=0.1, mass_interval=mass_interval)
        self.layers = (KbitKVLayer(kv_bits, **kw), ReplayableKVLayer(kv_bits, **kw))
        self.g = torch.Generator().manual_seed(batch * 10 + mass_interval)
        self.batch, self.pad = batch, None if pad is None else torch.tensor(pad[:batch])

    def step(self, q: int) -> None:
        s = self.layers[0].seq_len
        k, v = (torch.randn(self.batch, 2, q, 32, generator=self.g) for _ in range(2))
        query = torch.randn(self.batch, 6, q, 32, generator=self.g)
        mask = None
        if self.pad is not None:
            p, i = torch.arange(s + q), torch.arange(q).unsqueeze(1) + s
            mask = ((p >= self.pad.view(-1, 1, 1)) & (p <= i)).unsqueeze(1)  # [B, 1, q, s + q]
        outs = []
        for layer in self.layers:
            layer.update(k, v)
            outs.append(layer.attend(query, mask, 32**-0.5))
        assert torch.equal(outs[0], outs[1])
        self.check()

    def remap(self, how: str, rows: list[int]) -> None:
        for layer in self.layers:
            getattr(layer, how)(torch.tensor(rows))
        self.batch = len(rows)
        self.pad = None if self.pad is None else self.pad[rows]
        self.check()

    def check(self) -> None:
        a, b = self.layers
        assert (a.seq_len, a._alloc_len, a._decode_calls) == (b.seq_len, b._alloc_len, b._decode_calls)
        assert b.device_seq_len.tolist() == [b.seq_len] and b.device_decode_calls.tolist() == [b._decode_calls]
        for t in TIERS:
            _assert_same_entries(a.buckets[t], b.buckets[t])
        for name in ("tier", "mass", "seen", "k_block_min", "k_block_range"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("batch,pad,mass_interval", [(1, None, 1), (3, None, 3), (3, [0, 5, 11], 1)],
                         ids=["b1", "b3-interval3", "b3-padded"])
def test_replayable_layer_equals_the_default_one(batch: int, pad: list[int] | None, mass_interval: int, q: int) -> None:
    twins = _Twins(batch, pad, mass_interval)
    twins.step(40)  # a prompt
    for _ in range(70 // q):  # several allocations
        twins.step(q)
    assert int((twins.layers[1].tier[0] < 8).sum()) > 10  # tokens left 8 bits
    for layer in twins.layers:
        layer.crop(-5)
    twins.check()
    for _ in range(20 // q):
        twins.step(q)
    if batch > 1:
        twins.remap("batch_select_indices", [2, 0])
        twins.step(q)
        twins.remap("reorder_cache", [1, 1])
        for _ in range(20 // q):
            twins.step(q)
    twins.step(24)  # a prompt chunk after decode steps
    twins.step(q)


@pytest.mark.parametrize("q", [1, 3])
def test_store_and_columns_keep_their_addresses_until_the_allocator_runs(q: int) -> None:
    layer = ReplayableKVLayer(3, window=6, sink_tokens=2, block_size=16, hysteresis=0.1)
    calls = _record_allocations(layer)
    g = torch.Generator().manual_seed(q)

    def feed(n: int) -> None:
        layer.update(torch.randn(2, 2, n, 32, generator=g), torch.randn(2, 2, n, 32, generator=g))
        layer.attend(torch.randn(2, 4, n, 32, generator=g), None, 32**-0.5)

    def addresses() -> dict[str, int]:
        held = {name: getattr(layer, name).data_ptr() for name in ("tier", "mass", "seen", "device_seq_len", "device_decode_calls")}
        return held | _addresses(layer._store)

    feed(40)
    epochs = []
    for _ in range(150 // q):
        steps, runs = layer.steps_until_allocation(q), len(calls)
        if steps == 0:
            assert layer._room == 0  # the store is full when the allocator runs
        feed(q)
        assert len(calls) == runs + (steps == 0)  # the allocator ran exactly when announced
        if steps == 0 or not epochs:
            epochs.append(addresses())
        assert addresses() == epochs[-1]
        store = layer._store
        assert store.overflow.tolist() == [0] and int(store.count.max()) + layer._room == store.capacity
        assert layer._spare["tier"][0].shape[1] % 16 == 0
    assert len(epochs) >= 5 and calls[-1] > 100


def test_a_device_length_off_the_host_one_is_found_when_the_epoch_ends() -> None:
    layer = ReplayableKVLayer(3, window=6, sink_tokens=2, block_size=16, hysteresis=0.1)
    layer.update(torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32))
    layer.device_seq_len += 1
    with pytest.raises(RuntimeError, match="length 11"):
        layer.crop(-2)


def test_nbytes_counts_the_store_capacity() -> None:
    layer = ReplayableKVLayer(3, window=6, sink_tokens=2, block_size=16, hysteresis=0.1)
    layer.update(torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32))
    store = layer._store
    assert store.capacity > 10
    assert layer.nbytes_by_kind()["payload"] == store.k.nbytes + store.v.nbytes


# ---- models --------------------------------------------------------------------------------------

def _caches(model, **kw) -> tuple[KbitKVCache, KbitKVCache]:
    kw = dict(kv_bits=3, window=4, sink_tokens=1, block_size=8, mass_interval=2) | kw
    return KbitKVCache(model.config, **kw), KbitKVCache(model.config, replayable=True, **kw)


def _assert_same_caches(a: KbitKVCache, b: KbitKVCache) -> None:
    for la, lb in zip(a.layers, b.layers):
        assert isinstance(lb, ReplayableKVLayer) and not isinstance(la, ReplayableKVLayer)
        for t in TIERS:
            _assert_same_entries(la.buckets[t], lb.buckets[t])
        for name in ("tier", "mass", "seen"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name


def test_model_decode_crop_and_batch_edits_equal_the_default_cache() -> None:
    model = _tiny("llama")
    caches = _caches(model)
    runs = _record_allocations(caches[1].layers[0])
    ids = torch.randint(3, 128, (3, 90), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :4] = 0  # left padding
    with torch.no_grad():
        def forward(lo: int, hi: int) -> None:
            outs = [model(ids[:, lo:hi], attention_mask=am[:, :hi], **{cache_keyword(model): c}).logits for c in caches]
            assert torch.equal(outs[0], outs[1])
            _assert_same_caches(*caches)

        forward(0, 20)
        for t in range(20, 60):
            steps, before = caches[1].steps_until_allocation(1), len(runs)
            forward(t, t + 1)
            assert len(runs) == before + (steps == 0)
        assert len(runs) >= 4
        for c in caches:
            c.crop(-5)
        forward(55, 70)  # a chunk of 15 queries: decode-size attention
        for c in caches:
            c.batch_select_indices(torch.tensor([2, 1]))
        ids, am = ids[[2, 1]], am[[2, 1]]
        for t in range(70, 90):
            forward(t, t + 1)


def test_beam_search_equals_the_default_cache() -> None:
    model = _tiny("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=24, do_sample=False, num_beams=3, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    caches = _caches(model)
    outs = [model.generate(ids, **{cache_keyword(model): c}, **kw) for c in caches]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(x, y) for x, y in zip(outs[0].scores, outs[1].scores))
    _assert_same_caches(*caches)


def test_steps_until_allocation_needs_agreeing_layers() -> None:
    cache = KbitKVCache(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2), block_size=16,
                        replayable=True)
    assert cache.steps_until_allocation(1) == 16 and cache.steps_until_allocation(3) == 6
    cache.layers[0].update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32))
    with pytest.raises(RuntimeError, match=r"\[11, 16\]"):
        cache.steps_until_allocation(1)
    with pytest.raises(ValueError, match="q"):
        cache.steps_until_allocation(0)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_replayable_must_be_a_bool(bad) -> None:
    with pytest.raises(ValueError, match="replayable"):
        KbitKVCache(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1), replayable=bad)


def _in_place_args(batch: int = 2, heads: int = 2, hq: int = 4, d: int = 64, length: int = 40, room: int = 8):
    """Arguments of decode_attention_in_place for a small random cache (CPU)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(batch, length, heads, d, generator=g), torch.randn(batch, length, heads, d, generator=g)
    rows, pos = torch.nonzero(torch.ones(batch, length), as_tuple=True)
    eight = quantize_tokens(k[rows, pos], v[rows, pos], 8, rows, pos, batch, None, None, 16)
    lower = [KVBucket.empty(t, batch, heads, d) for t in (2, 3, 4)]
    ld = 48
    return dict(query=torch.randn(batch, hq, 1, d, generator=g), buckets=lower, store=KVStore8.from_bucket(eight, room),
                k_block_min=None, k_block_range=None, block_size=16, planned_len=length + room,
                length=torch.tensor([length], dtype=torch.int32), tier=torch.full((batch, ld), 8, dtype=torch.int8),
                scaling=d**-0.5, mass=torch.zeros(batch, ld), seen=torch.zeros(batch, ld),
                calls=torch.tensor([1], dtype=torch.int32), mass_interval=2)


def test_in_place_attention_reference_records_on_the_calls_it_should() -> None:
    """The reference of decode_attention_in_place: the plain attention at the live length, its mass
    added into the running sums when (calls - 1) % mass_interval == 0 and not otherwise."""
    args = _in_place_args()
    out = _kv_ops.decode_attention_in_place(**args)
    want, mass = _kv_ops.decode_attention(args["query"], args["buckets"] + [args["store"].bucket()], None, None, 16, 40,
                                          args["tier"][:, :40], None, args["scaling"])
    assert torch.equal(out, want)
    assert torch.equal(args["mass"][:, :40], mass) and torch.equal(args["seen"][:, :40], torch.full((2, 40), 4.0))
    assert not args["mass"][:, 40:].any() and not args["seen"][:, 40:].any()
    args["calls"].fill_(2)  # (2 - 1) % 2 != 0: not a recording call
    before = args["mass"].clone()
    _kv_ops.decode_attention_in_place(**args)
    assert torch.equal(args["mass"], before)


@pytest.mark.parametrize("change, match", [
    ({"tier": torch.full((2, 48), 8, dtype=torch.int32)}, "tier"),
    ({"mass": torch.zeros(2, 40)}, "mass"),
    ({"seen": torch.zeros(2, 48, dtype=torch.float64)}, "seen"),
    ({"length": torch.tensor([40])}, "length"),
    ({"calls": torch.tensor([1, 2], dtype=torch.int32)}, "calls"),
    ({"planned_len": 49}, "planned_len"),
    ({"planned_len": 0}, "planned_len"),
    ({"mass_interval": 0}, "mass_interval"),
    ({"planned_len": 39}, "past planned_len"),
])
def test_in_place_attention_names_bad_arguments(change: dict, match: str) -> None:
    args = _in_place_args()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        _kv_ops.decode_attention_in_place(**args)


def test_in_place_attention_wants_the_lower_buckets_in_order() -> None:
    args = _in_place_args()
    args["buckets"] = args["buckets"][::-1]
    with pytest.raises(ValueError, match="buckets"):
        _kv_ops.decode_attention_in_place(**args)


def _greedy(model, cache: KbitKVCache, first: torch.Tensor, steps: int) -> torch.Tensor:
    """Plain greedy decoding, one eager forward call a token, without a mask or positions."""
    ids, out = first, []
    with torch.no_grad():
        for _ in range(steps):
            ids = model(ids, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids)
    return torch.cat(out, 1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decode_graph_schedule_equals_plain_decoding(kind: str) -> None:
    """KbitDecodeGraph's schedule (eager step, frozen steps, advance) without graphs: the tokens and
    the cache of plain greedy decoding with the default cache, over several allocator runs."""
    from kbit_linear import KbitDecodeGraph

    model = _tiny(kind)
    plain, replayable = _caches(model)
    prompt = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        firsts = [model(prompt, **{cache_keyword(model): c}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
                  for c in (plain, replayable)]
    assert torch.equal(*firsts)
    runs = _record_allocations(replayable.layers[0])
    want = _greedy(model, plain, firsts[0], 60)
    decoder = KbitDecodeGraph(model, replayable, use_graph=False)
    got = decoder.generate(firsts[1], 60)
    assert torch.equal(got, want)
    _assert_same_caches(plain, replayable)
    assert len(runs) >= 3 and decoder.replays > 40  # several epochs, most steps frozen
    for layer in replayable.layers:  # the host's mirrors agree with the device counters
        assert layer.device_seq_len.tolist() == [layer.seq_len] and layer.device_decode_calls.tolist() == [layer._decode_calls]


def test_a_frozen_step_that_does_not_fit_the_epoch_is_refused() -> None:
    model = _tiny("llama")
    _, cache = _caches(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 30)), **{cache_keyword(model): cache}, use_cache=True)  # a prompt: no decode store open
        assert cache.replayable_steps(1) == 0
        with pytest.raises(RuntimeError, match="must fit the open epoch"), cache.capturing():
            model(torch.randint(3, 128, (1, 1)), **{cache_keyword(model): cache}, use_cache=True)


def test_capturing_and_advance_need_a_replayable_cache() -> None:
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    plain, replayable = _caches(model)
    with pytest.raises(RuntimeError, match="replayable"), plain.capturing():
        pass
    with pytest.raises(RuntimeError, match="replayable"):
        plain.advance(1, 1)
    assert plain.replayable_steps(1) == 0
    with pytest.raises(ValueError, match="steps"):
        replayable.advance(1, 0)
    with pytest.raises(ValueError, match="replayable"):
        KbitDecodeGraph(model, plain)
    with pytest.raises(TypeError, match="KbitKVCache"):
        KbitDecodeGraph(model, object())
    with pytest.raises(ValueError, match="no tokens"):
        KbitDecodeGraph(model, replayable)
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 12)), **{cache_keyword(model): replayable}, use_cache=True)
    decoder = KbitDecodeGraph(model, replayable, use_graph=False)
    with pytest.raises(ValueError, match="first"):
        decoder.generate(torch.zeros(1, 1, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="steps"):
        decoder.generate(torch.zeros(2, 1, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="cache's device"):
        decoder.generate(torch.zeros(2, 1, dtype=torch.int64, device="meta"), 3)
    with pytest.raises(ValueError, match="one CUDA device"):  # graphs need the cache on a GPU
        KbitDecodeGraph(model, replayable).generate(torch.zeros(2, 1, dtype=torch.int64), 3)


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_decode_graph_refuses_sliding_window_layers(kind: str) -> None:
    """A step captured below the window would be replayed past it without the window's mask."""
    from kbit_linear import KbitDecodeGraph

    model = _tiny(kind)
    _, cache = _caches(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 12)), **{cache_keyword(model): cache}, use_cache=True)
    with pytest.raises(ValueError, match="sliding-window"):
        KbitDecodeGraph(model, cache, use_graph=False)


def test_decode_graph_refuses_a_padded_prompt() -> None:
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    _, cache = _caches(model)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 12)), attention_mask=mask, **{cache_keyword(model): cache}, use_cache=True)
    with pytest.raises(ValueError, match="left-padded"):
        KbitDecodeGraph(model, cache, use_graph=False)


def test_mask_left_out_only_for_a_captured_unpadded_causal_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a CUDA graph is captured, transformers builds the causal mask even for one query; the
    cache's mask function leaves it out (a replayed step cannot take a mask built for one length)
    unless there is padding, a window or a changed mask function."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from kbit_linear.kv_cache import kbit_kv_mask

    args = dict(batch_size=2, q_length=1, kv_length=10, q_offset=9, kv_offset=0, mask_function=causal_mask_function,
                allow_is_causal_skip=True, device="cpu")
    padded = torch.ones(2, 10, dtype=torch.bool)
    padded[1, :3] = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert kbit_kv_mask(attention_mask=None, **args) is None
    built = kbit_kv_mask(attention_mask=padded, **args)
    assert torch.equal(built, sdpa_mask(attention_mask=padded, **args)) and not built.all()
    assert kbit_kv_mask(attention_mask=None, local_size=4, **args) is not None
    assert kbit_kv_mask(attention_mask=None, **{**args, "allow_is_causal_skip": False}) is not None
    assert kbit_kv_mask(attention_mask=None, **{**args, "q_length": 3, "q_offset": 7}) is not None  # SDPA would take it upper-left
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q3 = {**args, "q_length": 3, "q_offset": 7}
    assert torch.equal(kbit_kv_mask(attention_mask=None, **q3), sdpa_mask(attention_mask=None, **q3))


def test_compiled_layers_run_compiled_in_every_layer_and_decode_the_same_tokens() -> None:
    """compile_layers: every decoder layer runs its compiled graphs (as many graph calls a step per
    layer with 12 layers as with 2: none fell back to eager past torch's recompile limit, with
    fused projections too), the tokens equal the uncompiled schedule's, a second generate call
    compiles nothing more, and the layers' own compiled state is back afterwards."""
    import kbit_linear
    from kbit_linear import KbitDecodeGraph
    from transformers import LlamaForCausalLM

    def graph_calls_per_step(layers: int, fuse: bool) -> tuple[float, int, int]:
        torch._dynamo.reset()
        calls, compiled = [0], [0]

        def backend(gm, example_inputs):
            compiled[0] += 1

            def run(*args):
                calls[0] += 1
                return gm.forward(*args)
            return run

        cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        if fuse:
            kbit_linear.quantize_model(model, bits=4, skip=["lm_head"], fuse=True, progress=False)
        prompt = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
        got = {}
        for on in (False, True):
            _, cache = _caches(model)
            with torch.no_grad():
                first = model(prompt, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            decoder = KbitDecodeGraph(model, cache, use_graph=False, compile_layers=on, compile_options={"backend": backend})
            head = decoder.generate(first, 4)
            frames, calls[0] = compiled[0], 0
            got[on] = torch.cat([head, decoder.generate(head[:, -1:], 8)], 1)
        assert torch.equal(got[True], got[False])
        assert all(layer._compiled_call_impl is None for layer in model.model.layers)
        torch._dynamo.reset()
        return calls[0] / 8, frames, compiled[0]

    for fuse in (False, True):
        per_step_2, _, _ = graph_calls_per_step(2, fuse)
        per_step_12, frames, after = graph_calls_per_step(12, fuse)
        assert per_step_2 > 0 and per_step_12 == 6 * per_step_2, (fuse, per_step_2, per_step_12)
        assert after == frames, "a second generate call compiled again"


def test_compile_layers_names_bad_arguments() -> None:
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    _, cache = _caches(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 12)), **{cache_keyword(model): cache}, use_cache=True)
    with pytest.raises(TypeError, match="compile_layers"):
        KbitDecodeGraph(model, cache, compile_layers=1)
    with pytest.raises(TypeError, match="compile_options"):
        KbitDecodeGraph(model, cache, compile_layers=True, compile_options=["aot_eager"])
    with pytest.raises(ValueError, match="reduce-overhead"):
        KbitDecodeGraph(model, cache, compile_layers=True, compile_options={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match="triton.cudagraphs"):
        KbitDecodeGraph(model, cache, compile_layers=True, compile_options={"options": {"triton.cudagraphs": True}})
    with pytest.raises(TypeError, match="compile_options"):
        KbitDecodeGraph(model, cache, compile_layers=True, compile_options={"bakend": "eager"})
    with pytest.raises(ValueError, match="model.model.layers"):
        KbitDecodeGraph(model.model.layers[0], cache, compile_layers=True)


def test_a_replay_that_did_not_move_the_device_length_is_refused() -> None:
    """The check after an epoch's first replay: an empty capture (a replay that ran nothing) raises
    instead of repeating the last eager token for the whole epoch."""
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    _, cache = _caches(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 12)), **{cache_keyword(model): cache}, use_cache=True)
    with pytest.raises(RuntimeError, match="did not run on replay"):
        KbitDecodeGraph(model, cache, use_graph=False)._check_first_replay()  # the device length is the host's


def test_a_layer_the_user_compiled_gets_its_compiled_state_back() -> None:
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    _, cache = _caches(model)
    with torch.no_grad():
        first = model(torch.randint(3, 128, (1, 12)), **{cache_keyword(model): cache}, use_cache=True).logits[:, -1:].argmax(-1)
    model.model.layers[0].compile(backend="eager")
    users = model.model.layers[0]._compiled_call_impl
    decoder = KbitDecodeGraph(model, cache, use_graph=False, compile_layers=True, compile_options={"backend": "eager"})
    decoder.generate(first, 3)
    assert model.model.layers[0]._compiled_call_impl is users and model.model.layers[1]._compiled_call_impl is None
    assert decoder.graph is None  # no graphs without use_graph
    torch._dynamo.reset()


def test_an_interrupted_epoch_leaves_the_cache_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in the middle of an epoch's steps: the host takes the steps that ran, so the
    next call goes on from there (its eager step would otherwise find the device ahead)."""
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    plain, cache = _caches(model)
    prompt = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        first = model(prompt, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    decoder = KbitDecodeGraph(model, cache, use_graph=False)
    real_step, calls = decoder._step, [0]

    def failing_step(*args):
        calls[0] += 1
        if calls[0] == 4:  # the third frozen step of the first epoch
            raise KeyboardInterrupt
        return real_step(*args)

    monkeypatch.setattr(decoder, "_step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        decoder.generate(first, 40)
    monkeypatch.setattr(decoder, "_step", real_step)
    assert cache.get_seq_length() == 30 + 3 and decoder.replays == 2
    more = decoder.generate(first, 5)  # goes on without a device/host mismatch
    assert more.shape == (1, 5)
    for layer in cache.layers:
        assert layer.device_seq_len.tolist() == [layer.seq_len]


def test_decode_graph_refuses_a_row_with_no_valid_position_yet() -> None:
    from kbit_linear import KbitDecodeGraph

    model = _tiny("llama")
    _, cache = _caches(model)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1] = 0  # row 1: padding only, so far
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 8)), attention_mask=mask, **{cache_keyword(model): cache}, use_cache=True)
    with pytest.raises(ValueError, match="left-padded"):
        KbitDecodeGraph(model, cache, use_graph=False)
