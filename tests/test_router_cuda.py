"""The router kernel (``kernels/router.cu``) against the reference of ``kbit_linear::router_top_k``.

The kernel's logits are sums in another order than cuBLAS's, so they are compared within a
rounding of ``F.linear``'s; its choice of experts and their scores are then checked exactly
against the reference's selection applied to the kernel's own logits (softmax, stable top-k,
renormalisation), so a swapped pair, a missed tie rule or an unwritten element fails. Outputs
land in memory just filled with NaN (the caching allocator hands it back). Also: ties, every
dtype and option, odd expert counts and hidden sizes, sizes that take the reference, many launches
in a row (the counter each launch must leave at zero), CUDA-graph replay, ``torch.compile`` and a
fused tiny Qwen3-MoE model on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kbit_linear
from kbit_linear.backends.cuda import loader, router, tuning

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
]

DEV = torch.device("cuda")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (tokens, experts, hidden, top_k): real shapes (Qwen3-30B-A3B, Mixtral, OLMoE, Qwen2-MoE's 60)
# and odd ones (experts not a multiple of the block's 4, one expert, the most experts and top_k)
SHAPES = [(1, 128, 2048, 8), (4, 8, 4096, 2), (16, 64, 2048, 8), (3, 60, 2048, 4), (9, 5, 520, 2), (2, 1, 8, 1),
          (7, 257, 136, 32), (1, 512, 64, 8), (11, 33, 1032, 3), (8, 128, 2048, 8), (5, 200, 264, 16)]
# |logit - F.linear| <= rel * |F.linear| + abs * max |F.linear|: the rounding to the dtype, and sums
# in another order (absolute, at the scale of the row's terms)
LOGIT_TOL = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 2e-3), torch.float32: (1e-5, 1e-5)}


def _op(x, w, k, normalize, scores_float):
    # Blocks of the outputs' sizes, filled with NaN (and -1 experts) and freed: the caching allocator
    # hands the same blocks to the op's outputs, so an element the kernel leaves unwritten shows.
    t, e = x.shape[0], w.shape[0]
    junk = [torch.full((t, e), float("nan"), dtype=x.dtype, device=x.device),
            torch.full((t, k), float("nan"), dtype=torch.float32 if scores_float else x.dtype, device=x.device),
            torch.full((t, k), -1, dtype=torch.int64, device=x.device)]
    del junk
    return torch.ops.kbit_linear.router_top_k(x, w, k, normalize, scores_float)


@pytest.fixture
def kernel_only(monkeypatch):
    """The kernel at every token count, and a failure if a call falls back to the reference."""
    monkeypatch.setattr(tuning, "ROUTER_MAX_TOKENS", 1 << 30)

    def no_reference(*args):
        raise AssertionError("the router kernel did not take this call")

    monkeypatch.setattr(router._router_ops, "router_top_k_reference", no_reference)


def _selection(logits, k, normalize, scores_float):
    """The reference's softmax / stable top-k / renormalisation on the given logits."""
    probs = torch.softmax(logits.float(), -1)
    i = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    s = probs.gather(1, i)
    if normalize:
        s = s / s.sum(-1, keepdim=True)
    return (s if scores_float else s.to(logits.dtype)), i


