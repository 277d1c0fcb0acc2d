#!/usr/bin/env python3
"""Accuracy of one model: unquantized, kbit at K = 2, 3, 4, 5, uniform RTN baselines and NF4.

Causal LMs (SmolLM2-135M-Instruct, the default; ``--model gemma-3-270m``; any local folder or
hub id) are scored by perplexity, KL divergence and top-1 agreement of the next-token
distributions against the unquantized baseline; sentence encoders (``--model
all-minilm-l6-v2``, any BERT-like ``AutoModel``) by the cosine of their sentence embeddings
against the unquantized model's (:mod:`kbit_linear.tools.evaluation`).

kbit rows: data-free variants are loaded through the transformers plug-in
(``from_pretrained(..., quantization_config=KbitConfig(bits=K))``), every ``nn.Linear`` quantized
except ``lm_head``/tied embeddings, then evaluated with the baseline's dtype. By default the
weights are quantized from a float32 load (``--quantize-dtype fp32``), i.e. from the
checkpoint's own values when it is stored in float32, and the model is cast to the evaluation
dtype afterwards (the quantized tensors are unaffected by the cast); ``--quantize-dtype bf16``
quantizes the bf16-rounded weights instead, which is what ``from_pretrained(...,
dtype=torch.bfloat16)`` does.

``--calibration on`` quantizes with calibrated (GPTQ-style) rounding instead
(``quantize_model(model, bits, calibration=Calibration(tokenizer=...))`` on the float32 load,
:mod:`kbit_linear.calibration`): ``--calib-sequences`` windows of ``--calib-len`` tokens of the
default calibration text (docstrings of the standard library, disjoint from the evaluation
text); ``both`` gives the data-free and the calibrated rows. Calibrated rows sweep the columns in
activation order (the library's default); ``--act-order off`` (or ``both``) adds rows in the
in-features' own order. ``--scale-search`` applies to both,
and so does ``--hadamard`` (the randomized Hadamard rotation, :mod:`kbit_linear.hadamard`).

Baselines: ``--rtn-groups 32 64`` adds uniform asymmetric round-to-nearest at the same bits with
one fp16 scale and zero point per group (fake-quantized dense weights,
:mod:`kbit_linear.tools.baselines`); ``--gptq-groups 64`` the same grid with GPTQ rounding on the
calibration data of the calibrated kbit rows, in the same sweep orders (``--act-order``: static
groups in activation order); bitsandbytes NF4 (blocksize 64) is added when bitsandbytes
is importable and works on the device.

The text and windows are those of :mod:`kbit_linear.tools.evaluation` (CPython's
``pydoc_data.topics``, first 16 non-overlapping 512-token windows by default). The KL column is
the mean ``KL(baseline || variant)`` of the next-token distributions, in nats per token.

Example (CPU, the embedded SmolLM2-135M-Instruct, about 15 minutes on 2 cores)::

    python3 scripts/eval_ppl.py --out bench/results/eval_ppl_smollm2.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from _bench_common import cpu_name, markdown_table, optional_import  # (importing it puts the repo on sys.path)

from kbit_linear.tools.baselines import apply_gptq, apply_rtn, rtn_bits_per_weight
from kbit_linear.tools.evaluation import (
    EmbeddingResult,
    EvalResult,
    embedding_sentences,
    evaluate,
    evaluate_embeddings,
    reference_log_probs,
    sentence_embeddings,
    stored_bits_per_weight,
    token_windows,
)
from kbit_linear import Calibration, quantize_model
from kbit_linear.integrations.transformers import KbitConfig, register
from kbit_linear.tools.models import DEFAULT_MODEL, resolve_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# Row labels of the --codebook options ("nf", the normal-float levels, adds none).
CODEBOOK_LABELS = {"fitted": "fitted codebook", "nf-zero": "nf-zero levels", "fitted-zero": "fitted-zero levels",
                   "default": "default levels"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), 'gemma-3-270m', 'all-minilm-l6-v2', a local HF folder or a hub id")
    p.add_argument("--bits", type=int, nargs="*", default=[2, 3, 4, 5], choices=[2, 3, 4, 5], help="kbit widths to evaluate")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="dtype of the baseline and the activations (default: bf16 for causal LMs, fp32 for encoders)")
    p.add_argument(
        "--quantize-dtype",
        default="fp32",
        choices=sorted(DTYPES),
        help="dtype the weights are loaded in before they are quantized (fp32: from the checkpoint's precision)",
    )
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--windows", type=int, default=16, help="number of 512-token windows")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--sentences", type=int, default=256, help="sentences scored for an encoder model")
    p.add_argument("--gptq-groups", type=int, nargs="*", default=[],
                   help="add uniform asymmetric GPTQ rows (same calibration data as the calibrated kbit rows) at each of --bits with these group sizes")
    p.add_argument("--rtn-groups", type=int, nargs="*", default=[],
                   help="add uniform asymmetric RTN rows at each of --bits with these group sizes (e.g. 32 64)")
    p.add_argument("--calibration", choices=["off", "on", "both"], default="off",
                   help="kbit rows data-free (off), with calibrated GPTQ-style rounding (on), or both")
    p.add_argument("--act-order", choices=["off", "on", "both"], default="on",
                   help="calibrated kbit and GPTQ rows sweeping the columns by descending Hessian diagonal (on, the "
                        "library's default), in in-feature order (off, labelled so), or both")
    p.add_argument("--calib-sequences", type=int, default=32, help="calibration windows (default text)")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--target-bpw", type=float, nargs="*", default=[],
                   help="add kbit rows with per-layer widths chosen for these mean index bits per weight (e.g. 3.5)")
    p.add_argument("--no-kbit", action="store_true", help="skip the kbit rows (baseline and RTN only)")
    p.add_argument("--no-nf4", action="store_true", help="skip the bitsandbytes NF4 row")
    p.add_argument("--scale-search", choices=["off", "on", "both"], default="off",
                   help="kbit rows with round-up absmax scales (off), with the block scale search (on), or both")
    p.add_argument("--codebook", nargs="+", choices=["nf", "fitted", "both", "nf-zero", "fitted-zero", "default"], default=["nf"],
                   help="kbit rows with the normal-float codebook (nf), levels fitted per layer (fitted), both of those, "
                        "normal-float levels with a zero (nf-zero), fitted levels that keep a zero (fitted-zero), or the "
                        "default per width (default); several may be given")
    p.add_argument("--hadamard-search", type=int, default=1,
                   help="with --hadamard, sign vectors tried per layer (the least quantization error is kept)")
    p.add_argument("--hadamard", choices=["off", "on", "both"], default="off",
                   help="kbit rows without the randomized Hadamard rotation (off), with it (on), or both")
    p.add_argument("--fuse", choices=["off", "on", "both"], default="off",
                   help="kbit rows with each layer's own levels (off), with q/k/v and gate/up quantized with one set "
                        "of levels per group and fused into one GEMM (on: KbitConfig / quantize_model fuse=True), or both")
    p.add_argument("--out", type=Path, help="also write the table (with date, command and machine) to this markdown file")
    return p.parse_args(argv)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def _is_causal_lm(path: str) -> bool:
    """Whether the folder's config names a ``...ForCausalLM`` architecture (else: an encoder)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return any(a.endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or []))


