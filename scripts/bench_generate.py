"""End-to-end decode benchmark on a Llama-3-8B-shaped model with random weights (no download).

``--arch qwen3-30b-a3b`` takes a Qwen3-30B-A3B-shaped mixture-of-experts model instead (hidden
2048, 128 experts of 768 with 8 per token, 32/4 heads of 128, vocab 151936; ``--layers`` of its 48),
so the kbit rows run ``KbitExperts``; ``--arch mixtral-8x7b`` a Mixtral-8x7B-shaped one (hidden 4096, 8
experts of 14336 with 2 per token, 32/8 heads of 128, vocab 32000; ``--layers`` of its 32).

For each model variant (bf16; kbit K = 2..5 through ``kbit_linear.quantize_model``; bitsandbytes
NF4 when it imports) and batch size, a prompt of ``--prompt`` random tokens is prefilled and
``--decode`` tokens are generated greedily, in two modes:

* ``eager``: Hugging Face ``generate`` (dynamic cache). Each decode step launches ~1000 kernels
  from Python, so on a fast GPU this mode measures mostly the CPU.
* ``compiled``: a gpt-fast style loop: the prompt is prefilled eagerly into a ``StaticCache``,
  then one decode step (model forward + greedy pick) compiled with
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` is called per token, with
  ``torch.compiler.cudagraph_mark_step_begin()`` before each call, so every step replays one
  CUDA graph. (``generate(cache_implementation="static")`` is not used: it re-records graphs.)
  The decoder layer's ``forward`` is marked ``torch.compiler.nested_compile_region`` so the 32
  identical layers are traced and compiled once (``--no-regions`` traces all 32): the graph and
  the CUDA graph still cover the whole step, and compiling takes seconds instead of ~35 s per
  model and batch.

Reported per (variant, mode, batch): decode tokens/s (all sequences together) and ms per step,
time to first token (prefill + first pick), peak GPU memory during the run, the model's bytes,
and, for the compiled mode, the time spent compiling and recording. A floor per step is given
from the measured device-to-device copy bandwidth: (bytes of every weight read per step + the KV
cache) / bandwidth.

The model is built directly on the GPU in bf16 (same seed for every variant) and quantized in
place, layer by layer, so the full-precision copy never has to exist twice. ``lm_head`` stays
bf16 in every variant but ``kbit4-fused-head`` (everything at 4 bits, ``lm_head`` too, as
``quantize_model(skip=[])`` gives it).

The ``--json`` / ``--md`` / ``--plot`` files are rewritten (atomically) after every finished row,
so a run cut short still leaves all rows measured so far; until the last row is done the markdown
says "partial: N of M rows" at the top and the JSON has ``progress.complete`` False.

Usage::

    python3 scripts/bench_generate.py --json out.json --plot out.png --md out.md
    python3 scripts/bench_generate.py --quick
    python3 scripts/bench_generate.py --models bf16 kbit4 --batches 1 --modes compiled
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above)

from kbit_linear.kv_cache import cache_keyword, output_cache  # noqa: E402  (the repository is on the path after _bench_common)

MODELS = ["bf16", "kbit2", "kbit3", "kbit4", "kbit5", "kbit4-fused", "kbit4-fused-head", "bnb-nf4"]
QUICK_MODELS = ["bf16", "kbit4"]
SKIP = ["lm_head"]


def llama3_8b_config(layers: int = 32) -> Any:
    """A Llama-3-8B-shaped ``LlamaConfig`` (hidden 4096, MLP 14336, 32/8 heads, vocab 128256)."""
    from transformers import LlamaConfig

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    )


def qwen3_moe_config(layers: int = 48) -> Any:
    """A Qwen3-30B-A3B-shaped ``Qwen3MoeConfig`` (hidden 2048, 128 experts of 768, top 8, 32/4 heads
    of 128, vocab 151936)."""
    from transformers import Qwen3MoeConfig

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    config = Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )
    # the bf16 experts take transformers' grouped_mm path (no host sync: it compiles whole)
    config._experts_implementation = "grouped_mm"
    return config


def mixtral_config(layers: int = 32) -> Any:
    """A Mixtral-8x7B-shaped ``MixtralConfig`` (hidden 4096, 8 experts of 14336, top 2, 32/8 heads of
    128, vocab 32000)."""
    from transformers import MixtralConfig

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    config = MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False,
    )
    config._experts_implementation = "grouped_mm"  # as for Qwen3 above
    return config


ARCHS = {"llama3-8b": llama3_8b_config, "qwen3-30b-a3b": qwen3_moe_config, "mixtral-8x7b": mixtral_config}
ARCH_TEXT = {
    "llama3-8b": "Llama-3-8B-shaped model ({layers} layers, hidden 4096, MLP 14336, 32/8 heads, vocab 128256)",
    "qwen3-30b-a3b": "Qwen3-30B-A3B-shaped MoE model ({layers} layers, hidden 2048, 128 experts of 768, top 8, 32/4 heads "
                     "of 128, vocab 151936)",
    "mixtral-8x7b": "Mixtral-8x7B-shaped MoE model ({layers} layers, hidden 4096, 8 experts of 14336, top 2, 32/8 heads "
                    "of 128, vocab 32000)",
}


# ---------------------------------------------------------------------------------------
# building the variants
# ---------------------------------------------------------------------------------------


def build_bf16(config: Any, device: torch.device, seed: int = 0, attn: str | None = None) -> nn.Module:
    """The random bf16 model, allocated and initialised on ``device``.

    ``attn``: transformers' attention implementation (``"sdpa"``, ``"flex_attention"``, ...;
    None: transformers' default).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **kwargs)
    return model.eval().requires_grad_(False)


