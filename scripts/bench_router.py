"""MoE router: transformers' top-k router module against the same module after ``kbit_linear.fuse_routers``.

One router call (logits, softmax, top-k, renormalisation) per token count, CUDA-graph replay over
router weight copies that together exceed L2 (in a decode step each layer's router weight comes
from DRAM). Columns: transformers' own forward (a GEMV or GEMM, softmax, top-k and its sort,
element-wise ops), the fused module as dispatched (the kernel up to ``tuning.ROUTER_MAX_TOKENS``
tokens, the reference above), and the kernel forced at every count (the threshold's evidence).
Run from the repository root: ``python3 scripts/bench_router.py --md router.md --json router.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

# name -> (transformers module, router class, config class, config keywords)
SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeConfig",
                      dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "mixtral-8x7b": ("mixtral", "MixtralTopKRouter", "MixtralConfig",
                     dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("olmoe", "OlmoeTopKRouter", "OlmoeConfig", dict(hidden_size=2048, num_experts=64, num_experts_per_tok=8)),
}


def build_router(shape: str, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' router of ``shape`` with N(0, 0.02) weights."""
    import importlib

    import transformers

    module, cls, cfg_cls, kw = SHAPES[shape]
    config = getattr(transformers, cfg_cls)(**kw)
    router = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.02)
    return router.to(dev, dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--md")
    p.add_argument("--json")
    args = p.parse_args()
    dev = bc.require_cuda()
    fuse_routers = bc.kbit_api("fuse_routers")
    from kbit_linear.backends.cuda import tuning

    dtype = torch.bfloat16
    rows, table = [], []
    for shape in args.shapes:
        base = build_router(shape, dev, dtype)
        copies = bc.copies_past_l2(base.weight.nbytes, bc.l2_bytes(dev))
        plain = [copy.deepcopy(base) for _ in range(copies)]
        fused = [copy.deepcopy(base) for _ in range(copies)]
        for m in fused:
            assert fuse_routers(m).fused == [""], "the router did not fuse"
        hidden = base.weight.shape[1]
        for t in args.tokens:
            x = torch.randn(t, hidden, device=dev, dtype=dtype)
            res = {"shape": shape, "tokens": t, "experts": base.weight.shape[0], "top_k": base.top_k}
            for name, mods in (("transformers", plain), ("fused", fused)):
                res[name] = bc.time_calls(lambda i, mods=mods: mods[i](x), copies).us
            limit = tuning.ROUTER_MAX_TOKENS
            tuning.ROUTER_MAX_TOKENS = 1 << 30
            try:
                res["kernel forced"] = bc.time_calls(lambda i: fused[i](x), copies).us
            finally:
                tuning.ROUTER_MAX_TOKENS = limit
            rows.append(res)
            table.append([shape, t, bc.fmt(res["transformers"]), bc.fmt(res["fused"]), bc.fmt(res["kernel forced"]),
                          f"{res['transformers'] / res['fused']:.2f}x"])
            print(table[-1], flush=True)
    env = bc.environment(dev)
    lines = ["# MoE router: transformers' module vs fuse_routers", "", *bc.env_lines(env), "",
             "us per call, bf16, CUDA-graph replay over router weight copies past L2.", "",
             bc.markdown_table(["shape", "tokens", "transformers us", "fused us", "kernel forced us", "speed-up"], table)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        bc.write_text(args.md, text)
    if args.json:
        bc.write_json(args.json, {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