def _load(path: str, dtype: torch.dtype, device: torch.device, quantization_config=None, causal: bool = True):
    from transformers import AutoModel, AutoModelForCausalLM

    start = time.perf_counter()
    auto = AutoModelForCausalLM if causal else AutoModel
    model = auto.from_pretrained(path, dtype=dtype, device_map=str(device), quantization_config=quantization_config)
    model.eval()
    return model, time.perf_counter() - start


class _Scorer:
    """Scores a model against the baseline: perplexity / KL / top-1 (causal) or embedding cosine."""

    def __init__(self, causal: bool, tokenizer, args: argparse.Namespace) -> None:
        self.causal = causal
        self.tokenizer = tokenizer
        if causal:
            self.windows = token_windows(tokenizer, window=args.window, num_windows=args.windows)
            self.headers = ["method", "bits/weight", "perplexity", "KL vs baseline (nats/token)", "top-1 agreement",
                            "quantize / eval (s)", "note"]
        else:
            self.sentences = embedding_sentences(args.sentences)
            self.headers = ["method", "bits/weight", "mean cosine vs baseline", "min cosine", "quantize / eval (s)", "note"]
        self.baseline = None
        self.reference = None

    def set_baseline(self, model) -> object:
        if self.causal:
            start = time.perf_counter()
            self.baseline = reference_log_probs(model, self.windows)  # once, not per variant
            targets = self.windows[:, 1:]
            nll = -sum(float(lp[0].gather(-1, t.unsqueeze(-1)).sum()) for lp, t in zip(self.baseline, targets)) / targets.numel()
            result = EvalResult(math.exp(nll), nll, None, targets.numel(), time.perf_counter() - start)
        else:
            start = time.perf_counter()
            self.reference = sentence_embeddings(model, self.tokenizer, self.sentences)
            result = EmbeddingResult(1.0, 1.0, len(self.sentences), time.perf_counter() - start)
        return result

    def score(self, model):
        if self.causal:
            return evaluate(model, self.windows, reference=self.baseline, progress=True)
        return evaluate_embeddings(model, self.tokenizer, self.sentences, self.reference)

    def row(self, name: str, bits: str, result, load_s: float | None, note: str = "") -> list[str]:
        width = len(self.headers)
        if result is None:
            return [name, bits] + ["-"] * (width - 3) + [note]
        timing = f"{load_s:.0f} / {result.seconds:.0f}" if load_s is not None else f"- / {result.seconds:.0f}"
        if self.causal:
            kl = "0" if result.kl is None else f"{result.kl:.3f}"
            top1 = "1" if result.top1 is None else f"{result.top1:.3f}"
            return [name, bits, f"{result.perplexity:.2f}", kl, top1, timing, note]
        return [name, bits, f"{result.mean_cosine:.4f}", f"{result.min_cosine:.4f}", timing, note]

    def summary(self, result) -> str:
        if self.causal:
            kl = "" if result.kl is None else f", KL {result.kl:.4f}, top-1 {result.top1:.3f}"
            return f"perplexity {result.perplexity:.3f}{kl}"
        return f"mean cosine {result.mean_cosine:.5f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    register()
    device = torch.device(args.device)
    path = resolve_model(args.model)
    causal = _is_causal_lm(path)
    if args.dtype is None:
        args.dtype = "bf16" if causal else "fp32"
    dtype = DTYPES[args.dtype]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    scorer = _Scorer(causal, tokenizer, args)
    what = f"{args.windows} x {args.window} tokens" if causal else f"{args.sentences} sentences"
    print(f"model {args.model} ({path}), {what}, {args.dtype} on {device}", file=sys.stderr)

    rows = []
    baseline, load_s = _load(path, dtype, device, causal=causal)
    base = scorer.set_baseline(baseline)
    del baseline  # its log-probabilities (or embeddings) are kept instead
    gc.collect()
    rows.append(scorer.row(args.dtype, str(torch.finfo(dtype).bits), base, load_s))
    print(f"{args.dtype}: {scorer.summary(base)}", file=sys.stderr)

    def report(name: str, bits: str, model, load_s: float, note: str) -> None:
        result = scorer.score(model)
        rows.append(scorer.row(name, bits, result, load_s, note))
        print(f"{name}: {scorer.summary(result)}", file=sys.stderr)

    def kbit_rows(label: str, width: dict) -> None:
        """The kbit rows of one width setting (``{"bits": K}`` or ``{"target_bpw": t}``)."""
        for option, search, rotate, fuse in [] if args.no_kbit else [
                (o, s, r, f) for o in options for s in searches for r in rotations for f in fusions]:
            name = label + (f", {CODEBOOK_LABELS[option]}" if option != "nf" else "") + (", scale search" if search else "") + (", Hadamard" if rotate else "")
            name += ", fused" if fuse else ""
            if rotate and args.hadamard_search > 1:
                name += f" (best of {args.hadamard_search} signs)"
            cb = {"codebook": None if option == "nf" else option}  # None: the normal-float levels (not the default)
            if False in calibrations:
                config = KbitConfig(**width, **cb, scale_search=search, hadamard=rotate, hadamard_search=args.hadamard_search if rotate else 1,
                                    **({"fuse": True} if fuse else {}))
                model, load_s = _load(path, DTYPES[args.quantize_dtype], device, config, causal=causal)
                model.to(dtype)  # casts what stayed dense; the quantized tensors keep their dtypes
                report(name, f"{stored_bits_per_weight(model):.2f}", model, load_s, "quantized at load")
                del model
                gc.collect()
            for act_order in act_orders if True in calibrations else []:
                model, load_s = _load(path, DTYPES[args.quantize_dtype], device, causal=causal)
                start = time.perf_counter()
                calib = Calibration(tokenizer=tokenizer, num_sequences=args.calib_sequences, seq_len=args.calib_len,
                                    act_order=act_order)
                quantize_model(model, **width, **cb, scale_search=search, calibration=calib, hadamard=rotate,
                               hadamard_search=args.hadamard_search if rotate else 1, **({"fuse": True} if fuse else {}))
                quantize_s = time.perf_counter() - start
                model.to(dtype)
                report(f"{name}, calibrated" + ("" if act_order else ", in-feature order"), f"{stored_bits_per_weight(model):.2f}",
                       model, quantize_s, f"GPTQ-style, {args.calib_sequences} x {args.calib_len} tokens of stdlib docstrings")
                del model
                gc.collect()

    searches = {"off": [False], "on": [True], "both": [False, True]}[args.scale_search]
    calibrations = {"off": [False], "on": [True], "both": [False, True]}[args.calibration]
    act_orders = {"off": [False], "on": [True], "both": [True, False]}[args.act_order]
    rotations = {"off": [False], "on": [True], "both": [False, True]}[args.hadamard]
    fusions = {"off": [False], "on": [True], "both": [False, True]}[args.fuse]
    options = list(dict.fromkeys(o for c in args.codebook for o in (("nf", "fitted") if c == "both" else (c,))))
    for bits in args.bits:
        kbit_rows(f"kbit K={bits}", {"bits": bits})
        for group in args.gptq_groups:
            for act_order in act_orders:  # the same sweep orders as the calibrated kbit rows
                model, load_s = _load(path, DTYPES[args.quantize_dtype], device, causal=causal)
                start = time.perf_counter()
                calib = Calibration(tokenizer=tokenizer, num_sequences=args.calib_sequences, seq_len=args.calib_len,
                                    act_order=act_order)
                apply_gptq(model, bits, group, calib)
                model.to(dtype)
                report(f"GPTQ asym {bits}-bit g{group}" + ("" if act_order else ", in-feature order"),
                       f"{rtn_bits_per_weight(bits, group):.2f}", model, time.perf_counter() - start,
                       f"fake-quantized, {args.calib_sequences} x {args.calib_len} tokens of stdlib docstrings")
                del model
                gc.collect()
        for group in args.rtn_groups:
            model, load_s = _load(path, DTYPES[args.quantize_dtype], device, causal=causal)
            start = time.perf_counter()
            apply_rtn(model, bits, group)
            model.to(dtype)
            report(f"RTN asym {bits}-bit g{group}", f"{rtn_bits_per_weight(bits, group):.2f}", model,
                   time.perf_counter() - start, "fake-quantized (fp16 scale + zero per group)")
            del model
            gc.collect()

    for target in args.target_bpw:
        kbit_rows(f"kbit target_bpw={target:g} (per-layer K 2..5)", {"target_bpw": target})
    if not args.no_nf4:
        rows.append(_nf4_row(path, dtype, device, scorer, causal))

    table = markdown_table(scorer.headers, rows)
    print(table)
    if args.out is not None:
        command = "python3 " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
        import transformers

        if causal:
            text = (f"- text: CPython {platform.python_version()} `pydoc_data.topics` (sorted keys, blank-line joined), "
                    f"first {args.windows} non-overlapping {args.window}-token windows, no special tokens "
                    f"({base.tokens} scored tokens)")
        else:
            text = (f"- text: the first {args.sentences} sentences of 6-60 words of CPython {platform.python_version()} "
                    "`pydoc_data.topics`; embedding = mean of the last hidden states over the tokens, normalized")
        lines = [
            f"# Accuracy: {DEFAULT_MODEL if args.model == 'default' else args.model}",
            "",
            f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- command: `{command}`",
            f"- device: {_device_name(device)}",
            f"- python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
            text,
            f"- every `nn.Linear` quantized except `lm_head`/tied embeddings, from weights loaded in "
            f"{args.quantize_dtype}; baseline and activations {args.dtype}",
            "- bits/weight: kbit rows as stored (planes + E4M4 scales + codebook + tensor scale over the true weight "
            "count, padding to 64 x 128 tiles included); RTN rows bits + 32/group (fp16 scale and zero)",
            "",
            table,
            "",
        ]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _nf4_row(path: str, dtype: torch.dtype, device: torch.device, scorer: _Scorer, causal: bool) -> list[str]:
    """bitsandbytes NF4 (blocksize 64) through transformers, or a row saying why not."""
    bnb, why = optional_import("bitsandbytes")
    if bnb is None:
        return scorer.row("bitsandbytes NF4", "4.5", None, None, f"not run: {why}")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    try:
        model, load_s = _load(path, dtype, device, config, causal=causal)
        result = scorer.score(model)
    except Exception as e:  # bitsandbytes builds differ in which devices they support
        return scorer.row("bitsandbytes NF4", "4.5", None, None, f"not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return scorer.row("bitsandbytes NF4 (blocksize 64)", "4.5", result, load_s, f"bitsandbytes {bnb.__version__}")


if __name__ == "__main__":
    sys.exit(main())