def quantize_bnb(model: nn.Module, bnb: Any, skip: list[str]) -> nn.Module:
    """Replace every ``nn.Linear`` (except ``skip``) by bitsandbytes NF4 (blocksize 64, bf16 compute).

    The bf16 weight of each layer is freed as soon as its NF4 copy exists.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or name in skip:
                continue
            dev = child.weight.device
            q = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None, compute_dtype=torch.bfloat16,
                compress_statistics=False, quant_type="nf4", device="meta",
            )
            q.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, blocksize=64, compress_statistics=False, quant_type="nf4", module=q,
            ).to(dev)
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, q)
            del child
    return model


def quantize_kbit(model: nn.Module, bits: int, skip: list[str], fuse: bool = False) -> nn.Module:
    """kbit_linear's own model patcher, in place (``fuse``: q/k/v and gate/up as one GEMM each)."""
    quantize_model = bc.kbit_api("quantize_model")
    kwargs: dict[str, Any] = {"bits": bits, "skip": skip}
    if fuse:
        kwargs["fuse"] = True
    if "progress" in inspect.signature(quantize_model).parameters:
        kwargs["progress"] = False
    out = quantize_model(model, **kwargs)
    return out if isinstance(out, nn.Module) else model


def build_variant(name: str, config: Any, device: torch.device, libs: dict[str, Any], attn: str | None = None) -> nn.Module:
    """The model for variant ``name`` (one of ``MODELS``), with attention implementation ``attn``."""
    model = build_bf16(config, device, attn=attn)
    if name.startswith("kbit"):
        quantize_kbit(model, int(name[4]), [] if name.endswith("-head") else SKIP, fuse="-fused" in name)
    elif name == "bnb-nf4":
        quantize_bnb(model, libs["bitsandbytes"], SKIP)
    elif name != "bf16":
        raise ValueError(f"unknown model variant {name!r}; expected one of {MODELS}")
    gc.collect()
    torch.cuda.empty_cache()
    return model


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the model: total, the part not read by a decode step (the embedding), and the
    MoE experts modules' (classes named ``*Experts``: transformers' and ``KbitExperts``), of which
    a step reads only the experts its tokens are routed to.

    bitsandbytes keeps its absmax outside the parameters; it is counted too.
    """
    total = sum(bc.tensor_bytes(t) for t in model.parameters()) + sum(bc.tensor_bytes(t) for t in model.buffers())
    experts = 0
    for mod in model.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is not None and getattr(qs, "absmax", None) is not None:
            total += bc.tensor_bytes(qs.absmax)
        if type(mod).__name__.endswith("Experts"):
            experts += sum(bc.tensor_bytes(t) for t in (*mod.parameters(), *mod.buffers()))
    emb = model.get_input_embeddings()
    return {"total": total, "embedding": bc.tensor_bytes(emb.weight), "experts": experts}


def expert_hit_share(config: Any, batch: int) -> float:
    """Expected share of a MoE layer's experts that ``batch`` tokens hit when each picks
    ``num_experts_per_tok`` of the ``E`` experts uniformly: ``1 - (1 - k / E) ** batch`` (1 for
    dense models)."""
    e = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    k = getattr(config, "num_experts_per_tok", None)
    if not e or not k:
        return 1.0
    return 1.0 - (1.0 - k / e) ** batch


# ---------------------------------------------------------------------------------------
# the two modes
# ---------------------------------------------------------------------------------------


class _StepClock:
    """A logits processor that records a synchronized timestamp each time a token is picked."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return scores


