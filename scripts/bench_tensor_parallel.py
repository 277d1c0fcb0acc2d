"""Decode-step time of kbit layers on one GPU against tensor parallelism over several.

    torchrun --nproc_per_node 2 scripts/bench_tensor_parallel.py                # Llama-3-8B shapes, K = 4
    torchrun --nproc_per_node 2 scripts/bench_tensor_parallel.py --compile      # + torch.compile'd step
    torchrun --nproc_per_node 2 scripts/bench_tensor_parallel.py --smoke        # tiny shapes, CPU/gloo allowed

Every rank builds the same random Llama with Llama-3-8B layer shapes (hidden 4096, MLP 14336,
32 query / 8 key-value heads of 128; ``--layers`` decoder layers, 4 by default), quantizes it at
``--bits`` with the CUDA kernels and times one *decode step of the projection stack*: for each
decoder layer, RMSNorm -> q/k/v -> o_proj (the attention itself is left out: at short contexts
it is small next to the weights, and it does not change with the split) -> residual ->
RMSNorm -> gate/up -> SiLU * up -> down -> residual, for ``--batch`` tokens at once. First rank
0 alone runs it on the whole model (one GPU), then the model is split with
``kbit_linear.shard_for_tensor_parallel`` and every rank runs its shard, with the all-reduces
after o_proj and down_proj. The output of the split step is compared with the whole step's.

Timing: ``--iters`` steps back to back between CUDA events (``time.perf_counter`` on CPU), after
``--warmup`` steps, median of ``--repeats``; all ranks start together after a barrier. Rank 0
writes ``--json`` and ``--md`` (default ``bench/results/tensor-parallel-<gpu>.{json,md}``). The
per-token figures extrapolate the measured layers to the 32 of Llama-3-8B (linear layers only:
no attention, embedding or head).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (puts the checkout on sys.path)

import kbit_linear  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
SMOKE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
LLAMA3_8B_LAYERS = 32


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The same random model on every rank, quantized on ``device``."""
    torch.manual_seed(0)
    shapes = SMOKE if args.smoke else LLAMA3_8B
    # a small vocabulary: the embedding and head are not part of the timed step
    config = LlamaConfig(num_hidden_layers=args.layers, vocab_size=1024, **shapes)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    kbit_linear.quantize_model(model, bits=args.bits, progress=False)
    return model.eval()


def _step_fn(model: LlamaForCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
    """One decode step of the projection stack (see the module docstring)."""
    layers = list(model.model.layers)

    def step(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            q = attn.q_proj(x)
            attn.k_proj(x)
            attn.v_proj(x)
            h = h + attn.o_proj(q)  # q stands in for the attention output (same width)
            x = layer.post_attention_layernorm(h)
            h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return h

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, args: argparse.Namespace,
          group: Any | None) -> list[float]:
    """Per-step milliseconds, one value per repeat."""
    device = h.device
    for _ in range(args.warmup):
        step(h)
    per_step = []
    for _ in range(args.repeats):
        _sync(device)
        if group is not None:
            dist.barrier(group=group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step(h)
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) / args.iters)
        else:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(h)
            per_step.append((time.perf_counter() - t0) * 1e3 / args.iters)
    return per_step


def _measure(model: LlamaForCausalLM, h: torch.Tensor, args: argparse.Namespace, group: Any | None) -> dict[str, Any]:
    """Eager (and, with --compile, compiled) step times and the step's output."""
    step = _step_fn(model)
    with torch.no_grad():
        out = step(h).float()
        result = {"eager_ms": statistics.median(_time(step, h, args, group))}
        if args.compile:
            torch._dynamo.reset()
            compiled = torch.compile(step, mode=args.compile_mode, fullgraph=True)
            result["compiled_ms"] = statistics.median(_time(compiled, h, args, group))
    return {**result, "out": out}


