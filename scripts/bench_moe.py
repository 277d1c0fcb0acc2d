"""Time one mixture-of-experts layer's experts: kbit ``KbitExperts`` against transformers' bf16 experts.

Shapes of issue 17 (random weights, no download): a Qwen3-30B-A3B MoE layer (128 experts, top-8,
hidden 2048, expert intermediate 768) and a Mixtral-8x7B one (8 experts, top-2, hidden 4096,
intermediate 14336). For each shape and token count T, the same random routing (top-k distinct
experts per token, softmax weights) goes to:

- transformers' experts module in bf16 with each implementation it offers (``eager``,
  ``batched_mm``, ``grouped_mm`` where torch has it), selected through
  ``config._experts_implementation``;
- ``KbitExperts.from_experts`` of the same module at K bits (today one gemm pair per hit expert).

Reported: median microseconds per call, eager (CUDA events around single calls after warm-up:
host work and host syncs included) and, where the path can be captured (no host sync), per
CUDA-graph replay of one call; the experts' bytes, the bytes of the experts the routing actually
hits and the time to read those at the measured copy bandwidth (the "hit roofline"), and the
output difference from the bf16 eager result.

Usage::

    python3 scripts/bench_moe.py --json out.json --md out.md
    python3 scripts/bench_moe.py --shapes qwen3 --tokens 1 8 --bits 4
    python3 scripts/bench_moe.py --shapes qwen3 --tokens 1 --profile   # also list each call's kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

SHAPES = {
    # name: (transformers model type, experts, top-k, hidden, intermediate)
    "qwen3": ("qwen3_moe", 128, 8, 2048, 768),
    "mixtral": ("mixtral", 8, 2, 4096, 14336),
}
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def build_experts(shape: str, device: torch.device) -> torch.nn.Module:
    """A transformers experts module of ``shape`` in bf16 on ``device`` with N(0, 0.02) weights."""
    from transformers import AutoConfig

    model_type, experts, top_k, hidden, inter = SHAPES[shape]
    if model_type == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

        config = AutoConfig.for_model(model_type, num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                                      moe_intermediate_size=inter)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = AutoConfig.for_model(model_type, num_local_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                                      intermediate_size=inter)
    with torch.device(device):
        module = Experts(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module


def routing(tokens: int, experts: int, top_k: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token and their softmax weights (bf16), reproducible."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, index = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return index.to(device), weights.to(device=device, dtype=torch.bfloat16)


def time_us(fn, warmup: int, repeats: int) -> float:
    """Median microseconds of ``fn()`` over ``repeats`` event-timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(bc._event_ms(fn, repeats))


def graph_us(fn, warmup: int, repeats: int) -> float | None:
    """Median microseconds of one CUDA-graph replay of ``fn()``, or None when ``fn`` cannot be
    captured (it syncs the host or does something else a graph forbids)."""
    try:
        graph, _ = bc.capture_graph(fn)
    except Exception:  # noqa: BLE001  (any capture failure means: not capturable)
        torch.cuda.synchronize()
        return None
    return time_us(graph.replay, warmup, repeats)