def run_eager(model: nn.Module, prompt: torch.Tensor, decode: int) -> dict[str, Any]:
    """HF ``generate`` (greedy, exactly ``decode`` new tokens); TTFT and decode rate from step stamps."""
    from transformers import LogitsProcessorList

    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    clock = _StepClock()
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=decode, min_new_tokens=decode,
                         logits_processor=LogitsProcessorList([clock]), **kw)
    torch.cuda.synchronize()
    if out.shape[1] != prompt.shape[1] + decode:
        raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} tokens, expected {decode}")
    s = clock.stamps
    step_s = (s[-1] - s[0]) / (len(s) - 1)
    return {"ttft_ms": 1e3 * (s[0] - t0), "ms_per_step": 1e3 * step_s, "tok_s": prompt.shape[0] / step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "tokens": out[:, prompt.shape[1]:].cpu()}


_ORIGINAL_FORWARD: dict[type, Callable[..., Any]] = {}


def mark_layer_regions(model: nn.Module, enable: bool) -> None:
    """Mark (or unmark) the decoder layer class's ``forward`` as a nested compile region.

    In eager mode the mark does nothing; under ``torch.compile`` the layer is traced once and
    its compiled body reused by every layer.
    """
    cls = type(model.model.layers[0])
    if enable and cls not in _ORIGINAL_FORWARD:
        _ORIGINAL_FORWARD[cls] = cls.forward
        cls.forward = torch.compiler.nested_compile_region(cls.forward)
    elif not enable and cls in _ORIGINAL_FORWARD:
        cls.forward = _ORIGINAL_FORWARD.pop(cls)


