"""End-to-end decode with the quantized KV cache at long context, beside transformers' bf16 cache.

A Llama-3-8B-shaped model with random weights (``bench_generate.py``'s builder), its linear layers
at kbit K = 4, prefilled with ``--context`` random tokens (in chunks of ``--chunk``, the same for
both caches), then ``--decode`` greedy tokens one forward call at a time (eager, as
``model.generate`` would run them), with:

* ``DynamicCache`` (bf16 keys and values, SDPA attention) with the SDPA backend torch picks
  (cuDNN on Hopper, whose host side rebuilds its plan as the length changes: ~1.5 ms per call),
  and again with SDPA held to its flash / memory-efficient backends (the faster bf16 baseline), and
* ``KbitKVCache(kv_bits=...)`` (the ``"kbit_kv"`` attention: the fused decode kernel; the
  allocator re-runs inside the timed steps, every ``max(64, allocation_fraction * cached at
  its last run)`` tokens; ``--allocation-fraction`` adds one row per value, e.g. ``1e-9`` for every 64 tokens;
  ``--mass-interval`` one row per value of ``mass_interval``).

Reported per cache: decode ms per step from the second step on (mean, reallocations included,
and median), the first step apart (with the kbit cache it re-codes the prompt tokens stored since
the allocator last ran: up to ``prefill_interval`` plus a chunk),
tokens/s, the cache's bytes, and peak GPU memory. The longest context that fits is
estimated from the bytes per token of each cache and the memory left beside the model (not run).

Usage::

    python3 scripts/bench_kv_generate.py --context 32768 --decode 128 --md bench/results/kv-generate-h100.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402
import bench_generate as bg  # noqa: E402

from kbit_linear.kv_cache import cache_keyword  # noqa: E402  (the repository is on the path after _bench_common)


def _prefill(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> torch.Tensor:
    logits = None
    kw = cache_keyword(model)
    with torch.no_grad():
        for i in range(0, ids.shape[1], chunk):
            logits = model(input_ids=ids[:, i:i + chunk], **{kw: cache}, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1]


def _decode(model: Any, cache: Any, first: torch.Tensor, steps: int) -> list[float]:
    """Wall seconds of each greedy decode step (synchronized)."""
    nxt = first.argmax(-1, keepdim=True)
    times = []
    kw = cache_keyword(model)
    with torch.no_grad():
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model(input_ids=nxt, **{kw: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward call")
    ap.add_argument("--kv-bits", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--fuse", action="store_true",
                    help="the model's q/k/v and gate/up projections fused (kbit_linear.fuse_projections: 4 kbit calls a "
                         "layer in place of 7), in every row")
    ap.add_argument("--allocation-fraction", type=float, nargs="+", default=None,
                    help="KbitKVCache's allocation_fraction, one kbit row per value (default: the library's)")
    ap.add_argument("--mass-interval", type=int, nargs="+", default=None,
                    help="KbitKVCache's mass_interval, one kbit row per value (default: the library's)")
    ap.add_argument("--graph", action="store_true",
                    help="also: each kbit row again with KbitDecodeGraph (replayable cache, one CUDA graph per allocator "
                         "epoch), eager and with compiled decoder layers, and bf16 in a StaticCache with a compiled "
                         "(CUDA-graph) step, the fair baseline for them")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="with --graph: that many replays of each graph row's last captured step (what is left of its "
                         "epoch at most) and that many steps of the compiled bf16 row under torch.profiler, GPU time per "
                         "step by kernel family")
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.decode < 2:
        ap.error(f"--decode must be >= 2 (the first step is timed apart), got {args.decode}")
    dev = bc.require_cuda()
    import kbit_linear

    config = bg.llama3_8b_config(args.layers)
    config.max_position_embeddings = max(config.max_position_embeddings, args.context + args.decode + 16)
    model = bg.build_variant("kbit4-fused" if args.fuse else "kbit4", config, dev, {})
    ids = torch.randint(0, config.vocab_size, (args.batch, args.context), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    rows = []
    fractions = args.allocation_fraction or [kbit_linear.kv_cache.ALLOCATION_FRACTION]
    intervals = args.mass_interval or [kbit_linear.kv_cache.MASS_INTERVAL]
    variants = {"bf16 DynamicCache": None, "bf16 DynamicCache, SDPA flash / efficient": None}
    for f in fractions:
        for m in intervals:
            variants[f"KbitKVCache {args.kv_bits:g} bits, allocation_fraction {f:.3g}, mass_interval {m}"] = (f, m)
            if args.graph:
                for layers in ("", ", compiled layers"):
                    variants[f"KbitKVCache {args.kv_bits:g} bits, allocation_fraction {f:.3g}, mass_interval {m}, "
                             f"CUDA graph per epoch{layers}"] = (f, m)
    for name, kbit in variants.items():
        if "CUDA graph per epoch" in name:
            rows.append(_kbit_graph(model, ids, args, dev, name, kbit, compile_layers=name.endswith("compiled layers")))
            print({k: v for k, v in rows[-1].items() if k != "profile"}, flush=True)
            continue
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        if name.startswith("bf16"):
            from transformers import DynamicCache

            model.config._attn_implementation = "sdpa"
            cache = DynamicCache(config=model.config)
        else:
            cache = kbit_linear.KbitKVCache(model.config, kv_bits=args.kv_bits, allocation_fraction=kbit[0], mass_interval=kbit[1])
        backends = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]) if "flash" in name else contextlib.nullcontext()
        with backends:
            t0 = time.perf_counter()
            first = _prefill(model, ids, cache, args.chunk)
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            times = _decode(model, cache, first, args.decode)
        nbytes = cache.nbytes if hasattr(cache, "nbytes") else sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size() for layer in cache.layers)
        steady = times[1:] if len(times) > 1 else times  # the first step finishes the prompt's allocation
        row = {"cache": name, "prefill_s": prefill_s, "first_step_ms": 1e3 * times[0], "step_ms_mean": 1e3 * statistics.mean(steady),
               "step_ms_median": 1e3 * statistics.median(steady), "tok_s": args.batch / statistics.mean(steady),
               "cache_bytes": int(nbytes), "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
               "average_bits": cache.average_bits() if hasattr(cache, "average_bits") else 16.0}
        rows.append(row)
        print(row, flush=True)
        del cache
    if args.graph:
        rows.append(_bf16_compiled(model, ids, args, dev))
        print({k: v for k, v in rows[-1].items() if k != "profile"}, flush=True)
    total = torch.cuda.get_device_properties(dev).total_memory
    text = _markdown(args, bc.environment(dev), rows, total)
    if args.md:
        bc.write_text(args.md, text + "\n")
    if args.json:
        bc.write_json(args.json, {"rows": rows, "args": vars(args)})
    print(text)


def _bf16_compiled(model: Any, ids: torch.Tensor, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """bf16 keys and values in a StaticCache, the whole prompt in one call, then a compiled
    CUDA-graph decode step (``bench_generate.run_compiled``)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    model.config._attn_implementation = "sdpa"
    res = bg.run_compiled(model, ids, args.decode, model.config, profile_steps=args.profile)
    kv_bytes = 2 * model.config.num_hidden_layers * args.batch * (args.context + args.decode + 3) * \
        model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 2
    return {"cache": "bf16 StaticCache, compiled step (CUDA graphs)", "prefill_s": res["ttft_ms"] / 1e3, "first_step_ms": float("nan"),
            "step_ms_mean": res["ms_per_step"], "step_ms_median": res["ms_per_step"], "tok_s": res["tok_s"],
            "cache_bytes": kv_bytes, "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30, "average_bits": 16.0,
            **({"profile": res["profile"]} if res.get("profile") else {})}


