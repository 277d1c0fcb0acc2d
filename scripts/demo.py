#!/usr/bin/env python3
"""The kbit_linear demo: quantize a real model at load, save it, reload it, generate, measure.

Steps (on the embedded SmolLM2-135M-Instruct unless ``--model`` names another):

1. load the unquantized model in bf16 (the baseline), time a greedy generation and score it;
2. load it again with ``quantization_config=KbitConfig(bits=4)``: every ``nn.Linear`` except
   ``lm_head`` is quantized as its weight is read;
3. ``save_pretrained`` the quantized model, reload it from disk (no re-quantization) and check
   that its logits are bit-identical to the model before saving;
4. answer a prompt with the reloaded model (chat template, greedy decoding);
5. for the embedded model, load its GGUF file again with :func:`kbit_linear.load_gguf`, which
   keeps the Q4_1/Q8_0 blocks as they are (no second rounding): its logits must equal the
   baseline's, which is that GGUF dequantized;
6. print a table: sizes, load and quantize time, tokens/s, perplexity and KL divergence.

Perplexity uses the text and windows of :mod:`kbit_linear.tools.evaluation` (CPython's
``pydoc_data.topics``, non-overlapping 512-token windows). The demo scores the first 4 windows
to stay within a few minutes on a laptop CPU; ``--ppl-windows 16`` gives the figures of
``scripts/eval_ppl.py``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from _bench_common import markdown_table  # (importing it puts the repo on sys.path)

from kbit_linear.tools.evaluation import evaluate, stored_bits_per_weight, token_windows
from kbit_linear.integrations.transformers import KbitConfig, register
from kbit_linear.linear import KbitLinear
from kbit_linear.gguf_loader import load_gguf
from kbit_linear.tools.models import DEFAULT_MODEL, find_default_gguf, resolve_model
from kbit_linear.patch import module_bytes

DEFAULT_PROMPT = "In two sentences, what is a large language model?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, no network), a local HF folder or a hub id")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5])
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ppl-windows", type=int, default=4, help="512-token windows to score (16 = the eval_ppl setting)")
    p.add_argument("--device", default="cpu", help="'cpu' or a CUDA device such as 'cuda'")
    p.add_argument("--save-dir", type=Path, help="keep the quantized checkpoint here (default: a temporary folder)")
    return p.parse_args(argv)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> tuple[str, int, float]:
    """Greedy answer to ``prompt`` through the chat template: (text, new tokens, seconds).

    A 2-token generation runs first so one-time costs (allocator, kernel compilation) stay out
    of the timing.
    """
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    _sync(device)
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True).strip(), int(new.numel()), seconds


def _checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1 or args.ppl_windows < 1:
        raise SystemExit("--max-new-tokens and --ppl-windows must be >= 1")
    register()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = torch.device(args.device)
    dtype = torch.bfloat16

    t = time.perf_counter()
    path = resolve_model(args.model)
    prepare_s = time.perf_counter() - t
    _say(f"model: {args.model} -> {path} ({prepare_s:.1f} s to locate/convert)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    windows = token_windows(tokenizer, num_windows=args.ppl_windows)

    # 1. the baseline
    _say("loading the bf16 baseline ...")
    t = time.perf_counter()
    baseline = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device)).eval()
    base_load_s = time.perf_counter() - t
    _, base_tokens, base_gen_s = _generate(baseline, tokenizer, args.prompt, args.max_new_tokens, device)
    _say(f"scoring the baseline on {args.ppl_windows} x 512 tokens ...")
    base_eval = evaluate(baseline, windows)

    # 2. quantize at load
    _say(f"loading with KbitConfig(bits={args.bits}) (quantizes every linear layer as it is read) ...")
    t = time.perf_counter()
    quantized = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map=str(device), quantization_config=KbitConfig(bits=args.bits)
    ).eval()
    _sync(device)
    quant_load_s = time.perf_counter() - t
    n_layers = sum(isinstance(m, KbitLinear) for m in quantized.modules())
    probe = windows[:1, :64].to(device)
    with torch.inference_mode():
        probe_before = quantized(probe).logits

    # 3. save and reload
    save_dir = args.save_dir or Path(tempfile.mkdtemp(prefix="kbit-demo-"))
    try:
        t = time.perf_counter()
        quantized.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
        save_s = time.perf_counter() - t
        disk_bytes = _checkpoint_bytes(save_dir)
        quant_bytes = module_bytes(quantized)
        del quantized
        _say(f"saved to {save_dir}; reloading from disk ...")
        t = time.perf_counter()
        reloaded = AutoModelForCausalLM.from_pretrained(save_dir, device_map=str(device)).eval()
        _sync(device)
        reload_s = time.perf_counter() - t
        with torch.inference_mode():
            identical = torch.equal(reloaded(probe).logits, probe_before)

        # 4. answer the prompt
        _say("generating ...")
        answer, q_tokens, q_gen_s = _generate(reloaded, tokenizer, args.prompt, args.max_new_tokens, device)
        _say(f"scoring the {args.bits}-bit model on {args.ppl_windows} x 512 tokens ...")
        q_eval = evaluate(reloaded, windows, reference=baseline)
        bpw = stored_bits_per_weight(reloaded)
    finally:
        if args.save_dir is None:
            shutil.rmtree(save_dir, ignore_errors=True)

    # 5. the GGUF file kept quantized (the embedded model only: its baseline is that GGUF)
    kept = None
    if args.model == "default":
        _say("loading the GGUF file kept quantized (load_gguf) ...")
        t = time.perf_counter()
        gguf_model = load_gguf(find_default_gguf(), dtype=dtype, device=device, progress=False).eval()
        _sync(device)
        gguf_load_s = time.perf_counter() - t
        with torch.inference_mode():
            gguf_identical = torch.equal(gguf_model(probe).logits, baseline(probe).logits)
        _, g_tokens, g_gen_s = _generate(gguf_model, tokenizer, args.prompt, args.max_new_tokens, device)
        _say(f"scoring the GGUF model on {args.ppl_windows} x 512 tokens ...")
        g_eval = evaluate(gguf_model, windows, reference=baseline)
        report = gguf_model.gguf_load_report
        kept = {"bytes": module_bytes(gguf_model), "load_s": gguf_load_s, "identical": gguf_identical,
                "tok_s": g_tokens / g_gen_s, "eval": g_eval, "kept": len(report.by_action().get("kept", []))}
        del gguf_model

    # 6. the table
    base_bytes = module_bytes(baseline)
    rows = [
        ["model size in memory (bytes; fp16 = bf16)", f"{base_bytes:,}", f"{quant_bytes:,}"],
        ["checkpoint on disk (bytes)", "-", f"{disk_bytes:,}"],
        ["bits per quantized weight (stored)", "16", f"{bpw:.2f}"],
        ["load time (s)", f"{base_load_s:.1f}", f"{quant_load_s:.1f} (load + quantize {n_layers} layers)"],
        ["save / reload from disk (s)", "-", f"{save_s:.1f} / {reload_s:.1f}"],
        ["reloaded logits identical to before saving", "-", "yes" if identical else "NO"],
        ["generation (tokens/s)", f"{base_tokens / base_gen_s:.2f}", f"{q_tokens / q_gen_s:.2f}"],
        [f"perplexity ({args.ppl_windows} x 512 tokens of pydoc_data.topics)", f"{base_eval.perplexity:.2f}", f"{q_eval.perplexity:.2f}"],
        ["KL divergence vs bf16 (nats/token)", "0", f"{q_eval.kl:.3f}"],
    ]
    print(f"\nprompt: {args.prompt}")
    print(f"answer ({args.bits}-bit, reloaded from disk): {answer}\n")
    name = DEFAULT_MODEL if args.model == "default" else args.model
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name} on {where}, activations bf16:\n")
    headers = ["", "bf16", f"kbit {args.bits}-bit"]
    if kept is not None:
        headers.append("GGUF Q4_1 kept (load_gguf)")
        extra = [f"{kept['bytes']:,}", "-", "5 (Q4_1), 8.5 (Q8_0 embedding)",
                 f"{kept['load_s']:.1f} ({kept['kept']} tensors kept as stored)", "-",
                 "logits identical to bf16: " + ("yes" if kept["identical"] else "NO"), f"{kept['tok_s']:.2f}",
                 f"{kept['eval'].perplexity:.2f}", f"{kept['eval'].kl:.3f}"]
        rows = [row + [value] for row, value in zip(rows, extra)]
    print(markdown_table(headers, rows))
    ok = identical and (kept is None or kept["identical"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