def profile_eager_step(model: nn.Module, prompt: torch.Tensor, rows: int = 8) -> str:
    """Top CUDA kernels of one eager decode step (after a prefill), from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)
    cache = output_cache(out)
    kw = cache_keyword(model)
    model(input_ids=nxt, **{kw: cache}, use_cache=True, logits_to_keep=1)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(input_ids=nxt, **{kw: cache}, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


# Families of the kernels a decode step runs, by substrings of the kernel's name, in order (first
# match wins): what the compiled-step profile sums its GPU time into. Inductor's fused kernels
# ("triton_...") carry the names of the ops they fused: those that fused attention (the K/V
# expansion before SDPA, flex attention) count as attention, the rest as fused element-wise
# work, never as a GEMM library.
KERNEL_FAMILIES = (
    ("kbit GEMM", ("kbit_decode", "kbit_gemm")),
    ("kbit other", ("kbit_",)),
    ("attention", ("sdpa", "fmha", "flash", "attention", "scaled_dot_product")),
    ("Triton fused (other)", ("triton_",)),
    ("cuBLAS GEMM", ("nvjet", "cublas", "cutlass", "gemm", "gemv")),
)


def kernel_family(name: str) -> str:
    """The :data:`KERNEL_FAMILIES` entry a kernel name belongs to (``"other"`` if none)."""
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def _family_lines(per_kernel: Iterable[tuple[str, float]], total: float) -> list[str]:
    """One line per :data:`KERNEL_FAMILIES` family, largest first: its microseconds per step summed
    over ``per_kernel`` ((name, us per step) pairs), in ms and as a share of ``total`` us."""
    fam: dict[str, float] = {}
    for name, us in per_kernel:
        family = kernel_family(name)
        fam[family] = fam.get(family, 0.0) + us
    return [f"  {us / 1e3:8.3f} ms {100 * us / max(total, 1e-9):5.1f} %  {family}"
            for family, us in sorted(fam.items(), key=lambda kv: -kv[1])]


def summarize_kernels(events: list[tuple[str, float, int]], steps: int, rows: int = 10) -> str:
    """A text table of GPU time per decode step: by family, then the top ``rows`` kernels.

    Args:
        events: (kernel name, total GPU microseconds, calls) over ``steps`` steps.
        steps: decode steps the events cover.
        rows: kernels listed one by one.
    """
    total = sum(us for _, us, _ in events) / steps
    lines = [f"  GPU time per step {total / 1e3:.3f} ms (kernels in the graph, summed)"]
    lines += _family_lines(((name, us / steps) for name, us, _ in events), total)
    lines.append("  top kernels (ms per step, calls per step, name):")
    for name, us, calls in sorted(events, key=lambda e: -e[1])[:rows]:
        lines.append(f"  {us / steps / 1e3:8.3f} ms {calls // steps:5d}x  {name[:100]}")
    return "\n".join(lines)


def profile_gpu(run: Callable[[], Any], steps: int) -> str:
    """:func:`summarize_kernels` and :func:`summarize_critical_path` of ``run()``, ``steps`` decode
    steps, under ``torch.profiler`` (CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [(e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return summarize_kernels(events, steps) + "\n" + summarize_critical_path(spans, steps)


def summarize_critical_path(spans: list[tuple[str, float, float]], steps: int, rows: int = 12) -> str:
    """A text table of what each kernel adds to the step's wall time, and the idle time between kernels.

    Kernels of one stream run in order, but a programmatic launch starts a kernel while the one
    before it finishes, so a kernel's own GPU time overstates its cost. Here each kernel is charged
    only the time from the later of its start and the previous kernel's end to its own end, and the
    time when no kernel ran is listed apart (launch latency inside the graph).

    Args:
        spans: (kernel name, start us, end us) of every kernel over ``steps`` steps, any order.
        steps: decode steps the spans cover.
        rows: kernels listed one by one.
    """
    spans = sorted(spans, key=lambda s: s[1])
    added: dict[str, float] = {}
    idle = 0.0
    last_end = spans[0][1] if spans else 0.0
    for name, start, end in spans:
        if start > last_end:
            idle += start - last_end
        added[name] = added.get(name, 0.0) + max(0.0, end - max(start, last_end))
        last_end = max(last_end, end)
    wall = (last_end - spans[0][1]) / steps if spans else 0.0
    lines = [f"  wall time per step {wall / 1e3:.3f} ms from the first kernel's start to the last's end, of it "
             f"{idle / steps / 1e3:.3f} ms with no kernel running"]
    lines += _family_lines(((name, us / steps) for name, us in added.items()), wall)
    lines.append("  kernels by added time (ms per step, name):")
    for name, us in sorted(added.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"  {us / steps / 1e3:8.3f} ms  {name[:100]}")
    return "\n".join(lines)


def _forward_kwargs(model: nn.Module) -> bool:
    """Whether this transformers version's decoder still takes ``cache_position``."""
    return "cache_position" in inspect.signature(model.model.forward).parameters


def run_compiled(
    model: nn.Module, prompt: torch.Tensor, decode: int, config: Any, regions: bool = True, warm: int = 3,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """Prefill into a ``StaticCache``, then ``decode`` steps of a CUDA-graph-compiled decode step.

    With ``regions`` the decoder layers are compiled once as a nested region (falls back to
    plain tracing, and says so, if that fails). With ``profile_steps`` > 0, that many more steps
    run under ``torch.profiler`` after the timed ones, and the result's ``"profile"`` holds
    :func:`summarize_kernels` of them (the static cache holds that many more positions, so the
    timed steps attend over a slightly longer cache than without profiling).
    """
    from transformers import StaticCache

    batch, plen = prompt.shape
    dev = prompt.device
    use_cpos = _forward_kwargs(model)
    cache_kw = cache_keyword(model)

    def forward(ids: torch.Tensor, pos: torch.Tensor, cpos: torch.Tensor, cache: Any, **kw: Any) -> torch.Tensor:
        extra = {"cache_position": cpos} if use_cpos else {}
        out = model(input_ids=ids, position_ids=pos, **{cache_kw: cache}, use_cache=True, logits_to_keep=1, **extra, **kw)
        return out.logits[:, -1, :].argmax(dim=-1, keepdim=True)

    def prefill(cache: Any) -> torch.Tensor:
        cpos = torch.arange(plen, device=dev)
        return forward(prompt, cpos.unsqueeze(0), cpos, cache)

    # Warm-up prefill on a throw-away cache so the timed one pays no first-call costs.
    cache_len = plen + warm + decode + profile_steps
    prefill(StaticCache(config=config, max_cache_len=cache_len))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # TTFT: the median of three timed prefills, each into a fresh cache (one alone varies by tens of percent)
    ttfts, cache = [], None
    for _ in range(3):
        cache = None
        cache = StaticCache(config=config, max_cache_len=cache_len)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = prefill(cache)
        torch.cuda.synchronize()
        ttfts.append(time.perf_counter() - t0)
    ttft = sorted(ttfts)[1]

    fullgraph = True
    mark_layer_regions(model, regions)
    step_fn: Callable[..., torch.Tensor] = torch.compile(
        lambda i, p, c: forward(i, p, c, cache), mode="reduce-overhead", fullgraph=True
    )
    pos = torch.full((1, 1), plen, device=dev, dtype=torch.long)
    cpos = torch.full((1,), plen, device=dev, dtype=torch.long)

    picked = [ids]

    def step(ids: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        nxt = step_fn(ids, pos, cpos).clone()
        pos.add_(1)
        cpos.add_(1)
        picked.append(nxt)
        return nxt

    t_c = time.perf_counter()
    try:
        ids = step(ids)
    except torch._dynamo.exc.TorchDynamoException as exc:  # a tracing failure: retry plainly, and say so
        print(f"# compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
              "retrying without regions, with graph breaks allowed", flush=True)
        fullgraph, regions = False, False
        mark_layer_regions(model, False)
        torch._dynamo.reset()
        step_fn = torch.compile(lambda i, p, c: forward(i, p, c, cache), mode="reduce-overhead")
        picked = picked[:1]
        ids = step(ids)
    for _ in range(warm - 1):
        ids = step(ids)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t_c

    t1 = time.perf_counter()
    for _ in range(decode):
        ids = step(ids)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t1) / decode
    profile_text = None
    if profile_steps > 0:
        def more_steps() -> None:
            nxt = ids
            for _ in range(profile_steps):
                nxt = step(nxt)

        profile_text = profile_gpu(more_steps, profile_steps)
    res = {"ttft_ms": 1e3 * ttft, "ms_per_step": 1e3 * step_s, "tok_s": batch / step_s,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "compile_s": compile_s, "fullgraph": fullgraph,
           "regions": regions,
           "tokens": torch.cat(picked, dim=1)[:, :decode].cpu(), "profile": profile_text}
    step_fn = cache = None  # drop the graphs and the cache before emptying the allocator's cache
    mark_layer_regions(model, False)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return res


def agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading greedy tokens on which two ``[batch, tokens]`` results agree for every sequence.

    Eager and compiled steps round differently, so a random-weight model may diverge after a
    while; an early divergence points at a wrong cache position instead.
    """
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).all(dim=0)
    return int(n if bool(same.all()) else int(torch.argmin(same.to(torch.int8))))


def kv_bytes(config: Any, batch: int, tokens: int) -> int:
    """bf16 K and V of ``tokens`` positions for ``batch`` sequences, all layers."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * 2 * batch * tokens * config.num_key_value_heads * head_dim * config.num_hidden_layers


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every requested (variant, mode, batch); returns the JSON payload.

    Args:
        args: the parsed command line.
        checkpoint: called with the payload so far (``progress.complete`` False) after every
            finished (variant, mode, batch) row, measured or failed, so that a caller can save
            it: a run cut short then still leaves every row it measured.

    Returns:
        The payload; its ``progress`` says how many of the planned rows were attempted.
    """
    device = bc.require_cuda()
    env = bc.environment(device)
    config = ARCHS[args.arch](args.layers)
    notes: list[str] = []
    libs: dict[str, Any] = {}
    models = list(args.models)
    if "bnb-nf4" in models:
        libs["bitsandbytes"], why = bc.optional_import("bitsandbytes")
        if libs["bitsandbytes"] is None:
            notes.append(f"bitsandbytes not importable ({why}): bnb-nf4 rows absent")
            models.remove("bnb-nf4")
    if any(m.startswith("kbit") for m in models):
        ok, why = bc.kbit_cuda_status()  # importing the backend registers the CUDA kernels
        if ok:
            try:
                bc.kbit_api("quantize_model")
            except Exception as exc:  # noqa: BLE001
                ok, why = False, f"quantize_model unavailable: {type(exc).__name__}: {exc}"
        if not ok:
            notes.append(f"kbit rows absent: {why}")
            models = [m for m in models if not m.startswith("kbit")]

    if args.inductor_pdl:
        import torch._inductor.config as inductor_config

        if hasattr(inductor_config.triton, "enable_pdl"):
            inductor_config.triton.enable_pdl = True  # before the first compile: it shapes the generated kernels
        else:
            notes.append("--inductor-pdl: this torch has no torch._inductor.config.triton.enable_pdl; not applied")
            args.inductor_pdl = False
    t_start = time.perf_counter()
    copy_gbps = bc.measure_copy_bandwidth(device)
    print(f"# {env['gpu']}: copy {copy_gbps:.0f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    planned = len(models) * len(args.batches) * len(args.modes)
    done = 0  # rows attempted so far, failed ones included: a failed row is finished too

    def payload(complete: bool) -> dict[str, Any]:
        return {"env": env, "copy_gbps": copy_gbps, "rows": list(rows), "notes": list(notes),
                "config": {"models": args.models, "batches": args.batches, "modes": args.modes, "prompt": args.prompt,
                           "attn": args.attn, "inductor_pdl": args.inductor_pdl,
                           "decode": args.decode, "layers": args.layers, "regions": args.regions, "arch": args.arch},
                "progress": {"done": done, "planned": planned, "measured": len(rows), "complete": complete},
                "wall_s": time.perf_counter() - t_start}

    def save() -> None:
        if checkpoint is not None:
            checkpoint(payload(False))

    for name in models:
        t_b = time.perf_counter()
        try:
            model = build_variant(name, config, device, libs, attn=args.attn)
        except Exception as exc:  # noqa: BLE001  (one broken variant must not hide the others)
            notes.append(f"{name}: build failed: {type(exc).__name__}: {exc}"[:300])
            done += len(args.batches) * len(args.modes)  # none of its rows can run
            save()
            continue
        build_s = time.perf_counter() - t_b
        mb = model_bytes(model)
        print(f"# {name}: built in {build_s:.1f} s, {mb['total'] / 1e9:.2f} GB", flush=True)
        gen = torch.Generator(device=device).manual_seed(1)
        for batch in args.batches:
            prompt = torch.randint(0, config.vocab_size, (batch, args.prompt), device=device, generator=gen)
            ctx = args.prompt + args.decode / 2  # mean attended length during decode
            read = mb["total"] - mb["embedding"] - mb["experts"] * (1.0 - expert_hit_share(config, batch))
            floor_ms = 1e3 * (read + kv_bytes(config, batch, int(ctx))) / (copy_gbps * 1e9)
            eager_tokens = None
            if args.profile and batch == args.batches[0]:
                with torch.inference_mode():
                    print(f"# {name}: one eager decode step, batch {batch}\n" + profile_eager_step(model, prompt), flush=True)
            for mode in args.modes:
                t_r = time.perf_counter()
                try:
                    with torch.inference_mode() if mode == "eager" else torch.no_grad():
                        res = (run_eager(model, prompt, args.decode) if mode == "eager"
                               else run_compiled(model, prompt, args.decode, config, args.regions,
                                                 profile_steps=4 if args.profile else 0))
                except Exception as exc:  # noqa: BLE001
                    notes.append(f"{name} {mode} batch {batch}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                    mark_layer_regions(model, False)
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
                    done += 1
                    save()
                    continue
                tokens = res.pop("tokens")
                profile_text = res.get("profile")
                if profile_text:
                    print(f"# {name}: compiled decode step, batch {batch}, GPU time by kernel\n{profile_text}", flush=True)
                else:
                    res.pop("profile", None)
                if mode == "eager":
                    eager_tokens = tokens
                elif eager_tokens is not None:
                    res["agree_with_eager"] = agreement(tokens, eager_tokens)
                row = {"model": name, "mode": mode, "batch": batch, "prompt": args.prompt, "decode": args.decode,
                       "model_gb": mb["total"] / 1e9, "floor_ms_per_step": floor_ms, "build_s": build_s,
                       "run_s": time.perf_counter() - t_r, **res}
                rows.append(row)
                done += 1
                print(f"# {name} {mode} b{batch}: {res['tok_s']:.1f} tok/s, {res['ms_per_step']:.2f} ms/step, "
                      f"TTFT {res['ttft_ms']:.0f} ms, peak {res['peak_gib']:.1f} GiB ({row['run_s']:.0f} s)", flush=True)
                save()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return payload(True)


# ---------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------

_MODE_TEXT = {"eager": "eager HF generate", "compiled": "StaticCache + compiled step (CUDA graphs)"}


def table(payload: dict[str, Any]) -> str:
    """All rows; speedup against bf16 in the same mode and batch."""
    rows = payload["rows"]
    base = {(r["mode"], r["batch"]): r["tok_s"] for r in rows if r["model"] == "bf16"}
    headers = ["model", "mode", "batch", "decode tok/s", "ms/step", "floor ms/step", "vs bf16", "TTFT ms",
               "peak GiB", "model GB", "compile s", "= eager tokens"]
    body = []
    for r in rows:
        b = base.get((r["mode"], r["batch"]))
        body.append([
            r["model"], _MODE_TEXT.get(r["mode"], r["mode"]) + ("" if r.get("fullgraph", True) else " (graph breaks)"),
            r["batch"], bc.fmt(r["tok_s"]), bc.fmt(r["ms_per_step"], 2), bc.fmt(r["floor_ms_per_step"], 2),
            bc.fmt(r["tok_s"] / b, 2) if b else "-", bc.fmt(r["ttft_ms"], 0), bc.fmt(r["peak_gib"], 1),
            bc.fmt(r["model_gb"], 2), bc.fmt(r.get("compile_s"), 0),
            f"{r['agree_with_eager']}/{r['decode']}" if "agree_with_eager" in r else "-",
        ])
    return bc.markdown_table(headers, body)


def progress_line(payload: dict[str, Any]) -> str | None:
    """The markdown line that marks an unfinished run's snapshot; ``None`` once the run is complete.

    Payloads without ``progress`` (JSON files written before it existed) count as complete.
    """
    prog = payload.get("progress")
    if not prog or prog.get("complete", True):
        return None
    return (f"**partial: {prog['done']} of {prog['planned']} rows** ({prog['measured']} measured; "
            "the run was still going when this file was written, and rewrites it after every row)")


def report(payload: dict[str, Any]) -> str:
    """The markdown report (headed by a "partial" line while the run is still going)."""
    cfg = payload["config"]
    partial = progress_line(payload)
    out = ["# End-to-end decode benchmark", ""] + ([partial, ""] if partial else []) + bc.env_lines(payload["env"]) + [
        f"- measured in the same run: device-to-device copy {payload['copy_gbps']:.0f} GB/s (read + write)",
        f"- wall time of the run{' so far' if partial else ''}: {payload['wall_s']:.0f} s", "",
        ARCH_TEXT[cfg.get("arch", "llama3-8b")].format(layers=cfg["layers"]) + ", random "
        f"weights, prompt {cfg['prompt']} random tokens, greedy decode of {cfg['decode']} tokens; lm_head bf16 in every "
        "variant but kbit4-fused-head. tok/s counts every sequence of the batch. TTFT = prefill + first pick (eager: one generate call; "
        "compiled mode: the median of three prefills into fresh caches). floor = (bytes of all weights "
        "but the embedding, MoE experts counted as the share a batch hits under uniform routing, 1 - (1 - k/E)^batch, "
        "+ mean KV cache) / copy bandwidth. Peak = max allocated GPU memory during the timed run. "
        "Eager mode is bound by Python launch overhead; the compiled mode measures the GPU"
        + (" (decoder layer compiled once as a `torch.compiler.nested_compile_region`)" if cfg.get("regions") else "")
        + ". '= eager tokens': "
        "leading greedy tokens of the compiled loop identical to HF generate's for every sequence (rounding "
        "differs between the modes, so random-weight models may part after a while)."
        + (f" Attention: transformers' `{cfg['attn']}` implementation in every variant." if cfg.get("attn") else "")
        + (" Inductor's Triton kernels use programmatic dependent launch (`torch._inductor.config.triton.enable_pdl`) "
           "in every variant." if cfg.get("inductor_pdl") else ""), "",
        table(payload), "",
    ]
    profiled = [r for r in payload["rows"] if r.get("profile")]
    if profiled:
        out += ["## GPU time of one compiled decode step, by kernel", "",
                "`--profile`: four more compiled steps under `torch.profiler`, each kernel's GPU time per step "
                "(kernels of the CUDA graph, summed; with programmatic launch a kernel's time may include its wait "
                "for the previous one). Families by kernel name (`bench_generate.KERNEL_FAMILIES`).", ""]
        for r in profiled:
            out += [f"{r['model']}, batch {r['batch']}:", "", "```", r["profile"], "```", ""]
    if payload["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in payload["notes"]] + [""]
    return "\n".join(out)


def plot(payload: dict[str, Any], path: str) -> None:
    """Decode tokens/s per variant and batch, one panel per mode (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    modes = [m for m in payload["config"]["modes"] if any(r["mode"] == m for r in rows)]
    if not modes:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.2), squeeze=False)
    width = 0.8 / max(1, len(models))
    for ax, mode in zip(axes[0], modes):
        for i, name in enumerate(models):
            vals = [next((r["tok_s"] for r in rows if r["model"] == name and r["mode"] == mode and r["batch"] == b), 0.0)
                    for b in batches]
            xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(batches))]
            bars = ax.bar(xs, vals, width, label=name)
            for x, v in zip(xs, vals):
                if v > 0:
                    ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=6, rotation=90)
            del bars
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (higher is better)")
        ax.set_title(_MODE_TEXT.get(mode, mode), fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.25)
    axes[0][0].legend(fontsize=8)
    cfg = payload["config"]
    fig.suptitle(f"{ARCH_TEXT[cfg.get('arch', 'llama3-8b')].split(' (')[0]}, prompt {cfg['prompt']}, decode {cfg['decode']} on {payload['env']['gpu']}", fontsize=10)
    fig.tight_layout()
    bc.save_figure(fig, path)


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bf16 and kbit4 only, batch 1, prompt 128, decode 32")
    p.add_argument("--models", nargs="+", choices=MODELS, help=f"variants (default all: {' '.join(MODELS)})")
    p.add_argument("--batches", nargs="+", type=int, help="batch sizes (default 1 8 32)")
    p.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    p.add_argument("--prompt", type=int, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int, help="generated tokens (default 128)")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama3-8b", help="model shape (default llama3-8b)")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, as Llama-3-8B)")
    p.add_argument("--no-regions", dest="regions", action="store_false",
                   help="compile all layers separately instead of one nested region per layer (slow to compile)")
    p.add_argument("--attn", default=None,
                   help="transformers attention implementation for every variant (default: transformers' own, sdpa); "
                        "e.g. flex_attention, whose GQA reads each key/value head once instead of expanding it per query head")
    p.add_argument("--inductor-pdl", action="store_true",
                   help="compile with torch._inductor.config.triton.enable_pdl (every variant): inductor's Triton kernels "
                        "then start while the kernel before them finishes, as the kbit kernels do")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one eager decode step per variant and "
                   "(compiled mode) the GPU time of a compiled step by kernel family")
    p.add_argument("--json", help="write all rows and the environment as JSON")
    p.add_argument("--plot", help="write the PNG plot")
    p.add_argument("--md", help="write the markdown report")
    args = p.parse_args(argv)
    args.models = args.models or (QUICK_MODELS if args.quick else MODELS)
    args.batches = args.batches or ([1] if args.quick else [1, 8, 32])
    args.prompt = args.prompt or (128 if args.quick else 512)
    args.decode = args.decode or (32 if args.quick else 128)
    if any(b < 1 for b in args.batches) or args.prompt < 1 or args.decode < 2 or args.layers < 1:
        p.error("--batches, --prompt and --layers must be >= 1 and --decode >= 2")
    return args


def save_snapshot(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """Rewrite the requested files with the rows so far (the ``run`` checkpoint).

    A failure here is printed, not raised: losing one snapshot must not end the measurements.
    The final write in ``main`` is not guarded, so a persistent problem still surfaces.
    """
    try:
        bc.write_outputs(args, payload, report(payload), plot)
    except Exception as exc:  # noqa: BLE001
        print(f"# could not write the snapshot: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Run, writing the requested files after every row, then print the final report."""
    args = parse_args(argv)
    want_files = bool(args.json or args.md or args.plot)
    payload = run(args, (lambda p: save_snapshot(args, p)) if want_files else None)
    text = report(payload)
    bc.write_outputs(args, payload, text, plot)
    print(text)


if __name__ == "__main__":
    main()
