"""Greedy or sampled decoding with a replayable :class:`~kbit_linear.KbitKVCache`, one CUDA graph per epoch.

A decode step over the quantized KV cache launches the same kernels with the same arguments
from one allocator run to the next (``KbitKVCache(..., replayable=True)``: the 8-bit tokens are
appended in place, the attention reads the live length on the device). So the step is captured
once per epoch and replayed, which removes the Python and launch time that an eager step spends
on the host:

    eager step (runs the allocator when due, opens the epoch's store)
    capture one step          (the cache's host state frozen: KbitKVCache.capturing)
    replay it n times          (n = KbitKVCache.replayable_steps(1), at most the tokens still wanted)
    KbitKVCache.advance(1, n)  (the host's side of the n steps)
    ... until the requested tokens are out, or every row has produced an end token.

The model is called with a static ``input_ids`` ``[B, 1]``, ``position_ids`` (and
``cache_position`` where the transformers version takes it) and no attention mask: causal decoding
of rows without padding, as ``KbitKVCache``'s in-place attention requires.

The token is picked inside the step, on the device, so that it is captured with it: the argmax,
or a sample (transformers' temperature, top-k and top-p warpers, then a draw without a host
sync); then end tokens: a device mask of the finished rows, which get the pad token. The host
reads that mask once after each eager step and after each epoch's replays, to stop early.

With ``compile_layers`` the decoder layers run compiled (``torch.compile``) while ``generate``
runs, so that a replay issues the compiled kernels in place of the eager model's many small ones;
the cache's update and attention stay eager, outside the compiled graphs.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .kv_cache import KbitKVCache, cache_keyword
from .kv_format import _check_positive_int

__all__ = ["KbitDecodeGraph"]


class _TokenPicker:
    """How one :meth:`KbitDecodeGraph.generate` call picks a step's token, on the device only: it
    runs inside the captured step, where nothing may be read back to the host.

    Args:
        warpers: temperature / top-k / top-p warpers to sample through, or ``None`` for greedy.
        eos: int64 ``[E]`` end tokens on the device, or ``None`` (no end tokens).
        pad: the token of a row after its end token.
        first: the call's first input ``[B, 1]``: a row whose ``first`` is an end token has ended.
    """

    def __init__(self, warpers: LogitsProcessorList | None, eos: torch.Tensor | None, pad: int,
                 first: torch.Tensor) -> None:
        self.warpers, self.eos, self.pad = warpers, eos, pad
        # bool [B, 1], updated in place by every step (a replay updates the captured buffer)
        self.finished = None if eos is None else (first == eos).any(dim=-1, keepdim=True)

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The next token ``[B, 1]`` from the last position's ``logits`` ``[B, V]`` (``ids``: the
        step's input, which the warpers are handed as transformers hands them the sequence)."""
        if self.warpers is None:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = self.warpers(ids, logits.float()).softmax(dim=-1)  # float32, as transformers samples
            # The exponential race: argmax(p / E), E ~ Exp(1) per token, draws from p without the host
            # checks of torch.multinomial. exponential_ may give 0: the floor keeps p / E finite.
            race = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
            token = (probs / race).argmax(dim=-1, keepdim=True)
        if self.finished is not None:
            token = torch.where(self.finished, self.pad, token)
            # a comparison with every end token, not torch.isin: isin sorts with a host sync for long lists
            self.finished |= (token == self.eos).any(dim=-1, keepdim=True)
        return token

    def all_finished(self) -> bool:
        """Whether every row has produced an end token (one host read; False without end tokens)."""
        return self.finished is not None and bool(self.finished.all())