def _check(x, w, k, normalize, scores_float, got):
    logits, scores, index = got
    assert logits.dtype == x.dtype and index.dtype == torch.int64
    assert scores.dtype == (torch.float32 if scores_float else x.dtype)
    assert not torch.isnan(logits).any() and not torch.isnan(scores.float()).any()
    ref = F.linear(x.float(), w.float())
    rel, ab = LOGIT_TOL[x.dtype]
    bad = (logits.float() - ref).abs() > rel * ref.abs() + ab * ref.abs().max()
    assert not bad.any(), f"logits off: {logits[bad][:4].tolist()} vs {ref[bad][:4].tolist()}"
    want_s, want_i = _selection(logits, k, normalize, scores_float)
    rows = (index != want_i).any(-1)
    assert not rows.any(), f"experts differ in rows {rows.nonzero().flatten().tolist()}: {index[rows].tolist()} vs " \
                           f"{want_i[rows].tolist()}; logits {logits[rows].float().tolist()}"
    tol = 1e-5 if scores_float else {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}[x.dtype]
    torch.testing.assert_close(scores.float(), want_s.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{t}E{e}H{h}k{k}" for t, e, h, k in SHAPES])
def test_kernel_matches_the_reference_selection(shape, dtype, kernel_only):
    t, e, h, k = shape  # passes of 8 tokens too: the kernel at every count
    g = torch.Generator(device="cpu").manual_seed(t * 1000003 + e * 1009 + h)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    w = (torch.randn(e, h, generator=g) * h**-0.5).to(DEV, dtype)
    for normalize, scores_float in ((True, True), (True, False), (False, True), (False, False)):
        _check(x, w, k, normalize, scores_float, _op(x, w, k, normalize, scores_float))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_ties_go_to_the_lower_expert(dtype, kernel_only):
    e, h = 70, 64
    w = torch.zeros(e, h)
    w[[3, 40, 41, 69]] = 0.25  # four equal best experts
    w[[0, 7, 65]] = 0.125      # three equal next ones
    x = torch.ones(5, h)
    logits, scores, index = _op(x.to(DEV, dtype), w.to(DEV, dtype), 6, True, True)
    assert index.tolist() == [[3, 40, 41, 69, 0, 7]] * 5
    _check(x.to(DEV, dtype), w.to(DEV, dtype), 6, True, True, (logits, scores, index))
    # equal best experts held by one lane (5, 37, 69, 101: lane 5's four), listed back to front
    w = torch.zeros(128, h)
    w[[101, 69, 37, 5]] = 0.25
    _, _, index = _op(torch.ones(1, h, device=DEV, dtype=dtype), w.to(DEV, dtype), 4, True, True)
    assert index.tolist() == [[5, 37, 69, 101]]
    # every logit equal: the first k experts
    _, _, index = _op(torch.zeros(2, h, device=DEV, dtype=dtype), w.to(DEV, dtype), 8, False, True)
    assert index.tolist() == [list(range(8))] * 2


def test_sizes_the_kernel_does_not_take_run_the_reference():
    g = torch.Generator(device="cpu").manual_seed(5)
    cases = [(tuning.ROUTER_MAX_TOKENS + 1, 64, 256, 4), (2, router.MAX_EXPERTS + 1, 64, 4), (2, 64, 260, 4), (2, 64, 256, 33)]
    for t, e, h, k in cases:
        x = torch.randn(t, h, generator=g).to(DEV, torch.bfloat16)
        w = torch.randn(e, h, generator=g).to(DEV, torch.bfloat16)
        got = _op(x, w, k, True, False)
        want = kbit_linear._router_ops.router_top_k_reference(x, w, k, True, False)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (t, e, h, k)


def test_many_launches_in_a_row_leave_the_counter_at_zero(kernel_only):
    # Each launch's last block resets the shared counter; if one did not, the next launch's
    # blocks would never see themselves as last and its outputs would stay NaN.
    g = torch.Generator(device="cpu").manual_seed(9)
    for i in range(40):
        t, e = 1 + i % 7, (5, 128, 33, 8)[i % 4]
        x = torch.randn(t, 1024, generator=g).to(DEV, torch.bfloat16)
        w = (torch.randn(e, 1024, generator=g) / 32).to(DEV, torch.bfloat16)  # logits ~ N(0, 1), as routers' are
        _check(x, w, min(e, 4), True, False, _op(x, w, min(e, 4), True, False))


def _captured(fn):
    """A CUDA graph of ``fn()`` and the outputs of the captured call: one call on a side stream
    first (compile, plan and allocate outside the capture), then the capture on that stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


def test_replays_in_a_cuda_graph(kernel_only):
    g = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(2, 2048, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(128, 2048, generator=g) * 0.02).to(DEV, torch.bfloat16)
    graph, out = _captured(lambda: torch.ops.kbit_linear.router_top_k(x, w, 8, True, False))
    for _ in range(3):
        x.copy_(torch.randn(2, 2048, generator=g).to(DEV, torch.bfloat16))
        for t in out:
            t.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        _check(x, w, 8, True, False, out)


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph"])
def test_behind_a_kernel_that_writes_x_and_lets_it_start_early(in_graph, kernel_only):
    # The router launches as a programmatic dependent. Here the kernel before it is the decode GEMM,
    # which writes x and lets its dependents start before it finishes; a router that read x too
    # early would give logits off F.linear of the x the GEMM wrote.
    torch.manual_seed(13)
    layer = kbit_linear.KbitLinear.from_linear(torch.nn.Linear(256, 2048, bias=False).to(DEV, torch.bfloat16), bits=4)
    w = (torch.randn(128, 2048, device=DEV) / 45).to(torch.bfloat16)
    xs = [torch.randn(1, 256, device=DEV, dtype=torch.bfloat16) for _ in range(24)]

    def calls():
        with torch.no_grad():
            return [(y, _op(y, w, 8, True, False)) for y in (layer(x) for x in xs)]

    old = loader.set_programmatic_launch(True)
    try:
        if not in_graph:
            for _ in range(3):
                for y, out in calls():
                    _check(y, w, 8, True, False, out)
            return
        graph, got = _captured(calls)
        for _ in range(3):
            for x in xs:
                x.copy_(torch.randn_like(x))
            for y, out in got:
                y.fill_(float("nan"))
                for t in out:
                    t.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            for y, out in got:
                _check(y, w, 8, True, False, out)
    finally:
        loader.set_programmatic_launch(old)


def _qwen3_moe(dtype=torch.bfloat16):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=256, intermediate_size=128, moe_intermediate_size=64,
                                      head_dim=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=64, num_experts_per_tok=8, norm_topk_prob=True)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(DEV, dtype).eval()


def test_a_fused_moe_model_runs_the_kernel_and_compiles():
    model = _qwen3_moe()
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(3, 256, device=DEV, dtype=torch.bfloat16)
    want = gate(x)
    summary = kbit_linear.fuse_routers(model)
    assert len(summary.fused) == 2, str(summary)
    got = gate(x)
    assert gate.router_normalize and not gate.router_scores_float
    _check(x, gate.weight, 8, True, False, got)
    # the same experts as transformers' router, up to swaps of experts within a rounding of each
    # other: the probabilities it chose, looked up at the kernel's choice
    probs = torch.softmax(want[0].float(), -1)
    torch.testing.assert_close(probs.gather(1, got[2]).sort(-1).values, probs.gather(1, want[2]).sort(-1).values,
                               rtol=2e-2, atol=1e-4)
    compiled = torch.compile(gate, fullgraph=True)
    for t in (1, 4):
        x = torch.randn(t, 256, device=DEV, dtype=torch.bfloat16)
        _check(x, gate.weight, 8, True, False, compiled(x))
    ids = torch.randint(0, 96, (1, 6), device=DEV)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_experts_with_underflowing_probabilities_are_picked_by_logit(kernel_only):
    # Row seen on an H200 when the kernel picked by probability: the fourth pick is among experts whose
    # probabilities are 1e-40..1e-44, which flush-to-zero made ties.
    logits = torch.tensor([[52.0, -48.0, -67.0, 13.875, -39.25, -44.75, 2.53125, -45.25]])
    x = torch.eye(8)[:1].repeat(2, 1).to(DEV, torch.bfloat16)  # row t of x @ w.T = column of w: w = logits^T
    w = logits.t().repeat(1, 8)[:, :8].contiguous().to(DEV, torch.bfloat16)
    got = _op(x, w, 4, True, False)
    assert got[2][0].tolist() == [0, 3, 6, 4]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_rows_with_nan_or_infinite_logits_are_the_references(dtype, kernel_only):
    # NaN scores (never a silent "no expert"), experts ordered as torch.sort orders the logits
    nan, inf = float("nan"), float("inf")
    rows = [([0.5, nan, 0.1, 0.2, -1.0], [1, 0, 3]), ([0.5, inf, 0.1, 0.2, -1.0], [1, 0, 3]), ([-inf] * 5, [0, 1, 2]),
            ([0.0, 0.0, 0.0, 0.0, 1.0], [4, 0, 1])]
    for row, want in rows:
        x = torch.zeros(1, 8, device=DEV, dtype=dtype)
        x[0, 0] = 1  # the logits are w's first column
        w = torch.zeros(5, 8)
        w[:, 0] = torch.tensor(row)
        logits, scores, index = _op(x, w.to(DEV, dtype), 3, True, True)
        assert index[0].tolist() == want, (row, index)
        if all(v == v and abs(v) != inf for v in row):
            probs = torch.softmax(logits.float(), -1)[0, want]
            torch.testing.assert_close(scores[0], probs / probs.sum())
        else:
            assert torch.isnan(scores).all(), (row, scores)
