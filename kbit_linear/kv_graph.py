"""Greedy decoding with a replayable :class:`~kbit_linear.KbitKVCache`, one CUDA graph per epoch.

A decode step over the quantized KV cache launches the same kernels with the same arguments
from one allocator run to the next (``KbitKVCache(..., replayable=True)``: the 8-bit tokens are
appended in place, the attention reads the live length on the device). So the step is captured
once per epoch and replayed, which removes the Python and launch time that an eager step spends
on the host:

    eager step (runs the allocator when due, opens the epoch's store)
    capture one step          (the cache's host state frozen: KbitKVCache.capturing)
    replay it n times          (n = KbitKVCache.replayable_steps(1), at most the tokens still wanted)
    KbitKVCache.advance(1, n)  (the host's side of the n steps)
    ... until the requested tokens are out.

The model is called with a static ``input_ids`` ``[B, 1]``, ``position_ids`` (and
``cache_position`` where the transformers version takes it) and no attention mask: causal decoding
of rows without padding, as ``KbitKVCache``'s in-place attention requires.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .kv_cache import KbitKVCache

__all__ = ["KbitDecodeGraph"]


class KbitDecodeGraph:
    """Greedy decoding of ``model`` over a replayable ``cache``, replayed from CUDA graphs.

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
            graph), and the layer index is traced as an input, so that every layer shares the same
            graphs. The first :meth:`generate` compiles (seconds); the layers' own compiled state
            is restored when it returns.
        compile_options: keywords for ``torch.compile`` with ``compile_layers`` (``backend``,
            ``mode``, ``options``, ...). Modes that take CUDA graphs of their own
            (``"reduce-overhead"``, ``"max-autotune"``) cannot run inside this class's graphs.

    Example::

        cache = KbitKVCache(model.config, kv_bits=4, replayable=True)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        tokens = KbitDecodeGraph(model, cache).generate(logits.argmax(-1, keepdim=True), 256)

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
        if first_valid is not None and bool(first_valid.any()):
            raise ValueError("the prompt was left-padded; KbitDecodeGraph decodes rows without padding "
                             "(use model.generate with the cache)")
        if not isinstance(use_graph, bool):
            raise TypeError(f"use_graph must be a bool, got {use_graph!r}")
        if not isinstance(compile_layers, bool):
            raise TypeError(f"compile_layers must be a bool, got {compile_layers!r}")
        if compile_options is not None and not isinstance(compile_options, Mapping):
            raise TypeError(f"compile_options must be a mapping of torch.compile keywords, got {compile_options!r}")
        self._compile_options = dict(compile_options or {})
        if self._compile_options.get("mode") in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"compile_options: mode {self._compile_options['mode']!r} takes CUDA graphs of its own, which "
                             "cannot be captured inside KbitDecodeGraph's; use 'default' or 'max-autotune-no-cudagraphs'")
        self._layers = _decoder_layers(model) if compile_layers else None
        self.model, self.cache, self.use_graph = model, cache, use_graph
        decoder = getattr(model, "model", model)
        self._takes_cache_position = "cache_position" in inspect.signature(decoder.forward).parameters
        self._pool = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        """CUDA graphs captured so far (one per epoch)."""
        self.replays = 0
        """Steps run as replays (or, without graphs, as frozen eager steps)."""

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The last epoch's captured step (None before the first capture or without graphs). Each
        replay runs one more step on the device only: the host's side (:meth:`KbitKVCache.advance`)
        is :meth:`generate`'s, so replays outside it are for timing what is left of the epoch
        (``cache.replayable_steps(1)`` of them at most)."""
        return self._graph

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, cpos: torch.Tensor) -> None:
        """One greedy step on the static buffers: ``ids`` becomes the next token, the positions move on."""
        extra = {"cache_position": cpos} if self._takes_cache_position else {}
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, logits_to_keep=1, **extra)
        ids.copy_(out.logits[:, -1, :].argmax(dim=-1, keepdim=True))
        pos.add_(1)
        cpos.add_(1)

    @torch.no_grad()
    def generate(self, first: torch.Tensor, steps: int) -> torch.Tensor:
        """``steps`` greedy tokens after ``first``, the token picked from the prompt.

        Args:
            first: int64 ``[B, 1]`` on the model's device, not yet in the cache.
            steps: tokens to produce (``first`` is fed as the first step's input).

        Returns:
            int64 ``[B, steps]``.

        Raises:
            ValueError: ``first`` is not ``[B, 1]`` int64 for the cache's batch on the cache's
                device, or ``steps`` < 1; with ``use_graph``, the cache is not on one CUDA device.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        batch = self.cache.layers[0].batch
        if first.dtype != torch.int64 or first.shape != (batch, 1):
            raise ValueError(f"first must be int64 [{batch}, 1], got {first.dtype} {tuple(first.shape)}")
        devices = {layer.device for layer in self.cache.layers}
        if self.use_graph and (len(devices) != 1 or next(iter(devices)).type != "cuda"):
            # one graph records one device's stream: a model split over GPUs cannot be captured whole
            raise ValueError(f"use_graph=True needs the cache on one CUDA device, got {sorted(map(str, devices))}; "
                             "use_graph=False runs the same steps eagerly")
        if first.device not in devices:
            raise ValueError(f"first must be on the cache's device, got {first.device}")
        # kernels and the capture run on the current device's stream: make it the cache's device
        with torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext(), self._compiled():
            return self._generate(first, steps, batch)

    @contextlib.contextmanager
    def _compiled(self) -> Iterator[None]:
        """The decoder layers compiled (``compile_layers``) for the duration, their previous
        compiled state (none, or the user's ``layer.compile()``) restored afterwards."""
        if self._layers is None:
            yield
            return
        saved = [layer._compiled_call_impl for layer in self._layers]
        try:
            # Integer attributes (the layer index) traced as inputs: one set of graphs for every
            # layer, where specialising them would compile each layer apart and soon pass torch's
            # recompile limit.
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
                for layer in self._layers:
                    layer.compile(**self._compile_options)
                yield
        finally:
            for layer, impl in zip(self._layers, saved):
                layer._compiled_call_impl = impl

    def _generate(self, first: torch.Tensor, steps: int, batch: int) -> torch.Tensor:
        """:meth:`generate` past its checks, on the current device."""
        ids = first.clone()
        length = self.cache.get_seq_length()
        pos = torch.full((batch, 1), length, dtype=torch.int64, device=ids.device)
        cpos = torch.full((1,), length, dtype=torch.int64, device=ids.device)
        out = torch.empty((batch, steps), dtype=torch.int64, device=ids.device)
        done = 0
        while done < steps:
            self._step(ids, pos, cpos)  # eager: the allocator runs here when due, and the epoch's store opens
            out[:, done] = ids[:, 0]
            done += 1
            n = min(self.cache.replayable_steps(1), steps - done)
            if n == 0:
                continue
            if self.use_graph:
                # The previous epoch's graph is dropped only once this one is captured: graphs that
                # share a memory pool must keep it in use while another is captured into it.
                self._graph = self._capture(ids, pos, cpos)
                for i in range(n):
                    self._graph.replay()
                    out[:, done + i] = ids[:, 0]
                self.captures += 1
            else:
                for i in range(n):
                    with self.cache.capturing():
                        self._step(ids, pos, cpos)
                    out[:, done + i] = ids[:, 0]
            self.cache.advance(1, n)
            self.replays += n
            done += n
        return out

    def _capture(self, ids: torch.Tensor, pos: torch.Tensor, cpos: torch.Tensor) -> torch.cuda.CUDAGraph:
        """One step captured with the cache's host state frozen (nothing runs until a replay)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with self.cache.capturing(), torch.cuda.graph(graph, pool=self._pool):
            self._step(ids, pos, cpos)
        return graph


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """``model.model.layers`` (transformers' decoder-only layout), or a ValueError saying it is missing."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"compile_layers=True needs the decoder layers at model.model.layers; {type(model).__name__} has none")
    return layers
