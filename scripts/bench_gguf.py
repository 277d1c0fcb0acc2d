"""Time the GGUF block-format GEMM (``kbit_linear::gguf_gemm``) beside the kbit K = 4 GEMM and cuBLAS.

For each Llama-sized shape and M, on random weights (no download): the GGUF types kept
quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: small-M kernel up to ``GGUF_GEMV_MAX_M`` rows, dequantize +
cuBLAS above; with ``--a8`` also the 8-bit-activation path, ``gguf_gemm_a8``), the kbit K = 4 GEMM (``kbit_linear::gemm``, its own dispatcher) and cuBLAS
``F.linear`` on the dense fp16 weight, all in one run: CUDA-graph replay of many calls, weight
copies rotated past L2, median of repeats (``_bench_common.time_calls``). Roofline = (weight
bytes + x + out) / the measured copy bandwidth. "per byte vs kbit K=4" divides each GGUF time
per weight byte by the kbit one's: the measure of "as fast at the same bytes".

Usage::

    python3 scripts/bench_gguf.py --md bench/results/gguf-h100.md --json bench/results/gguf-h100.json
    python3 scripts/bench_gguf.py --shapes 4096x4096 --m 1 16 --types Q4_0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

SHAPES = ["4096x4096", "4096x14336", "14336x4096", "8192x28672"]  # in x out
M_VALUES = [1, 4, 16, 64, 256, 1024, 4096]


def _gguf_weight(qtype: str, n: int, k: int, device: torch.device) -> Any:
    from kbit_linear import gguf_format as gf
    t = gf.block_type(qtype)
    raw = torch.randint(0, 256, (n, k // gf.BLOCK, t.block_bytes), dtype=torch.uint8, device=device)
    w = gf.split_blocks(raw, qtype, n, k)
    w.scale = (torch.rand_like(w.scale, dtype=torch.float32) * 0.01).to(torch.float16)
    if w.mins is not None:
        w.mins = (torch.randn_like(w.mins, dtype=torch.float32) * 0.01).to(torch.float16)
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--m", nargs="+", type=int, default=M_VALUES)
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--launch", help="WARPS,UNROLL: launch shape of the small-M kernel for every M (default: tuning.py's)")
    ap.add_argument("--a8", action="store_true", help="also time each type with 8-bit activations (gguf_gemm_a8)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    device = bc.require_cuda()
    import kbit_linear  # noqa: F401  (registers the ops)
    from kbit_linear import format as fmt

    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    if args.launch:
        from kbit_linear.backends.cuda import tuning
        shape = tuple(int(v) for v in args.launch.split(","))
        tuning.GGUF_GEMV_LAUNCH.update({n8: shape for n8 in tuning.GGUF_GEMV_LAUNCH})
    env = bc.environment(device)
    bw = bc.measure_copy_bandwidth(device)
    l2 = bc.l2_bytes(device)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        dense = torch.randn(n, k, device=device) * 0.02
        kbit = fmt.quantize(dense, 4)
        kbit_t = (kbit.packed, kbit.absmax, kbit.codebook, kbit.tensor_scale)
        kbit_copies = bc.weight_copies(kbit_t, l2)
        dense16 = dense.to(dtype)
        dense_copies = bc.weight_copies(dense16, l2)
        gguf = {q: _gguf_weight(q, n, k, device) for q in args.types}
        gguf_copies = {q: bc.weight_copies(tuple(w.tensors().values()), l2) for q, w in gguf.items()}
        del dense
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=dtype)
            act_bytes = (m * k + m * n) * x.element_size()
            row: dict[str, Any] = {"shape": shape, "m": m, "dtype": args.dtype}

            def t_kbit(i: int) -> None:
                p, a, c, s = kbit_copies[i]
                torch.ops.kbit_linear.gemm(x, p, a, c, s, 4, n, None)

            tm = bc.time_calls(t_kbit, len(kbit_copies))
            row["kbit4_us"], row["kbit4_bytes"] = tm.us, bc.tensor_bytes(*kbit_t)
            tm = bc.time_calls(lambda i: torch.nn.functional.linear(x, dense_copies[i]), len(dense_copies))
            row["cublas_us"] = tm.us
            for q, w in gguf.items():
                names = list(w.tensors())
                copies = gguf_copies[q]

                def t_gguf(i: int, names=names, copies=copies, q=q) -> None:
                    f = dict(zip(names, copies[i]))
                    torch.ops.kbit_linear.gguf_gemm(x, f["qs"], f.get("qh"), f["scale"], f.get("mins"), q, n, None)

                tm = bc.time_calls(t_gguf, len(copies))
                if args.a8:
                    def t_a8(i: int, names=names, copies=copies, q=q) -> None:
                        f = dict(zip(names, copies[i]))
                        torch.ops.kbit_linear.gguf_gemm_a8(x, f["qs"], f.get("qh"), f["scale"], f.get("mins"), q, n, None)

                    row[f"{q}_a8_us"] = bc.time_calls(t_a8, len(copies)).us
                nbytes = bc.tensor_bytes(*w.tensors().values())
                row[f"{q}_us"], row[f"{q}_bytes"] = tm.us, nbytes
                row[f"{q}_roofline_us"] = (nbytes + act_bytes) / (bw * 1e9) * 1e6
                row[f"{q}_per_byte_vs_kbit4"] = (tm.us / nbytes) / (row["kbit4_us"] / row["kbit4_bytes"])
            row["kbit4_roofline_us"] = (row["kbit4_bytes"] + act_bytes) / (bw * 1e9) * 1e6
            rows.append(row)
            print({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    headers = ["in x out", "M", "cuBLAS", "kbit K=4 (roofline)"] + [f"{q} (roofline, per byte vs K=4)" for q in args.types]
    if args.a8:
        headers += [f"{q} A8" for q in args.types]
    table = [[r["shape"], r["m"], bc.fmt(r["cublas_us"]), f"{bc.fmt(r['kbit4_us'])} ({bc.fmt(r['kbit4_roofline_us'])})"]
             + [f"{bc.fmt(r[f'{q}_us'])} ({bc.fmt(r[f'{q}_roofline_us'])}, {r[f'{q}_per_byte_vs_kbit4']:.2f}x)" for q in args.types]
             + ([bc.fmt(r[f"{q}_a8_us"]) for q in args.types] if args.a8 else [])
             for r in rows]
    text = "\n".join(["# GGUF block formats kept quantized: GEMM timings", ""] + bc.env_lines(env) + [
        f"- copy bandwidth measured in the same run: {bw:.0f} GB/s; activations {args.dtype}",
        "", "Microseconds per call (CUDA-graph replay, weights rotated past L2).", "", bc.markdown_table(headers, table)])
    print(text)
    payload = {"env": env, "copy_bandwidth": bw, "rows": rows}
    bc.write_outputs(argparse.Namespace(json=args.json, md=args.md, plot=None), payload, text, lambda *_: None)


if __name__ == "__main__":
    main()