def _kbit_graph(model: Any, ids: torch.Tensor, args: argparse.Namespace, dev: torch.device, name: str,
                kbit: tuple[float, int], compile_layers: bool) -> dict[str, Any]:
    """The kbit cache built replayable, prefilled as the eager rows, then ``args.decode`` tokens from
    :class:`kbit_linear.KbitDecodeGraph`: the first in a call of its own, timed apart as the eager
    rows' first step (with ``compile_layers``, the compilation too), the rest in one call (its eager
    steps, captures and allocator runs included)."""
    import kbit_linear

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    cache = kbit_linear.KbitKVCache(model.config, kv_bits=args.kv_bits, allocation_fraction=kbit[0], mass_interval=kbit[1],
                                    replayable=True)
    t0 = time.perf_counter()
    first = _prefill(model, ids, cache, args.chunk)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    decoder = kbit_linear.KbitDecodeGraph(model, cache, compile_layers=compile_layers)
    t0 = time.perf_counter()
    nxt = decoder.generate(first.argmax(-1, keepdim=True), 1)  # eager: re-codes the prompt's last tokens
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    nxt = decoder.generate(nxt, args.decode - 1)[:, -1:]
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t0) / (args.decode - 1)
    row = {"cache": name + f" ({decoder.captures} captures)", "prefill_s": prefill_s, "first_step_ms": first_ms,
           "step_ms_mean": step_ms, "step_ms_median": step_ms, "tok_s": 1e3 * args.batch / step_ms,
           "cache_bytes": int(cache.nbytes), "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
           "average_bits": cache.average_bits()}
    # The steady state: the last epoch's graph replayed over what is left of its room (the device
    # state moves on, the host's does not: the cache is not used after this).
    room = cache.replayable_steps(1)
    timed = min(room // 2, 32)
    if decoder.graph is not None and timed >= 4:
        row["replay_ms"] = bc._event_ms(lambda: [decoder.graph.replay() for _ in range(timed)], 1)[0] / timed
        if args.profile:
            steps = min(args.profile, room - timed)
            row["profile"] = bg.profile_gpu(lambda: [decoder.graph.replay() for _ in range(steps)], steps)
    return row


def _markdown(args: argparse.Namespace, env: dict[str, Any], rows: list[dict[str, Any]], total: int) -> str:
    lines = ["# End-to-end decode at long context: KbitKVCache vs bf16 DynamicCache", ""]
    lines += bc.env_lines(env)
    lines += [f"- model: Llama-3-8B-shaped, {args.layers} layers, linear layers kbit K = 4{' (q/k/v and gate/up fused)' if args.fuse else ''}, random weights; batch {args.batch}, "
              f"context {args.context} (prefilled in chunks of {args.chunk}), {args.decode} greedy decode steps, eager forward calls", ""]
    base, tuned = rows[0], rows[1]  # bf16 with torch's SDPA pick, and with flash / efficient
    compiled = next((r for r in rows if r["cache"].startswith("bf16 StaticCache")), None)
    table = []
    for r in rows:
        per_tok = r["cache_bytes"] / (args.batch * (args.context + args.decode))
        vs = [f"{compiled['step_ms_mean'] / r['step_ms_mean']:.2f}x"] if compiled else []
        table.append([r["cache"], bc.fmt(r["step_ms_mean"]), bc.fmt(r["step_ms_median"]), f"{r['tok_s']:.1f}",
                      f"{base['step_ms_mean'] / r['step_ms_mean']:.2f}x", f"{tuned['step_ms_mean'] / r['step_ms_mean']:.2f}x", *vs,
                      f"{r['cache_bytes'] / 2**30:.2f}",
                      f"{per_tok / 1024:.1f}", f"{r.get('average_bits', float('nan')):.2f}", bc.fmt(r["peak_gib"], 1), bc.fmt(r["prefill_s"], 1), bc.fmt(r["first_step_ms"]),
                      bc.fmt(r.get("replay_ms", float("nan")), 2)])
    lines.append(bc.markdown_table(["cache", "ms/step (mean)", "ms/step (median)", "tok/s", "speed vs bf16 (SDPA default)",
                                    "vs bf16 (SDPA flash / efficient)", *(["vs bf16 StaticCache compiled"] if compiled else []),
                                    "cache GiB", "KiB/token", "payload bits", "peak GiB", "prefill s", "first step ms",
                                    "replay ms"], table))
    lines += ["", "Steps 2 onwards (the allocator's runs included: every max(64, allocation_fraction x tokens cached at its last run) "
              "tokens); the first decode step is "
              "listed apart: with the kbit cache it re-codes the prompt tokens stored since the allocator last ran "
              "(up to `prefill_interval` plus a chunk; it belongs to the time to "
              "first token). `--graph` rows: the mean over steps 2 onwards as one `generate` call, its eager steps, captures and the "
              "allocator's runs included (so there is no median apart); \"replay ms\": the last epoch's captured step replayed alone "
              "(the steady state between allocator runs; its `--profile` is of such replays); the bf16 StaticCache row "
              "prefills the prompt in one call."]
    for r in rows:
        if r.get("profile"):
            lines += ["", f"GPU time per step, {r['cache']} (`--profile {args.profile}`):", "", "```", r["profile"], "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
