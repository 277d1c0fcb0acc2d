"""Decode-step time of kbit layers on one GPU against tensor parallelism over several.

    torchrun --nproc_per_node 2 scripts/bench_tensor_parallel.py                # Llama-3-8B shapes, K = 4
    torchrun --nproc_per_node 2 scripts/bench_tensor_parallel.py --head --modes eager compiled graphed
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
With ``--head`` the final RMSNorm and a dense head over Llama-3's vocabulary are timed the same
way, as a second step (split by columns, the logits all-gathered).

Timing: ``--iters`` steps back to back between CUDA events (``time.perf_counter`` on CPU), after
``--warmup`` steps, median of ``--repeats``; all ranks start together after a barrier. Rank 0
writes ``--json`` and ``--md`` (default ``bench/results/tensor-parallel-<gpu>.{json,md}``). The
per-token figures extrapolate the measured layers to the 32 of Llama-3-8B, plus the head step
when timed (no attention or embedding). Modes: ``eager`` and ``compiled`` include the host's
time per kernel; ``graphed`` (the compiled step captured once in a CUDA graph) is the GPU's.
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
LLAMA3_8B_VOCAB = 128256
MODES = ("eager", "compiled", "graphed")


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The same random model on every rank, quantized on ``device``."""
    torch.manual_seed(0)
    shapes = SMOKE if args.smoke else LLAMA3_8B
    # the head is timed only with --head; without it a small vocabulary saves memory
    vocab = (LLAMA3_8B_VOCAB if not args.smoke else 4096) if args.head else 1024
    config = LlamaConfig(num_hidden_layers=args.layers, vocab_size=vocab, tie_word_embeddings=False, **shapes)
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