def _report(args: argparse.Namespace, env: dict[str, Any], rows: list[dict[str, Any]], world: int) -> None:
    """Write the JSON and markdown results (rank 0)."""
    modes = ["eager"] + (["compiled"] if args.compile else [])
    table = []
    for r in rows:
        for mode in modes:
            one, tp = r[f"one_{mode}_ms"], r[f"tp_{mode}_ms"]
            scale = LLAMA3_8B_LAYERS / args.layers
            table.append([r["batch"], mode, bc.fmt(one, 3), bc.fmt(tp, 3), bc.fmt(one / tp, 2),
                          bc.fmt(r["batch"] * 1e3 / (one * scale), 0), bc.fmt(r["batch"] * 1e3 / (tp * scale), 0),
                          f"{r['max_rel_diff']:.1e}"])
    text = "\n".join([
        f"# Tensor parallelism: decode step of {args.layers} {'tiny (--smoke)' if args.smoke else 'Llama-3-8B-shaped'} layers, "
        f"K = {args.bits}, 1 vs {world} GPUs",
        "",
        *bc.env_lines(env),
        f"- step: per layer RMSNorm, q/k/v, o_proj (+ all-reduce), RMSNorm, gate/up, SiLU*up, down (+ all-reduce), "
        f"residuals; no attention, embedding or head; {args.iters} steps between events, median of {args.repeats}",
        f"- tok/s columns: batch / (step time x {LLAMA3_8B_LAYERS}/{args.layers}), the 32 layers' projections only",
        f"- weights per rank: {rows[0]['one_bytes']:,} bytes whole, {rows[0]['tp_bytes']:,} bytes per rank split",
        "",
        bc.markdown_table(["batch", "step", "1 GPU (ms)", f"{world} GPUs (ms)", "speed-up", "1 GPU tok/s (32 layers)",
                           f"{world} GPUs tok/s (32 layers)", "max rel. diff of the output"], table),
        "",
        "`scripts/bench_tensor_parallel.py`; the split is `kbit_linear.shard_for_tensor_parallel` with the model's own plan.",
    ])
    bc.write_json(args.json, {"environment": env, "args": {k: v for k, v in vars(args).items() if k not in ("json", "md")},
                              "world_size": world, "rows": rows})
    bc.write_text(args.md, text + "\n")
    print(text)


def main() -> None:
    """Parse, build, time whole on rank 0, split, time split on every rank, report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Llama-3-8B has 32)")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="tokens per decode step")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(step, fullgraph=True)")
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                        help="torch.compile mode (e.g. reduce-overhead for CUDA graphs)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script; CPU with gloo allowed)")
    parser.add_argument("--json", help="results JSON (default bench/results/tensor-parallel-<gpu>.json)")
    parser.add_argument("--md", help="results markdown (default bench/results/tensor-parallel-<gpu>.md)")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if not use_cuda and not args.smoke:
        sys.exit(f"needs {world} CUDA GPUs (one per rank); --smoke runs tiny shapes on the CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    rank = dist.get_rank()
    dtype = torch.bfloat16 if use_cuda else torch.float32
    if use_cuda:
        env = bc.environment(device)
        tag = env["gpu"].lower().replace("nvidia ", "").split()[0]
    else:
        env = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": "cpu", "sm_count": 0,
               "l2_bytes": 0, "gpu_memory_gib": 0, "driver": None, "cuda_runtime": None, "python": sys.version.split()[0],
               "torch": torch.__version__, "cupy": None, "triton": None, "transformers": None, "bitsandbytes": None,
               "gemlite": None, "command": " ".join(sys.argv)}
        tag = "cpu-smoke"
    args.json = args.json or str(bc.REPO_ROOT / "bench" / "results" / f"tensor-parallel-{tag}.json")
    args.md = args.md or str(bc.REPO_ROOT / "bench" / "results" / f"tensor-parallel-{tag}.md")
    env["command"] = f"torchrun --nproc_per_node {world} " + " ".join(sys.argv)

    model = _build(args, device, dtype)
    hidden = model.config.hidden_size
    inputs = {b: torch.randn(b, hidden, generator=torch.Generator().manual_seed(b)).to(device, dtype) for b in args.batch}
    one_bytes = sum(t.numel() * t.element_size() for t in (*model.model.layers.parameters(), *model.model.layers.buffers()))

    # one GPU: rank 0 alone, the others wait
    whole: dict[int, dict[str, Any]] = {}
    if rank == 0:
        whole = {b: _measure(model, h, args, None) for b, h in inputs.items()}
    dist.barrier()

    kbit_linear.shard_for_tensor_parallel(model)
    if use_cuda:
        torch.cuda.empty_cache()
    tp_bytes = sum(t.numel() * t.element_size() for t in (*model.model.layers.parameters(), *model.model.layers.buffers()))
    rows = []
    for b, h in inputs.items():
        split = _measure(model, h, args, dist.group.WORLD)
        if rank == 0:
            ref = whole[b]
            row = {"batch": b, "one_bytes": one_bytes, "tp_bytes": tp_bytes,
                   "max_rel_diff": float((split["out"] - ref["out"]).abs().max() / ref["out"].abs().max())}
            for mode in ("eager", "compiled"):
                if f"{mode}_ms" in ref:
                    row[f"one_{mode}_ms"], row[f"tp_{mode}_ms"] = ref[f"{mode}_ms"], split[f"{mode}_ms"]
            rows.append(row)
    if rank == 0:
        _report(args, env, rows, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