def _token_ids(value: int | Sequence[int]) -> list[int]:
    """``eos_token_id`` as a list of ints >= 0, or a ValueError naming it."""
    ids = [value] if isinstance(value, int) else value
    if (isinstance(value, (bool, str, bytes)) or not isinstance(ids, Sequence) or not ids
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
        raise ValueError(f"eos_token_id must be an int >= 0 or a non-empty sequence of them, got {value!r}")
    return list(ids)


def _warpers(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList | None:
    """The sampling arguments checked, as transformers' warpers in its order (``None``: greedy).

    Raises:
        TypeError: ``do_sample`` is not a bool.
        ValueError: ``temperature``, ``top_k`` or ``top_p`` is out of its range, or set without
            ``do_sample``.
    """
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if not do_sample:
        given = [f"{name}={value!r}" for name, value, unset in
                (("temperature", temperature, 1.0), ("top_k", top_k, None), ("top_p", top_p, None)) if value != unset]
        if given:  # greedy decoding would ignore them: refuse rather than decode other than asked
            raise ValueError(f"{', '.join(given)} only take effect with do_sample=True")
        return None
    warpers = LogitsProcessorList()
    # the warpers transformers' generate builds, in its order; 1.0 leaves the scores as they are
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))
    return warpers


class KbitDecodeGraph:
    """Greedy or sampled decoding of ``model`` over a replayable ``cache``, replayed from CUDA graphs.

    Args:
        model: a transformers causal LM whose attention runs through ``cache`` (built with the
            model's config).
        cache: a ``KbitKVCache(..., replayable=True)`` that already holds the prompt.
        use_graph: capture and replay (needs CUDA); ``False`` runs the same schedule eagerly,
            each would-be replay as an eager step with the cache's host state frozen, so that the
            epoch bookkeeping can be checked anywhere (CPU included).
        compile_layers: while :meth:`generate` runs, the model's decoder layers
            (``model.model.layers``) are compiled with ``torch.compile`` (a replay then runs the
            compiled kernels, far fewer than the eager model's norms, rotary embedding and
            element-wise ops). The cache's update and attention stay eager (each breaks a layer's
            graph); the layer index is traced as an input where it can be, and torch's recompile
            limit is raised for the frames that need one variant per layer. The first
            :meth:`generate` compiles (seconds to a minute); the layers' own compiled state is
            restored when it returns.
        compile_options: keywords for ``torch.compile`` with ``compile_layers`` (``backend``,
            ``mode``, ``options``, ...). Modes that take CUDA graphs of their own
            (``"reduce-overhead"``, ``"max-autotune"``) cannot run inside this class's graphs.

    Example::

        cache = KbitKVCache(model.config, kv_bits=4, replayable=True)
        logits = model(input_ids=prompt, **{cache_keyword(model): cache}, use_cache=True).logits[:, -1]
        decoder = KbitDecodeGraph(model, cache)
        tokens = decoder.generate(logits.argmax(-1, keepdim=True), 256, eos_token_id=tokenizer.eos_token_id)
        # or sampled (torch's default generator: torch.manual_seed makes it repeatable)
        tokens = decoder.generate(first, 256, do_sample=True, temperature=0.7, top_p=0.9)

    Raises:
        TypeError: ``cache`` is not a :class:`~kbit_linear.KbitKVCache`.
        ValueError: the cache is not replayable or holds nothing yet, the model has sliding-window
            layers, or the prompt was padded; ``compile_layers`` for a model without
            ``model.model.layers``, or ``compile_options`` with a mode that takes CUDA graphs.
    """

    def __init__(self, model: torch.nn.Module, cache: KbitKVCache, use_graph: bool = True, compile_layers: bool = False,
                 compile_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(cache, KbitKVCache):
            raise TypeError(f"cache must be a KbitKVCache, got {type(cache).__name__}")
        if not cache.replayable:
            raise ValueError("cache must be built with KbitKVCache(..., replayable=True)")
        if cache.get_seq_length() == 0:
            raise ValueError("cache holds no tokens: run the prompt through the model first")
        if "sliding_attention" in cache.layer_types:
            # a step captured below the window would be replayed past it without the window's mask
            raise ValueError("KbitDecodeGraph decodes full-attention layers only; this model has sliding-window layers "
                             "(use model.generate with the cache)")
        first_valid = cache.layers[0].first_valid
        if first_valid is not None and (bool(first_valid.any()) or cache.layers[0]._rows_pending):
            raise ValueError("the prompt was left-padded; KbitDecodeGraph decodes rows without padding "
                             "(use model.generate with the cache)")
        if not isinstance(use_graph, bool):
            raise TypeError(f"use_graph must be a bool, got {use_graph!r}")
        if not isinstance(compile_layers, bool):
            raise TypeError(f"compile_layers must be a bool, got {compile_layers!r}")
        if compile_options is not None and not isinstance(compile_options, Mapping):
            raise TypeError(f"compile_options must be a mapping of torch.compile keywords, got {compile_options!r}")
        self._compile_options = dict(compile_options or {})
        try:
            inspect.signature(torch.compile).bind(None, **self._compile_options)
        except TypeError as e:
            raise TypeError(f"compile_options must be torch.compile's keywords: {e}") from None
        inductor_options = self._compile_options.get("options") or {}
        if not isinstance(inductor_options, Mapping):
            raise TypeError(f"compile_options['options'] must be a mapping of inductor options, got {inductor_options!r}")
        if (self._compile_options.get("mode") in ("reduce-overhead", "max-autotune")
                or inductor_options.get("triton.cudagraphs")):
            raise ValueError("compile_options: CUDA graphs of torch.compile's own (mode 'reduce-overhead' or "
                             "'max-autotune', or options triton.cudagraphs) cannot be captured inside "
                             "KbitDecodeGraph's; use mode 'default' or 'max-autotune-no-cudagraphs'")
        self._layers = _decoder_layers(model) if compile_layers else None
        self.model, self.cache, self.use_graph = model, cache, use_graph
        decoder = getattr(model, "model", model)
        self._takes_cache_position = "cache_position" in inspect.signature(decoder.forward).parameters
        self._cache_keyword = cache_keyword(model)
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_inputs: tuple = ()
        self._graph_current = False  # _graph belongs to the epoch still open
        self.captures = 0
        """CUDA graphs captured so far (one per epoch)."""
        self.replays = 0
        """Steps run as replays (or, without graphs, as frozen eager steps)."""

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step of the epoch still open after the last :meth:`generate` (its static
        inputs are kept with it), or None: before the first capture, without graphs, or when that
        call ended with an eager step (which may have opened a new epoch). Each replay runs one
        more step on the device only: the host's side (:meth:`KbitKVCache.advance`) is
        :meth:`generate`'s, so replays outside it are for timing what is left of the epoch
        (``cache.replayable_steps(1)`` of them at most), after which the cache is not to be used."""
        return self._graph if self._graph_current else None

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, cpos: torch.Tensor, pick: _TokenPicker) -> None:
        """One step on the static buffers: ``ids`` becomes the next token, the positions move on."""
        extra = {"cache_position": cpos} if self._takes_cache_position else {}
        extra[self._cache_keyword] = self.cache
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **extra)
        ids.copy_(pick(out.logits[:, -1, :], ids))
        pos.add_(1)
        cpos.add_(1)

    @torch.no_grad()
    def generate(self, first: torch.Tensor, steps: int, *, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
        """Up to ``steps`` tokens after ``first``, the token picked from the prompt: greedy, or
        sampled with ``do_sample``, until every row has produced an end token.

        Args:
            first: int64 ``[B, 1]`` on the model's device, not yet in the cache.
            steps: tokens to produce (``first`` is fed as the first step's input).
            eos_token_id: end token(s). A row that has produced one (``first`` included) gives
                ``pad_token_id`` from the next step on; the call stops once every row has (see
                Returns). The check is one host read after each eager step and after each epoch's
                replays, none inside the replays.
            pad_token_id: the token of a finished row, also fed back to the model as its next
                input; defaults to the first end token. Without ``eos_token_id`` it has no effect.
            do_sample: sample instead of taking the argmax: transformers' temperature, top-k and
                top-p warpers (in that order, on float32 logits), then a draw from the
                probabilities as an exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which
                needs no host sync. The draws come from torch's default generator of the cache's
                device: ``torch.manual_seed`` makes a run repeatable. Graph replays advance that
                generator per replay, so ``use_graph=True`` and ``False`` draw different tokens
                for the same seed. Nothing is checked on the host: a row whose probabilities are
                not finite (a NaN or +inf logit, or none above -inf) gets whatever token the argmax
                over NaNs gives, where ``torch.multinomial`` would fail.
            temperature: divides the logits before sampling; a finite number > 0.
            top_k: sample among the ``top_k`` most likely tokens only (ties with the last one
                kept); ``None``: all (``model.generate`` takes its generation config's 50).
            top_p: sample among the most likely tokens whose probabilities add up to ``top_p``
                (at least one), in ``(0, 1]``; ``None`` or 1: all.

        Returns:
            int64 ``[B, n]`` with ``n <= steps``: ``n < steps`` only when every row has produced an
            end token, the call then returning at the first check after that (an epoch's replays
            run to their end, so the last columns may be ``pad_token_id`` in every row). The
            cache holds ``first`` and the first ``n - 1`` tokens, as after a call for ``n``
            steps (nothing new when ``n`` is 0: every ``first`` an end token). A later call
            starts its finished rows from its own ``first`` only. With the defaults, the greedy
            tokens of the call without these arguments.

        Raises:
            ValueError: ``first`` is not ``[B, 1]`` int64 for the cache's batch on the cache's
                device or holds a token outside the input embedding, ``steps`` < 1,
                ``eos_token_id`` is not an int >= 0 or a non-empty sequence of them, ``pad_token_id`` is not an int >= 0 below the input
                embedding's size, ``temperature``, ``top_k`` or ``top_p`` is out of its range or
                given without ``do_sample``; with ``use_graph``, the cache is not on one CUDA
                device.
            TypeError: ``do_sample`` is not a bool.
            RuntimeError: an epoch's first replay did not move the cache's device length (the
                captured step recorded nothing), checked once an epoch.
        """
        _check_positive_int("steps", steps, 1)
        batch = self.cache.layers[0].batch
        if not isinstance(first, torch.Tensor) or first.dtype != torch.int64 or first.shape != (batch, 1):
            raise ValueError(f"first must be an int64 tensor [{batch}, 1], got "
                             f"{f'{first.dtype} {tuple(first.shape)}' if isinstance(first, torch.Tensor) else type(first).__name__}")
        warpers = _warpers(do_sample, temperature, top_k, top_p)
        eos = None if eos_token_id is None else _token_ids(eos_token_id)
        if pad_token_id is not None:
            _check_positive_int("pad_token_id", pad_token_id, 0)
        pad = pad_token_id if pad_token_id is not None else eos[0] if eos else 0
        vocab = getattr(self.model.get_input_embeddings(), "num_embeddings", None)
        if eos and vocab is not None and pad >= vocab:  # a finished row feeds the pad token to the embedding
            raise ValueError(f"pad_token_id (the first eos_token_id unless given) must be below the input embedding's "
                             f"{vocab} tokens, got {pad}")
        devices = {layer.device for layer in self.cache.layers}
        if self.use_graph and (len(devices) != 1 or next(iter(devices)).type != "cuda"):
            # one graph records one device's stream: a model split over GPUs cannot be captured whole
            raise ValueError(f"use_graph=True needs the cache on one CUDA device, got {sorted(map(str, devices))}; "
                             "use_graph=False runs the same steps eagerly")
        if first.device not in devices:
            raise ValueError(f"first must be on the cache's device, got {first.device}")
        # one host read (first is on the cache's device by now): a token outside the embedding fails deep in the model (on CUDA, a device-side assert)
        low, high = (int(v) for v in first.aminmax())
        if low < 0 or (vocab is not None and high >= vocab):
            raise ValueError(f"first must hold token ids in [0, {vocab if vocab is not None else 'vocab'}), "
                             f"got {low if low < 0 else high}")
        # kernels and the capture run on the current device's stream: make it the cache's device
        with torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext(), self._compiled():
            eos_ids = None if eos is None else torch.tensor(eos, dtype=torch.int64, device=first.device)
            return self._generate(first, steps, batch, _TokenPicker(warpers, eos_ids, pad, first))

    @contextlib.contextmanager
    def _compiled(self) -> Iterator[None]:
        """The decoder layers compiled (``compile_layers``) for the duration, their previous
        compiled state (none, or the user's ``layer.compile()``) restored afterwards."""
        if self._layers is None:
            yield
            return
        saved = [layer._compiled_call_impl for layer in self._layers]
        try:
            # Integer attributes (the layer index) traced as inputs, so that the layers share their
            # graphs; but the attention's own frame hands the index to the cache's (eager) update,
            # which specialises it there: one variant of that frame per layer (the same graph,
            # which inductor's cache serves), and module hooks (fused projections) add one per
            # layer too. Past torch's recompile limit the rest of the layers would run eagerly.
            limit = len(self._layers) + 8
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True,
                                            recompile_limit=max(torch._dynamo.config.recompile_limit, limit),
                                            accumulated_recompile_limit=max(torch._dynamo.config.accumulated_recompile_limit,
                                                                            8 * limit)):
                for layer in self._layers:
                    layer.compile(**self._compile_options)
                yield
        finally:
            for layer, impl in zip(self._layers, saved):
                layer._compiled_call_impl = impl

    def _generate(self, first: torch.Tensor, steps: int, batch: int, pick: _TokenPicker) -> torch.Tensor:
        """:meth:`generate` past its checks, on the current device."""
        ids = first.clone()
        length = self.cache.get_seq_length()
        pos = torch.full((batch, 1), length, dtype=torch.int64, device=ids.device)
        cpos = torch.full((1,), length, dtype=torch.int64, device=ids.device)
        out = torch.empty((batch, steps), dtype=torch.int64, device=ids.device)
        done = 0
        # The finished rows are read on the host only here, between eager steps and epochs (never
        # without end tokens): a replayed epoch runs to its end.
        finished = pick.all_finished()  # every first token an end token: nothing to decode
        while done < steps and not finished:
            self._step(ids, pos, cpos, pick)  # eager: the allocator runs here when due, and the epoch's store opens
            self._graph_current = False  # this step may have opened a new epoch
            out[:, done] = ids[:, 0]
            done += 1
            n = min(self.cache.replayable_steps(1), steps - done)
            finished = pick.all_finished()
            if n == 0 or finished:
                continue
            ran = 0
            try:
                if self.use_graph:
                    # The previous epoch's graph is dropped only once this one is captured: graphs that
                    # share a memory pool must keep it in use while another is captured into it.
                    self._graph = self._capture(ids, pos, cpos, pick)
                    self._graph_inputs = (ids, pos, cpos, pick)  # what the graph reads and writes, kept with it
                    self.captures += 1
                    for i in range(n):
                        self._graph.replay()
                        if i == 0:
                            self._check_first_replay()
                        ran += 1
                        out[:, done + i] = ids[:, 0]
                    self._graph_current = True
                else:
                    for i in range(n):
                        with self.cache.capturing():
                            self._step(ids, pos, cpos, pick)
                        ran += 1
                        out[:, done + i] = ids[:, 0]
            finally:
                # the host's side of the steps that ran, also when a later one raised (an interrupt):
                # the cache stays usable
                if ran:
                    self.cache.advance(1, ran)
                    self.replays += ran
            done += n
            finished = pick.all_finished()
        return out if done == steps else out[:, :done].clone()

    def _check_first_replay(self) -> None:
        """One host read an epoch: the first replay moved the device's length one token past the
        host's, or the capture recorded nothing (an empty graph replays as a no-op, and the
        epoch's tokens would all repeat the last eager step's)."""
        layer = self.cache.layers[0]
        length = int(layer.device_seq_len[0])
        if length != layer.seq_len + 1:
            raise RuntimeError(f"the captured decode step did not run on replay (device length {length}, "
                               f"expected {layer.seq_len + 1}): the CUDA graph recorded nothing (captured on a stream "
                               "of another device?)")

    def _capture(self, ids: torch.Tensor, pos: torch.Tensor, cpos: torch.Tensor, pick: _TokenPicker) -> torch.cuda.CUDAGraph:
        """One step captured with the cache's host state frozen (nothing runs until a replay)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            # Our own capture stream on the cache's device: torch.cuda.graph's default one is made
            # once per process, on the device current at its first capture, and a capture for
            # another device on it records nothing (the kernels run on that device's own stream).
            self._stream = torch.cuda.Stream(device=ids.device)
        graph = torch.cuda.CUDAGraph()
        with self.cache.capturing(), torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            self._step(ids, pos, cpos, pick)
        return graph


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """``model.model.layers`` (transformers' decoder-only layout), or a ValueError saying it is missing."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"compile_layers=True needs the decoder layers at model.model.layers; {type(model).__name__} has none")
    return layers
