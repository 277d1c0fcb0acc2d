#!/usr/bin/env python3
"""Perplexity and KL divergence of one model: unquantized, kbit at K = 2, 3, 4, 5, and NF4.

Every quantized variant is loaded through the transformers plug-in
(``from_pretrained(..., quantization_config=KbitConfig(bits=K))``), all ``nn.Linear`` layers
quantized except ``lm_head``/tied embeddings, then evaluated with the baseline's dtype. By
default the weights are quantized from a float32 load (``--quantize-dtype fp32``), i.e. from
the checkpoint's own values when it is stored in float32, and the model is cast to the
evaluation dtype afterwards (the quantized tensors are unaffected by the cast);
``--quantize-dtype bf16`` quantizes the bf16-rounded weights instead, which is what
``from_pretrained(..., dtype=torch.bfloat16)`` does. bitsandbytes NF4 (blocksize 64) is added
when bitsandbytes is importable and works on the device.

The text and windows are those of :mod:`kbit_linear.tools.evaluation` (CPython's
``pydoc_data.topics``, first 16 non-overlapping 512-token windows). The KL column is the mean
``KL(baseline || variant)`` of the next-token distributions, in nats per token.

Example (CPU, the embedded SmolLM2-135M-Instruct, about 15 minutes on 2 cores)::

    python3 scripts/eval_ppl.py --out bench/results/eval_ppl_smollm2.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from _bench_common import markdown_table, optional_import  # (importing it puts the repo on sys.path)

from kbit_linear.tools.evaluation import EvalResult, evaluate, stored_bits_per_weight, token_windows
from kbit_linear.integrations.transformers import KbitConfig, register
from kbit_linear.tools.models import DEFAULT_MODEL, resolve_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a local HF folder or a hub id")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 5], choices=[2, 3, 4, 5], help="kbit widths to evaluate")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the baseline and the activations")
    p.add_argument(
        "--quantize-dtype",
        default="fp32",
        choices=sorted(DTYPES),
        help="dtype the weights are loaded in before they are quantized (fp32: from the checkpoint's precision)",
    )
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--windows", type=int, default=16, help="number of 512-token windows")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--no-nf4", action="store_true", help="skip the bitsandbytes NF4 row")
    p.add_argument("--scale-search", choices=["off", "on", "both"], default="off",
                   help="kbit rows with round-up absmax scales (off), with the block scale search (on), or both")
    p.add_argument("--out", type=Path, help="also write the table (with date, command and machine) to this markdown file")
    return p.parse_args(argv)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_name()} ({torch.get_num_threads()} threads)"


def _load(path: str, dtype: torch.dtype, device: torch.device, quantization_config=None):
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device), quantization_config=quantization_config)
    model.eval()
    return model, time.perf_counter() - start


def _row(name: str, bits: str, result: EvalResult | None, load_s: float | None, note: str = "") -> list[str]:
    if result is None:
        return [name, bits, "-", "-", "-", note]
    kl = "0" if result.kl is None else f"{result.kl:.3f}"
    timing = f"{load_s:.0f} / {result.seconds:.0f}" if load_s is not None else f"- / {result.seconds:.0f}"
    return [name, bits, f"{result.perplexity:.2f}", kl, timing, note]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    register()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    path = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    windows = token_windows(tokenizer, window=args.window, num_windows=args.windows)
    print(f"model {args.model} ({path}), {args.windows} x {args.window} tokens, {args.dtype} on {device}", file=sys.stderr)

    headers = ["method", "bits/weight (stored)", "perplexity", "KL vs baseline (nats/token)", "load / eval (s)", "note"]
    rows = []
    baseline, load_s = _load(path, dtype, device)
    base = evaluate(baseline, windows, progress=True)
    rows.append(_row(args.dtype, str(torch.finfo(dtype).bits), base, load_s))
    print(f"{args.dtype}: perplexity {base.perplexity:.3f}", file=sys.stderr)

    searches = {"off": [False], "on": [True], "both": [False, True]}[args.scale_search]
    for bits in args.bits:
        for search in searches:
            config = KbitConfig(bits=bits, scale_search=search)
            model, load_s = _load(path, DTYPES[args.quantize_dtype], device, config)
            model.to(dtype)  # casts what stayed dense; the quantized tensors keep their dtypes
            result = evaluate(model, windows, reference=baseline, progress=True)
            bpw = stored_bits_per_weight(model)
            name = f"kbit K={bits}" + (", scale search" if search else "")
            rows.append(_row(name, f"{bpw:.2f}", result, load_s, "load includes quantization"))
            print(f"{name}: perplexity {result.perplexity:.3f}, KL {result.kl:.4f}", file=sys.stderr)
            del model
            gc.collect()

    if not args.no_nf4:
        rows.append(_nf4_row(path, dtype, device, windows, baseline))

    table = markdown_table(headers, rows)
    print(table)
    if args.out is not None:
        command = "python3 " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
        import transformers

        lines = [
            f"# Perplexity and KL divergence: {DEFAULT_MODEL if args.model == 'default' else args.model}",
            "",
            f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- command: `{command}`",
            f"- device: {_device_name(device)}",
            f"- python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
            f"- text: CPython {platform.python_version()} `pydoc_data.topics` (sorted keys, blank-line joined), "
            f"first {args.windows} non-overlapping {args.window}-token windows, no special tokens "
            f"({base.tokens} scored tokens)",
            f"- every `nn.Linear` quantized except `lm_head`/tied embeddings, from weights loaded in "
            f"{args.quantize_dtype}; baseline and activations {args.dtype}",
            "- bits/weight (stored): planes + E4M4 scales + codebook + tensor scale over the true weight count "
            "(padding to 64 x 128 tiles included)",
            "",
            table,
            "",
        ]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _nf4_row(path: str, dtype: torch.dtype, device: torch.device, windows: torch.Tensor, baseline) -> list[str]:
    """bitsandbytes NF4 (blocksize 64) through transformers, or a row saying why not."""
    bnb, why = optional_import("bitsandbytes")
    if bnb is None:
        return _row("bitsandbytes NF4", "4.5", None, None, f"not run: {why}")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    try:
        model, load_s = _load(path, dtype, device, config)
        result = evaluate(model, windows, reference=baseline, progress=True)
    except Exception as e:  # bitsandbytes builds differ in which devices they support
        return _row("bitsandbytes NF4", "4.5", None, None, f"not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return _row("bitsandbytes NF4 (blocksize 64)", "4.5", result, load_s, f"bitsandbytes {bnb.__version__}")


if __name__ == "__main__":
    sys.exit(main())
