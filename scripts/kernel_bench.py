"""Timing table of the kbit CUDA GEMM paths against cuBLAS fp16, and the host overhead of a call.

Each number is microseconds per call (``scripts/_bench_common.py``): many calls cycling through
enough weight copies to fill twice the GPU's L2 are captured in one CUDA graph, the graph is
replayed several times between CUDA events, and the median replay time is divided by the number
of calls. Inputs are random (never zeros).

Host overhead: the wall time of many eager calls at M = 1 on a small layer (whose GPU time is a
few microseconds) minus the GPU time of the same call from a graph replay; reported for
``torch.ops.kbit_linear.gemm``, a direct ``gemm_cuda`` call and ``F.linear`` for scale.

Usage: python3 scripts/kernel_bench.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

import kbit_linear  # noqa: E402,F401
from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.backends import cuda as kcuda  # noqa: E402

DEV = torch.device("cuda")
MAX_CALLS = 200  # calls per CUDA graph at most


def _graph_time(fn: Callable[[int], Any], n_copies: int, target_ms: float = 4.0) -> float:
    """Median microseconds per call of fn(i) (i = weight copy), via CUDA-graph replay; every
    copy runs at least twice per replay."""
    return bc.time_calls(fn, n_copies, target_ms=target_ms, repeats=7, min_calls=min(2 * n_copies, MAX_CALLS),
                         max_calls=MAX_CALLS, fallback=False).us


def _kbit_weights(n: int, k: int, bits: int) -> list[fmt.KbitWeight]:
    """A quantized random weight and copies of its planes and scales, enough to rotate past L2."""
    w = torch.randn(n, k, device=DEV) * 0.02
    qw = fmt.quantize(w, bits)
    return bc.weight_copies(
        qw, nbytes=bc.tensor_bytes(qw.packed, qw.absmax),
        make=lambda: fmt.KbitWeight(qw.packed.clone(), qw.absmax.clone(), qw.codebook, qw.tensor_scale, bits, n, k),
    )


def bench_shape(k: int, n: int, bits: int, dtype: torch.dtype, ms: list[int], cublas: bool = True) -> list[dict]:
    """Time every GEMM path (and cuBLAS) at one shape and width for each M; prints a row per M."""
    wbytes = n * k * (bits / 8 + 1 / 32)
    qws = _kbit_weights(n, k, bits)
    dense = bc.weight_copies(torch.randn(n, k, device=DEV, dtype=dtype) * 0.02) if cublas else None
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        row = {"k": k, "n": n, "m": m, "bits": bits, "dtype": str(dtype).replace("torch.", ""),
               "auto_path": kcuda.gemm_path(m, n, k, bits, dtype)}
        paths = [("fused", {"path": "fused"}), ("dequant+cublas", {"path": "dequant+cublas"}), ("auto", {})]
        if kcuda.gemm_path(m, n, k, bits, dtype) == "decode" or _decode_ok(m, bits, dtype):
            paths.insert(0, ("decode", {"path": "decode"}))
        for name, kw in paths:
            def fn(i, kw=kw):
                q = qws[i % len(qws)]
                return kcuda.gemm_cuda(x, q.packed, q.absmax, q.codebook, q.tensor_scale, bits, n, **kw)
            row[name] = _graph_time(fn, len(qws))
        if dense is not None:
            row["cublas_fp16"] = _graph_time(lambda i: F.linear(x, dense[i % len(dense)]), len(dense))
        row["weight_GBps_auto"] = wbytes / (row["auto"] * 1e-6) / 1e9
        rows.append(row)
        print(_fmt_row(row), flush=True)
    return rows


def _decode_ok(m: int, bits: int, dtype: torch.dtype) -> bool:
    try:
        from kbit_linear.backends.cuda import decode  # noqa: PLC0415
    except ImportError:
        return False
    return decode.decode_supported(m, bits, dtype)


def _fmt_row(r: dict) -> str:
    cub = r.get("cublas_fp16")
    ratio = f"{r['auto'] / cub:.2f}" if cub else "-"
    dec = f"{r['decode']:.1f}" if "decode" in r else "-"
    return (f"| {r['k']}x{r['n']} | {r['bits']} | {r['dtype']} | {r['m']} | {dec} | {r['fused']:.1f} | {r['dequant+cublas']:.1f} | "
            f"{r['auto']:.1f} ({r['auto_path']}) | {f'{cub:.1f}' if cub else '-'} | {ratio} | {r['weight_GBps_auto']:.0f} |")


HEADER = ("| K_in x N_out | bits | dtype | M | decode us | fused us | dequant+cuBLAS us | auto us (path) | cuBLAS fp16 us | auto/cuBLAS | "
          "weight GB/s |\n|---|---|---|---|---|---|---|---|---|---|---|")


def host_overhead(n_calls: int = 3000) -> dict:
    """Wall time per eager call minus GPU time per call, M = 1, 576 -> 192, bits 4, fp16."""
    k, n, bits = 576, 192, 4
    qw = fmt.quantize(torch.randn(n, k, device=DEV), bits)
    x = torch.randn(1, k, device=DEV, dtype=torch.float16)
    dense = torch.randn(n, k, device=DEV, dtype=torch.float16)
    op = torch.ops.kbit_linear.gemm.default
    auto = kcuda.gemm_path(1, n, k, bits, torch.float16)
    calls = {
        f"torch.ops.kbit_linear.gemm.default ({auto})": lambda: op(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, None),
        f"gemm_cuda ({auto})": lambda: kcuda.gemm_cuda(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n),
        "gemm_cuda (path='fused')": lambda: kcuda.gemm_cuda(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, path="fused"),
        "gemm_cuda (path='fused', split_k=1)": lambda: kcuda.gemm_cuda(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, path="fused", split_k=1),
        "F.linear fp16 (for scale)": lambda: F.linear(x, dense),
    }
    res = {}
    for name, fn in calls.items():
        gpu = _graph_time(lambda i, fn=fn: fn(), 1, target_ms=2.0)
        wall = bc.eager_wall_us(fn, n_calls, warmup=200, repeats=5)
        res[name] = {"wall_us": wall, "gpu_us": gpu, "host_overhead_us": wall - gpu}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--dispatch", action="store_true",
                    help="only the small-M paths (decode vs fused) at M = 4..16 on the four shapes, bits 2..5 fp16, and the host overhead")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"date {time.strftime('%Y-%m-%d')}", flush=True)
    result: dict = {"device": props.name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    result["copy_GBps"] = bc.measure_copy_bandwidth(DEV, nbytes=2**30)
    print(f"device-to-device copy: {result['copy_GBps']:.0f} GB/s (read + write)", flush=True)

    print("\n" + HEADER)
    rows = []
    ms = [1, 4, 16, 64, 128, 256, 1024, 4096]
    shapes = [(8192, 28672), (4096, 4096), (4096, 14336), (14336, 4096)]
    if args.quick:
        shapes, ms = shapes[:2], [1, 16, 256, 4096]
    if args.dispatch:
        for k, n in shapes:
            for bits in (2, 3, 4, 5):
                rows += bench_shape(k, n, bits, torch.float16, [4, 8, 12, 16], cublas=False)
    else:
        for k, n in shapes:
            rows += bench_shape(k, n, 4, torch.float16, ms)
        for bits in (2, 3, 5):
            rows += bench_shape(4096, 14336, bits, torch.float16, [1, 16, 64, 256, 1024], cublas=False)
        rows += bench_shape(4096, 14336, 4, torch.bfloat16, [1, 64, 256, 1024], cublas=False)
    result["rows"] = rows

    print("\n| call (M=1, 576->192, bits 4, fp16) | wall us/call | GPU us/call | host overhead us |\n|---|---|---|---|")
    result["host"] = host_overhead()
    for name, r in result["host"].items():
        print(f"| {name} | {r['wall_us']:.1f} | {r['gpu_us']:.1f} | {r['host_overhead_us']:.1f} |")

    print("\ncrossover (smallest M where dequant+cuBLAS beats fused):")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["k"], r["n"], r["bits"], r["dtype"]), []).append(r)
    for key, rs in groups.items():
        wins = [r["m"] for r in sorted(rs, key=lambda r: r["m"]) if r["dequant+cublas"] < r["fused"]]
        dec = [r["m"] for r in sorted(rs, key=lambda r: r["m"]) if "decode" in r and r["decode"] <= r["fused"]]
        print(f"  {key}: {wins[0] if wins else 'none measured'}; decode <= fused at M = {dec}")
    big = {r["m"]: r for r in rows if (r["k"], r["n"], r["bits"], r["dtype"]) == (8192, 28672, 4, "float16")}
    if big:
        print("\nbar (8192->28672, bits 4, fp16): "
              f"M=1 auto {big[1]['auto']:.1f} us (< 70 wanted); "
              f"M=4096 auto/cuBLAS {big[4096]['auto'] / big[4096]['cublas_fp16']:.3f} (<= 1.15 wanted)" if 1 in big and 4096 in big else "")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
