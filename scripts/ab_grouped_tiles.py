"""A/B of the grouped wgmma kernel's small token tiles on mixture-of-experts layers (one H200 run).

``KbitExperts`` (K = 4) of the Qwen3-30B-A3B and Mixtral-8x7B shapes of ``bench_moe.py``, random
top-k routing, CUDA-graph replay of one experts call, at token counts whose groups take the
grouped wgmma kernel (more than 16 rows per expert possible). Two settings alternate in the same
process, two rounds each: "table" = the GPU's own row of ``tuning.WGMMA_TOKEN_TILES`` (on an H200
with tiles 16 and 32), "tile 64 up" = the default row (no tile below 64). This is the measurement
behind ``tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN``; ``--no-mean-limit`` lifts that limit, so
that "table" takes the small tiles at any mean rows per expert (how the limit was measured).

Usage::

    python3 scripts/ab_grouped_tiles.py --no-mean-limit --json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe as bm  # noqa: E402  (puts the repository on the path through _bench_common)

from kbit_linear.backends.cuda import loader, plans, tuning  # noqa: E402

CASES = (("qwen3", (32, 64, 128, 256, 512)), ("mixtral", (32, 64, 128)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--no-mean-limit", action="store_true", help="small tiles at any mean rows per group")
    args = ap.parse_args()
    dev = bm.bc.require_cuda()
    name = loader.device_properties(dev.index if dev.index is not None else torch.cuda.current_device()).name
    saved, saved_limit = dict(tuning.WGMMA_TOKEN_TILES), tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN
    if args.no_mean_limit:
        tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN = 1 << 30
    settings = {"table": tuning.wgmma_token_tiles(name), "tile 64 up": tuning.WGMMA_TOKEN_TILES["default"]}
    KbitExperts = bm.bc.kbit_api("KbitExperts")
    rows = []
    try:
        for shape, token_counts in CASES:
            _, experts, top_k, hidden, _ = bm.SHAPES[shape]
            dense = bm.build_experts(shape, dev)
            module = KbitExperts.from_experts(dense, bits=4)
            del dense
            for tokens in token_counts:
                x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
                index, weights = bm.routing(tokens, experts, top_k, dev)
                times: dict[str, list[float]] = {k: [] for k in settings}
                with torch.no_grad():
                    for _ in range(2):
                        for label, table in settings.items():
                            tuning.WGMMA_TOKEN_TILES.clear()
                            tuning.WGMMA_TOKEN_TILES.update({"default": table})
                            plans.clear()
                            times[label].append(bm.graph_us(lambda: module(x, index, weights), 3, 20))
                row = {"shape": shape, "tokens": tokens, "mean_rows_per_expert": tokens * top_k / experts, "us": times}
                rows.append(row)
                print(f"{shape} T={tokens} (mean {row['mean_rows_per_expert']:.1f} rows per expert): "
                      + ", ".join(f"{k} {' / '.join('n/a' if v is None else f'{v:.1f}' for v in vs)} us" for k, vs in times.items()),
                      flush=True)
            del module
            torch.cuda.empty_cache()
    finally:
        tuning.WGMMA_TOKEN_TILES.clear()
        tuning.WGMMA_TOKEN_TILES.update(saved)
        tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN = saved_limit
        plans.clear()
    if args.json:
        bm.bc.write_json(args.json, {"environment": bm.bc.environment(dev), "rows": rows})


if __name__ == "__main__":
    main()