def _head_fn(model: LlamaForCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
    """The step after the last layer: final RMSNorm and the head (kept dense, as quantize_model does)."""
    norm, head = model.model.norm, model.lm_head

    def step(h: torch.Tensor) -> torch.Tensor:
        return head(norm(h))

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


def _graphed(step: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``step`` captured once into a CUDA graph on ``h``; the returned function replays it.

    This is how a served decode step runs: no host time per kernel, so the step costs what its
    kernels and collectives cost on the GPU (NCCL's all-reduce is captured like any kernel).
    """
    graph, out = bc.capture_graph(lambda: step(h), warmup=3)  # warm-up: compilation, workspaces, NCCL set-up

    def replay(_: torch.Tensor) -> torch.Tensor:
        graph.replay()
        return out

    return replay


def _measure(step: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, args: argparse.Namespace,
             group: Any | None) -> dict[str, Any]:
    """Times of ``step`` in each of ``args.modes`` and its output."""
    result: dict[str, Any] = {}
    with torch.no_grad():
        out = step(h).float()
        compiled = None
        for mode in args.modes:
            if mode == "eager":
                fn = step
            else:
                if compiled is None:
                    torch._dynamo.reset()
                    compiled = torch.compile(step, mode=args.compile_mode, fullgraph=True)
                fn = compiled if mode == "compiled" else _graphed(compiled, h)
            result[f"{mode}_ms"] = statistics.median(_time(fn, h, args, group))
    return {**result, "out": out}


def _report(args: argparse.Namespace, env: dict[str, Any], rows: list[dict[str, Any]], world: int) -> None:
    """Write the JSON and markdown results (rank 0)."""
    scale = LLAMA3_8B_LAYERS / args.layers
    head = {(r["batch"], mode): (r[f"one_{mode}_ms"], r[f"tp_{mode}_ms"]) for r in rows if r["part"] == "head"
            for mode in args.modes}
    table = []
    for r in rows:
        for mode in args.modes:
            one, tp = r[f"one_{mode}_ms"], r[f"tp_{mode}_ms"]
            cells = [r["part"], r["batch"], mode, bc.fmt(one, 3), bc.fmt(tp, 3), bc.fmt(one / tp, 2)]
            if r["part"] == "layers":  # a whole model's step: 32 layers (+ the head when timed)
                one_model = one * scale + head.get((r["batch"], mode), (0.0, 0.0))[0]
                tp_model = tp * scale + head.get((r["batch"], mode), (0.0, 0.0))[1]
                cells += [bc.fmt(r["batch"] * 1e3 / one_model, 0), bc.fmt(r["batch"] * 1e3 / tp_model, 0),
                          bc.fmt(one_model / tp_model, 2)]
            else:
                cells += ["", "", ""]
            table.append(cells + [f"{r['max_rel_diff']:.1e}"])
    model_words = f"32 layers{' + head' if args.head else ''}"
    text = "\n".join([
        f"# Tensor parallelism: decode step of {args.layers} {'tiny (--smoke)' if args.smoke else 'Llama-3-8B-shaped'} layers, "
        f"K = {args.bits}, 1 vs {world} GPUs",
        "",
        *bc.env_lines(env),
        f"- step: per layer RMSNorm, q/k/v, o_proj (+ all-reduce), RMSNorm, gate/up, SiLU*up, down (+ all-reduce), "
        f"residuals; no attention or embedding; {args.iters} steps between events, median of {args.repeats}",
        "- head (with --head): final RMSNorm and the dense bf16 head over Llama-3's 128256 tokens (split by "
        "columns, logits all-gathered)",
        f"- modes: eager = the step as written; compiled = torch.compile(mode={args.compile_mode!r}, fullgraph=True); "
        "graphed = the compiled step captured in one CUDA graph and replayed (GPU time, no host time per kernel)",
        f"- model tok/s: batch / (layers step x {LLAMA3_8B_LAYERS}/{args.layers}"
        f"{' + head step' if args.head else ''}), no attention",
        f"- decoder-layer weights per rank: {rows[0]['one_bytes']:,} bytes whole, {rows[0]['tp_bytes']:,} bytes per rank split",
        "",
        bc.markdown_table(["part", "batch", "mode", "1 GPU (ms)", f"{world} GPUs (ms)", "speed-up",
                           f"1 GPU tok/s ({model_words})", f"{world} GPUs tok/s ({model_words})", "model speed-up",
                           "max rel. diff of the output"], table),
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
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES,
                        help="eager: the step as written; compiled: torch.compile(step, fullgraph=True); "
                             "graphed: the compiled step captured in one CUDA graph and replayed (GPU time only)")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode for compiled and graphed")
    parser.add_argument("--head", action="store_true",
                        help="also time the final norm and a dense head of Llama-3's vocabulary (128256; split by columns, "
                             "logits all-gathered) and add it to the tokens/s")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script; CPU with gloo allowed)")
    parser.add_argument("--json", help="results JSON (default bench/results/tensor-parallel-<gpu>.json)")
    parser.add_argument("--md", help="results markdown (default bench/results/tensor-parallel-<gpu>.md)")
    args = parser.parse_args()
    if "graphed" in args.modes and args.compile_mode in ("reduce-overhead", "max-autotune"):
        parser.error(f"--compile-mode {args.compile_mode} captures CUDA graphs itself: the graphed mode would nest them")

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
    parts = {"layers": _step_fn(model), **({"head": _head_fn(model)} if args.head else {})}
    whole: dict[tuple[str, int], dict[str, Any]] = {}
    if rank == 0:
        whole = {(part, b): _measure(fn, h, args, None) for part, fn in parts.items() for b, h in inputs.items()}
    dist.barrier()

    kbit_linear.shard_for_tensor_parallel(model)
    if use_cuda:
        torch.cuda.empty_cache()
    tp_bytes = sum(t.numel() * t.element_size() for t in (*model.model.layers.parameters(), *model.model.layers.buffers()))
    rows = []
    for part, fn in parts.items():
        for b, h in inputs.items():
            split = _measure(fn, h, args, dist.group.WORLD)
            if rank == 0:
                ref = whole[(part, b)]
                row = {"part": part, "batch": b, "one_bytes": one_bytes, "tp_bytes": tp_bytes,
                       "max_rel_diff": float((split["out"] - ref["out"]).abs().max() / ref["out"].abs().max())}
                for mode in args.modes:
                    row[f"one_{mode}_ms"], row[f"tp_{mode}_ms"] = ref[f"{mode}_ms"], split[f"{mode}_ms"]
                rows.append(row)
    if rank == 0:
        _report(args, env, rows, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
