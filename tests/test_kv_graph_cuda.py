"""KbitDecodeGraph on a GPU: decode steps captured once per epoch and replayed give the tokens and
the cache of the same schedule run eagerly (the replay reads the length and call counter on the
device; nothing on the host changes between the replays)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kbit_linear import KbitDecodeGraph, KbitKVCache
from kbit_linear.kv_cache import cache_keyword
from kbit_linear.kv_format import TIERS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval().to(device, dtype)


def _run(model, use_graph: bool, prompt: torch.Tensor, steps: int, **decoder_kw):
    cache = KbitKVCache(model.config, kv_bits=3, window=8, sink_tokens=2, block_size=16, mass_interval=2, replayable=True)
    with torch.no_grad():
        first = model(prompt, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    decoder = KbitDecodeGraph(model, cache, use_graph=use_graph, **decoder_kw)
    head = decoder.generate(first, steps - 40)
    tail = decoder.generate(head[:, -1:], 40)  # a second call captures into the same memory pool
    return torch.cat([head, tail], 1), cache, decoder


@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_steps_equal_the_eager_schedule(batch: int) -> None:
    model = _model()
    prompt = torch.randint(3, 128, (batch, 200), device="cuda", generator=torch.Generator(device="cuda").manual_seed(batch))
    eager, eager_cache, _ = _run(model, False, prompt, 120)
    graph, graph_cache, decoder = _run(model, True, prompt, 120)
    assert decoder.captures >= 3 and decoder.replays > 100
    assert torch.equal(graph, eager)
    for a, b in zip(eager_cache.layers, graph_cache.layers):
        assert (a.seq_len, a._decode_calls) == (b.seq_len, b._decode_calls)
        assert b.device_seq_len.tolist() == [b.seq_len] and b.device_decode_calls.tolist() == [b._decode_calls]
        for name in ("tier", "mass", "seen"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for t in TIERS:
            assert a.buckets[t].num_tokens == b.buckets[t].num_tokens, t


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_replays_on_the_second_gpu_while_the_first_is_current() -> None:
    """The capture and the kernels follow the cache's device, not the current one."""
    model = _model("cuda:1")
    prompt = torch.randint(3, 128, (2, 200), device="cuda:1", generator=torch.Generator(device="cuda:1").manual_seed(7))
    with torch.cuda.device(0):
        eager, _, _ = _run(model, False, prompt, 100)
        graph, _, decoder = _run(model, True, prompt, 100)
    assert decoder.captures >= 2 and torch.equal(graph, eager) and graph.device == torch.device("cuda:1")


def test_replays_of_compiled_layers_equal_the_same_layers_run_eagerly() -> None:
    """compile_layers: the compiled layers captured and replayed give the tokens of the same
    compiled layers run step by step (inductor's kernels round as they round; the graph adds nothing)."""
    torch._dynamo.reset()
    model = _model()
    prompt = torch.randint(3, 128, (2, 200), device="cuda", generator=torch.Generator(device="cuda").manual_seed(11))
    eager, _, _ = _run(model, False, prompt, 100, compile_layers=True)
    graph, _, decoder = _run(model, True, prompt, 100, compile_layers=True)
    assert decoder.captures >= 2 and torch.equal(graph, eager)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    torch._dynamo.reset()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("compile_layers", [False, True])
def test_captures_on_cuda0_after_torch_made_its_capture_stream_on_cuda1(compile_layers: bool) -> None:
    """torch.cuda.graph's default capture stream is made once per process, on the device current at
    the first capture; KbitDecodeGraph captures on a stream of its own (a capture on another
    device's stream records nothing: found on two H200s, after a decode on cuda:1)."""
    saved = torch.cuda.graphs.graph.default_capture_stream
    with torch.cuda.device(1):
        torch.cuda.graphs.graph.default_capture_stream = torch.cuda.Stream()
    torch._dynamo.reset()
    try:
        model = _model()
        prompt = torch.randint(3, 128, (2, 200), device="cuda:0", generator=torch.Generator(device="cuda:0").manual_seed(11))
        graph, _, decoder = _run(model, True, prompt, 100, compile_layers=compile_layers)
        eager, _, _ = _run(model, False, prompt, 100, compile_layers=compile_layers)
    finally:
        torch.cuda.graphs.graph.default_capture_stream = saved
        torch._dynamo.reset()
    assert decoder.captures >= 2 and torch.equal(graph, eager)


def _decode(model, prompt: torch.Tensor, steps: int, use_graph: bool, **kw) -> tuple[torch.Tensor, KbitDecodeGraph]:
    """One ``generate`` call on a fresh replayable cache holding ``prompt``: ``first`` and the tokens."""
    cache = KbitKVCache(model.config, kv_bits=3, window=8, sink_tokens=2, block_size=16, mass_interval=2, replayable=True)
    with torch.no_grad():
        first = model(prompt, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    decoder = KbitDecodeGraph(model, cache, use_graph=use_graph)
    return torch.cat([first, decoder.generate(first, steps, **kw)], 1), decoder


def test_replayed_sampling_runs_in_the_graph() -> None:
    """Sampling (the warpers, the exponential race, end tokens) is captured and replayed: top_k=1
    gives the greedy tokens, and a seed repeats a run."""
    model = _model(dtype=torch.float32)  # float32: no near-ties in the argmax
    prompt = torch.randint(3, 128, (3, 100), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    greedy, _ = _decode(model, prompt, 80, True)
    top1, decoder = _decode(model, prompt, 80, True, do_sample=True, top_k=1, top_p=0.9, temperature=2.0)
    assert decoder.captures >= 3 and torch.equal(top1, greedy)
    runs = []
    for seed in (3, 3):
        torch.manual_seed(seed)
        runs.append(_decode(model, prompt, 80, True, do_sample=True, temperature=2.0, eos_token_id=127)[0])
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], greedy)


def test_replayed_end_tokens_stop_and_pad_as_the_eager_schedule() -> None:
    model = _model(dtype=torch.float32)
    prompt = torch.randint(3, 128, (3, 100), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    greedy, _ = _decode(model, prompt, 120, True)
    eos = [int(greedy[0, 6]), int(greedy[1, 31]), int(greedy[2, 51])]  # rows end at different steps
    eager, _ = _decode(model, prompt, 120, False, eos_token_id=eos, pad_token_id=0)
    graph, decoder = _decode(model, prompt, 120, True, eos_token_id=eos, pad_token_id=0)
    assert decoder.replays > 0 and torch.equal(graph, eager) and graph.shape[1] < 1 + 120
    hits = torch.isin(graph, torch.tensor(eos, device="cuda"))  # first included: it may end a row already
    assert hits.any(1).all()
    for row, end in enumerate(hits.int().argmax(1).tolist()):
        assert torch.equal(graph[row, :end + 1], greedy[row, :end + 1]) and not graph[row, end + 1:].any()