def kernel_list(fn) -> str:
    """The CUDA kernels of one eager call of ``fn()`` in launch order, with their GPU microseconds
    (``torch.profiler``): what a graph replay of the call runs."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    lines = [f"    {e.device_time:7.1f} us  {e.name[:110]}" for e in kernels]
    total = sum(e.device_time for e in kernels)
    return "\n".join(lines + [f"    {total:7.1f} us in {len(kernels)} kernels"])


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> list[dict[str, Any]]:
    KbitExperts = bc.kbit_api("KbitExperts")
    _, experts, top_k, hidden, inter = SHAPES[shape]
    dense = build_experts(shape, device)
    kbit = {bits: KbitExperts.from_experts(dense, bits=bits) for bits in args.bits}
    per_expert_dense = 3 * hidden * inter * 2
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        index, weights = routing(tokens, experts, top_k, device)
        hit = int(torch.unique(index).numel())
        with torch.no_grad():
            dense.config._experts_implementation = "eager"
            reference = dense(x, index, weights).float()
            for impl in IMPLEMENTATIONS:
                try:
                    dense.config._experts_implementation = impl
                    dense(x, index, weights)
                except Exception as e:  # an implementation this torch/transformers lacks
                    rows.append({"shape": shape, "tokens": tokens, "path": f"bf16 {impl}", "error": f"{type(e).__name__}: {e}"})
                    continue
                us = time_us(lambda: dense(x, index, weights), args.warmup, args.repeats)
                us_graph = graph_us(lambda: dense(x, index, weights), args.warmup, args.repeats)
                rows.append({"shape": shape, "tokens": tokens, "path": f"bf16 {impl}", "us": us, "us_graph": us_graph, "experts_hit": hit,
                             "bytes": module_bytes(dense), "hit_bytes": hit * per_expert_dense,
                             "hit_roofline_us": hit * per_expert_dense / bandwidth * 1e6})
            dense.config._experts_implementation = "eager"
            for bits, module in kbit.items():
                out = module(x, index, weights).float()
                us = time_us(lambda: module(x, index, weights), args.warmup, args.repeats)
                us_graph = graph_us(lambda: module(x, index, weights), args.warmup, args.repeats)
                hit_bytes = module_bytes(module) * hit // experts
                if args.profile:
                    print(f"{shape} T={tokens} kbit K={bits}, kernels of one call:\n" + kernel_list(lambda: module(x, index, weights)))
                rows.append({"shape": shape, "tokens": tokens, "path": f"kbit K={bits}", "us": us, "us_graph": us_graph, "experts_hit": hit,
                             "bytes": module_bytes(module), "hit_bytes": hit_bytes,
                             "hit_roofline_us": hit_bytes / bandwidth * 1e6,
                             "rel_err_vs_bf16": float((out - reference).norm() / reference.norm())})
        print(f"{shape} T={tokens}: " + ", ".join(f"{r['path']} {r['us']:.1f} / {_fmt(r['us_graph'])} us" for r in rows
                                                   if r.get("tokens") == tokens and r["shape"] == shape and "us" in r), flush=True)
    del dense, kbit
    torch.cuda.empty_cache()
    return rows


def _fmt(us: float | None) -> str:
    return "n/a" if us is None else f"{us:.1f}"


def markdown(env: dict[str, Any], bandwidth: float, rows: list[dict[str, Any]]) -> str:
    lines = ["# MoE experts layer: kbit vs transformers bf16 experts", "",
             f"- date: {env['date_utc']}", f"- GPU: {env['gpu']} ({env['sm_count']} SMs), driver {env['driver']}, CUDA runtime {env['cuda_runtime']}",
             f"- torch {env['torch']}, CuPy {env['cupy']}, transformers {env['transformers']}",
             f"- command: `{env['command']}`", f"- copy bandwidth (read + write) measured in the same run: {bandwidth / 1e9:.0f} GB/s", "",
             "Median microseconds per experts call (the routing, both projections, SwiGLU, weighted sum): eager, and "
             "per CUDA-graph replay where the path can be captured (n/a: it syncs the host). "
             "Hit roofline = bytes of the experts the routing hits / copy bandwidth.", "",
             "| shape | tokens | path | us eager | us graph | experts hit | hit roofline us | module MB | rel. error vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['path']} | n/a ({r['error'][:60]}) | | | | | |")
            continue
        err = f"{r['rel_err_vs_bf16']:.4f}" if "rel_err_vs_bf16" in r else ""
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['path']} | {r['us']:.1f} | {_fmt(r['us_graph'])} | {r['experts_hit']} | "
                     f"{r['hit_roofline_us']:.1f} | {r['bytes'] / 2**20:.0f} | {err} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 64, 2048])
    parser.add_argument("--bits", nargs="+", type=int, default=[4])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="print the kernels of one kbit call per case")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens must be positive")
    if any(b not in (2, 3, 4, 5) for b in args.bits):
        parser.error("--bits must be among 2, 3, 4, 5")
    device = bc.require_cuda()
    env = bc.environment(device)
    bandwidth = bc.measure_copy_bandwidth(device) * 1e9  # bytes/s, read + write, as bench_gemm.py's ideal uses it
    rows = []
    for shape in args.shapes:
        rows += run_shape(shape, args, device, bandwidth)
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "read_bandwidth": bandwidth, "rows": rows}, indent=1))
    text = markdown(env, bandwidth, rows)
    if args.md:
        args.md.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
