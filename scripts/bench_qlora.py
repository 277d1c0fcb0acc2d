"""QLoRA step time and peak memory on a Llama-3-8B-shaped model (random weights, no download).

For each variant (bf16 LoRA; kbit K bits through ``kbit_linear.quantize_model``; bitsandbytes NF4
when it imports), the model is built on the GPU (``bench_generate.py``'s builder), gradient
checkpointing is enabled (non-reentrant), LoRA of rank ``--rank`` goes on every projection of
every layer (q, k, v, o, gate, up, down; ``lm_head`` stays bf16 and frozen), and ``--steps``
AdamW steps of one sequence of ``--seq`` random tokens are timed after two warm-up steps.

Reported per variant: median step time (forward + backward + optimizer), peak allocated GPU
memory during the timed steps, the loss of the first and last step (random tokens: it only
has to be finite and move), and the model's bytes.

Usage::

    python3 scripts/bench_qlora.py --json out.json --md out.md
    python3 scripts/bench_qlora.py --models kbit4 --seq 512 --layers 4
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)
import bench_generate as bg  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_variant(name: str, args: argparse.Namespace, libs: dict[str, Any]) -> dict[str, Any]:
    import peft

    device = torch.device("cuda")
    model = bg.build_variant(name, bg.llama3_8b_config(args.layers), device, libs)
    weights = bg.model_bytes(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    if name.startswith("kbit"):
        from kbit_linear.integrations.peft import register_lora_layers

        register_lora_layers(config)
    model = peft.get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, 128256, (1, args.seq), device=device, generator=g)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(), step()]  # warm-up: compiles kernels, allocates optimizer state
    if args.profile:
        print_profile(name, step)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    row = {
        "model": name, "seq": args.seq, "rank": args.rank, "layers": args.layers,
        "step_s": statistics.median(times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_first": losses[0], "loss_last": losses[-1], "trainable_params": sum(p.numel() for p in params),
        "model_gb": weights["total"] / 1e9,
    }
    del model, opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def print_profile(name: str, step: Any, rows: int = 20) -> None:
    """Print the GPU kernels of one step, most time first (``--profile``): where the step goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"# profile of one {name} step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bf16", "kbit4", "bnb-nf4"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the GPU kernels of one step per variant")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    dev = bc.require_cuda()
    env = bc.environment(dev)
    bnb, why = bc.optional_import("bitsandbytes")
    libs = {"bitsandbytes": bnb}
    rows, notes = [], []
    for name in args.models:
        if name == "bnb-nf4" and bnb is None:
            notes.append(f"bnb-nf4 not measured: {why}")
            continue
        rows.append(run_variant(name, args, libs))
        r = rows[-1]
        print(f"# {name}: {r['step_s'] * 1e3:.0f} ms/step, peak {r['peak_gib']:.1f} GiB, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}",
              flush=True)
    head = ["# QLoRA step on a Llama-3-8B-shaped model", ""] + bc.env_lines(env) + [
        f"- Llama-3-8B shape, {args.layers} layers, random weights; LoRA r = {args.rank} on q/k/v/o/gate/up/down of every layer; "
        f"one sequence of {args.seq} random tokens per step; gradient checkpointing (non-reentrant); AdamW; "
        f"median of {args.steps} steps after 2 warm-up steps; peak = max allocated GPU memory during the timed steps.",
        *[f"- {n}" for n in notes], ""]
    table = bc.markdown_table(["model", "ms/step", "peak GiB", "model GB", "loss first -> last", "trainable params"],
                              [[r["model"], f"{r['step_s'] * 1e3:.0f}", f"{r['peak_gib']:.1f}", f"{r['model_gb']:.2f}",
                                f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}", f"{r['trainable_params'] / 1e6:.1f} M"] for r in rows])
    text = "\n".join(head) + "\n" + table + "\n"
    print(text)
    if args.json:
        bc.write_json(args.json, {"environment": env, "rows": rows, "notes": notes})
    if args.md:
        bc.write_text(args.md, text)


if __name__ == "__main__":
    main()
