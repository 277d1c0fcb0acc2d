"""KbitDecodeGraph.generate's end tokens and sampling (CPU, the eager schedule: use_graph=False):
rows that end give the pad token and the call stops once all have, sampling stays inside the
warpers' choices and repeats for a seed, and the defaults give the greedy tokens as before."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kbit_linear import KbitDecodeGraph, KbitKVCache
from kbit_linear.kv_cache import cache_keyword
from test_kv_cache import _tiny
from test_kv_replayable import _caches

STEPS = 48


@pytest.fixture(scope="module")
def model():
    return _tiny("llama")  # float32: no near-ties in the argmax


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (3, 30), generator=torch.Generator().manual_seed(2))


def _prefill(model, cache: KbitKVCache, prompt: torch.Tensor) -> torch.Tensor:
    """The prompt into ``cache``; its greedy next token ``[B, 1]``."""
    with torch.no_grad():
        return model(prompt, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)


def _decode(model, prompt: torch.Tensor, steps: int = STEPS, **kw) -> torch.Tensor:
    """``KbitDecodeGraph.generate`` without graphs on a fresh replayable cache holding ``prompt``."""
    _, cache = _caches(model)
    first = _prefill(model, cache, prompt)
    return KbitDecodeGraph(model, cache, use_graph=False).generate(first, steps, **kw)


def _reference(model, prompt: torch.Tensor, steps: int, eos: list[int] | None = None, pad: int = 0,
               fed: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Plain eager decoding with the default cache, one forward call a token: the greedy tokens
    (after an end token in ``eos``, ``pad``), never stopping early; or, with ``fed`` ``[B, n]``,
    those tokens fed back instead. Also each step's last logits."""
    cache, _ = _caches(model)
    ids = _prefill(model, cache, prompt)
    finished = torch.zeros_like(ids, dtype=torch.bool) if eos is None else torch.isin(ids, torch.tensor(eos))
    out, logits = [], []
    with torch.no_grad():
        for i in range(steps):
            step = model(ids, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
            logits.append(step)
            ids = step.argmax(-1, keepdim=True) if fed is None else fed[:, i:i + 1]
            if eos is not None:
                ids = torch.where(finished, pad, ids)
                finished |= torch.isin(ids, torch.tensor(eos))
            out.append(ids)
    return torch.cat(out, 1), logits


def _ends(tokens: torch.Tensor, eos: list[int]) -> list[int]:
    """Each row's first end token's column."""
    hits = torch.isin(tokens, torch.tensor(eos))
    assert hits.any(1).all()
    return hits.int().argmax(1).tolist()


def test_default_arguments_give_the_greedy_tokens(model, prompt: torch.Tensor) -> None:
    want, _ = _reference(model, prompt, STEPS)
    assert torch.equal(_decode(model, prompt), want)
    explicit = _decode(model, prompt, eos_token_id=None, pad_token_id=None, do_sample=False, temperature=1.0, top_k=None,
                       top_p=None)
    assert torch.equal(explicit, want)
    assert torch.equal(_decode(model, prompt, pad_token_id=5), want)  # a pad token alone changes nothing


def test_an_end_token_never_produced_changes_nothing(model, prompt: torch.Tensor) -> None:
    want, _ = _reference(model, prompt, STEPS)
    unused = sorted(set(range(128)) - set(want.flatten().tolist()))
    got = _decode(model, prompt, eos_token_id=unused[0], pad_token_id=0)
    assert torch.equal(got, want)


def test_rows_that_end_give_the_pad_token_and_the_call_stops_once_all_have(model, prompt: torch.Tensor) -> None:
    greedy, _ = _reference(model, prompt, STEPS)
    # an end token from each row at a different step (any of them ends any row)
    eos = [int(greedy[0, 2]), int(greedy[1, 9]), int(greedy[2, 17])]
    want, _ = _reference(model, prompt, STEPS, eos=eos, pad=0)
    ends = _ends(want, eos)
    assert len(set(ends)) > 1 and max(ends) <= 17, ends  # rows end at different steps
    _, cache = _caches(model)
    first = _prefill(model, cache, prompt)
    decoder = KbitDecodeGraph(model, cache, use_graph=False)
    got = decoder.generate(first, STEPS, eos_token_id=eos, pad_token_id=0)
    n = got.shape[1]
    # stops at the first check after the last end: the end of that epoch (at most block_size steps)
    assert max(ends) < n <= max(ends) + 1 + 8 < STEPS
    assert torch.equal(got, want[:, :n])
    for row, end in enumerate(ends):
        assert not got[row, end + 1:].any()  # pad after the end token
    assert cache.get_seq_length() == prompt.shape[1] + n  # the prompt, first and n - 1 tokens
    assert decoder.replays > 0  # ends inside replayed epochs are kept too


def test_the_pad_token_defaults_to_the_first_end_token(model, prompt: torch.Tensor) -> None:
    greedy, _ = _reference(model, prompt, STEPS)
    eos = [int(greedy[0, 4]), int(greedy[1, 6]), int(greedy[2, 8])]
    want, _ = _reference(model, prompt, STEPS, eos=eos, pad=eos[0])
    got = _decode(model, prompt, eos_token_id=eos)
    assert got.shape[1] < STEPS and torch.equal(got, want[:, :got.shape[1]])
    for row, end in enumerate(_ends(got, eos)):
        assert (got[row, end + 1:] == eos[0]).all()


def test_first_tokens_that_end_every_row_give_no_tokens(model, prompt: torch.Tensor) -> None:
    _, cache = _caches(model)
    first = _prefill(model, cache, prompt)
    length = cache.get_seq_length()
    got = KbitDecodeGraph(model, cache, use_graph=False).generate(first, STEPS, eos_token_id=first.flatten().tolist())
    assert got.shape == (3, 0) and got.dtype == torch.int64 and cache.get_seq_length() == length


def test_sampling_with_top_k_1_is_greedy(model, prompt: torch.Tensor) -> None:
    want, _ = _reference(model, prompt, STEPS)
    assert torch.equal(_decode(model, prompt, do_sample=True, top_k=1, temperature=3.0), want)


def test_sampling_repeats_for_a_seed_and_differs_from_greedy(model, prompt: torch.Tensor) -> None:
    greedy, _ = _reference(model, prompt, STEPS)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(_decode(model, prompt, do_sample=True, temperature=2.0))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], greedy) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.6), (8, 0.5)])
