"""A/B of one-token experts calls on one GPU: ``kbit_linear::experts_one_token`` (the two kernels of
``kernels/experts_token.cu`` where they take the call) against the grouped path
(``experts_one_token_composed``: route, grouped SwiGLU, grouped GEMM, combine), CUDA-graph
replay, Qwen3-30B-A3B and Mixtral-8x7B shapes, K = 2..5. Both modes replay a graph of 16 calls:
"hot" with one routing 16 times (the hit experts stay in L2, as ``bench_moe.py`` times), "cold"
with 16 different routings (other experts each call, as the next layer's would be). (Pages
written before 2026-11-30 timed "hot" as a graph of one call, its launch included.) Prints JSON rows and a
markdown table. Run from the repository root: ``python3 scripts/ab_experts_token.py``."""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402
import bench_moe  # noqa: E402

from kbit_linear import _grouped_ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "mixtral"], choices=sorted(bench_moe.SHAPES))
    args = parser.parse_args()
    dev = bc.require_cuda()
    bw = bc.measure_copy_bandwidth(dev) * 1e9  # bytes/s, read + write counted (the rate the other pages use)
    rows = []
    OP = torch.ops.kbit_linear.experts_one_token
    for shape in args.shapes:
        _, experts, top_k, hidden, inter = bench_moe.SHAPES[shape]
        dense = bench_moe.build_experts(shape, dev)
        for bits in (2, 3, 4, 5):
            KbitExperts = bc.kbit_api("KbitExperts")
            m = KbitExperts.from_experts(dense, bits=bits)
            gu, dn = tuple(m.projection_tensors("gate_up_proj")), tuple(m.projection_tensors("down_proj"))
            x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
            routes = [bench_moe.routing(1, experts, top_k, dev, seed=s) for s in range(16)]
            per_expert = sum(t[0].nbytes for t in (gu, dn)) + sum(t[1].nbytes for t in (gu, dn))
            per_expert //= experts
            roof = top_k * per_expert / bw * 1e6
            res = {"shape": shape, "bits": bits, "hit_roofline_us": roof}
            for name, fn in (("two kernels", OP), ("grouped", _grouped_ops.experts_one_token_composed)):
                for mode, rs in (("hot", routes[:1] * len(routes)), ("cold", routes)):
                    call = lambda: [fn(x, i, w, *gu, *dn, bits, inter) for i, w in rs]
                    g, _ = bc.capture_graph(call, warmup=2)
                    for _ in range(3):
                        g.replay()
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(15):
                        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s0.record(); g.replay(); s1.record(); torch.cuda.synchronize()
                        ts.append(s0.elapsed_time(s1) * 1000 / len(rs))
                    ts.sort()
                    res[f"{name} {mode}"] = ts[len(ts) // 2]
                    del g
            a = OP(x, *routes[3], *gu, *dn, bits, inter).float()
            b = _grouped_ops.experts_one_token_composed(x, *routes[3], *gu, *dn, bits, inter).float()
            res["rel_diff"] = float((a - b).norm() / b.norm())
            rows.append(res)
            print(json.dumps(res), flush=True)
            del m, gu, dn
            torch.cuda.empty_cache()
        del dense
        torch.cuda.empty_cache()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print("| shape | K | hit roofline us | two kernels hot / cold | grouped hot / cold | cold speed-up | cold / roofline | rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['bits']} | {r['hit_roofline_us']:.1f} | {r['two kernels hot']:.1f} / {r['two kernels cold']:.1f} | "
              f"{r['grouped hot']:.1f} / {r['grouped cold']:.1f} | {r['grouped cold'] / r['two kernels cold']:.2f}x | "
              f"{r['two kernels cold'] / r['hit_roofline_us']:.2f}x | {r['rel_diff']:.1e} |")


if __name__ == "__main__":
    main()
