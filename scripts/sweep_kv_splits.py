"""How many splits the KV decode grid should have: the split planner's wave size swept.

``kv_attention._splits`` cuts the context so that the grid fills whole waves of
``resident_blocks_per_sm`` blocks per SM (4 for head_dim 128, what the kernel's registers allow).
This times the decode attention (4-bit cache, Llama-3-8B attention shape, with and without the
mass) with the planner told 1, 2, 3, 4 or 8 blocks per SM instead (8: two waves), beside SDPA on a
bf16 cache, with ``bench_kv_attention.py``'s caches and timing (CUDA-graph replay, caches rotated
past L2). The kernel's occupancy is the same in every row; only the number of splits (and whether the first
split is short) changes.

    python3 scripts/sweep_kv_splits.py --json bench/results/kv-splits-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402
import bench_kv_attention as bk  # noqa: E402

from kbit_linear.backends.cuda import kv_attention as kkv  # noqa: E402

CASES = ((4096, 1), (32768, 1), (32768, 8), (131072, 1))  # (context, batch)
RESIDENT = (1, 2, 3, 4, 8)


def main() -> None:
    """Time every (case, wave size) and print one JSON row per case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    dev = bc.require_cuda()
    l2 = bc.l2_bytes(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    real = kkv.resident_blocks_per_sm
    rows = []
    for s, batch in CASES:
        g = torch.Generator(device=dev).manual_seed(s + batch)
        q = torch.randn(batch, bk.HQ, 1, bk.D, device=dev, dtype=torch.bfloat16, generator=g)
        n = bc.copies_past_l2(2 * batch * bk.H * s * bk.D * 2, l2, max_copies=8)
        kv = [(torch.randn(batch, bk.H, s, bk.D, device=dev, dtype=torch.bfloat16, generator=g),
               torch.randn(batch, bk.H, s, bk.D, device=dev, dtype=torch.bfloat16, generator=g)) for _ in range(n)]
        sdpa = bc.time_calls(lambda i: F.scaled_dot_product_attention(q, kv[i][0], kv[i][1], scale=bk.D**-0.5, enable_gqa=True), n).us
        del kv
        torch.cuda.empty_cache()
        caches = [bk._cache(batch, s, "4", dev, seed=s + batch)]
        n = bc.copies_past_l2(caches[0]["nbytes"], l2, max_copies=8)
        caches += [bk._cache(batch, s, "4", dev, seed=s + batch + i) for i in range(1, n)]
        row = {"context": s, "batch": batch, "sdpa_us": sdpa}
        try:
            for r in RESIDENT:
                kkv.resident_blocks_per_sm = lambda d, shared, r=r: r
                for c in caches:
                    c["workspace"].clear()
                row[f"r{r}_plan"] = list(kkv._splits(-(-s // bk.BLOCK), batch * bk.H, r, sms))  # kkv.SplitPlan's fields
                for mass in (False, True):
                    row[f"r{r}_{'mass' if mass else 'nomass'}"] = bc.time_calls(
                        lambda i: kkv.kv_decode_attention_cuda(q, caches[i]["buckets"], caches[i]["kmin"], caches[i]["krange"], bk.BLOCK, s,
                                                               caches[i]["tier"], None, bk.D**-0.5, need_mass=mass,
                                                               workspace=caches[i]["workspace"]), n).us
        finally:
            kkv.resident_blocks_per_sm = real
        print(json.dumps(row), flush=True)
        rows.append(row)
        del caches
        torch.cuda.empty_cache()
    if args.json:
        bc.write_json(args.json, {"env": bc.environment(dev), "rows": rows})


if __name__ == "__main__":
    main()