def test_sampled_tokens_are_among_the_warpers_choices(model, prompt: torch.Tensor, top_k, top_p) -> None:
    """Each sampled token has a finite score after transformers' warpers applied to the logits of
    the same step (computed again eagerly, the sampled tokens fed back)."""
    torch.manual_seed(0)
    got = _decode(model, prompt, do_sample=True, temperature=1.5, top_k=top_k, top_p=top_p)
    _, logits = _reference(model, prompt, STEPS, fed=got)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(1.5)])
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p else []
    chosen = torch.stack([warpers(None, step.float()).gather(1, got[:, i:i + 1])[:, 0] for i, step in enumerate(logits)], 1)
    assert torch.isfinite(chosen).all()
    assert len(set(got.flatten().tolist())) > 3  # not one token over and over


@pytest.mark.parametrize("kw, error, name", [
    ({"eos_token_id": -1}, ValueError, "eos_token_id"),
    ({"eos_token_id": []}, ValueError, "eos_token_id"),
    ({"eos_token_id": True}, ValueError, "eos_token_id"),
    ({"eos_token_id": "2"}, ValueError, "eos_token_id"),
    ({"eos_token_id": [1, 2.0]}, ValueError, "eos_token_id"),
    ({"eos_token_id": torch.tensor([1])}, ValueError, "eos_token_id"),
    ({"pad_token_id": -1}, ValueError, "pad_token_id"),
    ({"pad_token_id": 1.0}, ValueError, "pad_token_id"),
    ({"eos_token_id": 2, "pad_token_id": 128}, ValueError, "pad_token_id"),  # past the embedding
    ({"eos_token_id": [300, 2]}, ValueError, "pad_token_id"),  # the default pad token, past the embedding
    ({"do_sample": 1}, TypeError, "do_sample"),
    ({"do_sample": None}, TypeError, "do_sample"),
    ({"do_sample": True, "temperature": 0.0}, ValueError, "temperature"),
    ({"do_sample": True, "temperature": -1.0}, ValueError, "temperature"),
    ({"do_sample": True, "temperature": float("nan")}, ValueError, "temperature"),
    ({"do_sample": True, "temperature": float("inf")}, ValueError, "temperature"),
    ({"do_sample": True, "temperature": "1"}, ValueError, "temperature"),
    ({"do_sample": True, "top_k": 0}, ValueError, "top_k"),
    ({"do_sample": True, "top_k": 2.0}, ValueError, "top_k"),
    ({"do_sample": True, "top_k": True}, ValueError, "top_k"),
    ({"do_sample": True, "top_p": 0.0}, ValueError, "top_p"),
    ({"do_sample": True, "top_p": 1.5}, ValueError, "top_p"),
    ({"do_sample": True, "top_p": float("nan")}, ValueError, "top_p"),
    ({"temperature": 0.7}, ValueError, "temperature"),  # greedy would ignore them
    ({"top_k": 5}, ValueError, "top_k"),
    ({"top_p": 0.9}, ValueError, "top_p"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_bad_arguments_are_named_before_anything_runs(model, prompt: torch.Tensor, kw: dict, error: type, name: str) -> None:
    _, cache = _caches(model)
    first = _prefill(model, cache, prompt)
    length = cache.get_seq_length()
    with pytest.raises(error, match=name):
        KbitDecodeGraph(model, cache, use_graph=False).generate(first, 4, **kw)
    assert cache.get_seq_length() == length


def test_a_first_token_that_is_not_a_tensor_and_inductor_options_that_are_not_a_mapping_are_named(model, prompt) -> None:
    _, cache = _caches(model)
    _prefill(model, cache, prompt)
    with pytest.raises(ValueError, match="first must be an int64 tensor"):
        KbitDecodeGraph(model, cache, use_graph=False).generate([[8]] * prompt.shape[0], 3)
    with pytest.raises(TypeError, match=r"compile_options\['options'\] must be a mapping"):
        KbitDecodeGraph(model, cache, use_graph=False, compile_layers=True, compile_options={"options": "abc"})


@pytest.mark.parametrize("token", [-1, 128])
def test_a_first_token_outside_the_embedding_is_named(model, prompt: torch.Tensor, token: int) -> None:
    _, cache = _caches(model)
    first = _prefill(model, cache, prompt)
    first[1, 0] = token
    length = cache.get_seq_length()
    with pytest.raises(ValueError, match="first must hold token ids"):
        KbitDecodeGraph(model, cache, use_graph=False).generate(first, 4)
    assert cache.get_seq_length() == length
