#!/usr/bin/env python3
"""Quantize a mixture-of-experts model (experts included) and generate a few tokens.

    python3 examples/moe.py                       # a random Qwen3-MoE-shaped model, 4 bits, CPU (or CUDA if present)
    python3 examples/moe.py --bits 3 --experts 32 --layers 4 --max-new-tokens 16
    python3 examples/moe.py --fuse                # q/k/v as one GEMM, each router as one kernel

The model is built from a scaled-down Qwen3-30B-A3B config with random weights (no download):
Qwen3-30B-A3B has hidden size 2048, 128 experts of intermediate size 768, 8 of them per token, 48
layers; here hidden 256, 16 experts of 128, 4 per token, 2 layers. ``quantize_model`` replaces
every ``nn.Linear`` by a ``KbitLinear`` and every experts module (``Qwen3MoeExperts``, whose
``gate_up_proj`` / ``down_proj`` are 3-D weights, not ``nn.Linear``) by a ``KbitExperts``. The
summary shows the experts' bytes before and after; the script then compares the logits with the
dense model's (random weights: the number only shows the quantization is sane) and generates
greedily. ``--fuse`` also runs the attention's q/k/v projections as one GEMM and each MoE router
(softmax top-k) as one kernel on a GPU (``fuse_routers``; the summary lists them).
For a checkpoint on disk, ``from_pretrained(path, quantization_config=KbitConfig(bits=4))``
does the same at load (``examples/from_pretrained.py``).
"""

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from kbit_linear import quantize_model
from kbit_linear.patch import module_bytes

parser = argparse.ArgumentParser(description="Quantize a random MoE model with kbit_linear and generate.")
parser.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5])
parser.add_argument("--experts", type=int, default=16)
parser.add_argument("--top-k", type=int, default=4)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=8)
parser.add_argument("--fuse", action="store_true", help="fuse q/k/v into one GEMM and each router into one kernel")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

config = Qwen3MoeConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=args.experts,
    num_experts_per_tok=args.top_k,
    norm_topk_prob=True,
    num_hidden_layers=args.layers,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
torch.manual_seed(0)
dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).eval()
dense = copy.deepcopy(model)
print(f"dense model: {module_bytes(model):,} bytes, {sum(p.numel() for p in model.parameters()):,} parameters")

summary = quantize_model(model, bits=args.bits, fuse=args.fuse)
print(summary)
print(model.model.layers[0].mlp)

prompt = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
with torch.inference_mode():
    got, ref = model(prompt).logits.float(), dense(prompt).logits.float()
    print(f"\nlogits vs the dense model: relative difference {((got - ref).norm() / ref.norm()).item():.3f}")
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
new = out[0, prompt.shape[1] :]
print(f"generated token ids: {new.tolist()}")
print(f"{new.numel()} tokens in {seconds:.2f} s ({new.numel() / seconds:.1f} tokens/s), {args.bits} bits on {args.device}")
