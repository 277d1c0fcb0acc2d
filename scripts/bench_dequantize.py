"""Time the dequantize kernel (kbit weight -> dense fp16) against the copy bandwidth, and the
dequantize + cuBLAS path it feeds at a large M.

The dequantize kernel is what the dispatcher runs before cuBLAS above the tensor-core kernels'
last row (``tuning.WGMMA_ROWS``, ``WGMMA_LAST_ROW_BY_BITS``), what ``KbitLinear.dequantize`` and
the training backward pass call, so its bandwidth is that path's whole overhead over cuBLAS.

Method (``scripts/_bench_common.py``): weight copies rotated past twice the L2, calls replayed
from one CUDA graph, median of 7; GB/s counts the packed weight and scales read plus the dense
weight written. Weights in the layout a layer holds on the GPU (pair codes at 4 and 5 bits).

Usage (from the repository root, on a GPU machine):

    python3 scripts/bench_dequantize.py
    python3 scripts/bench_dequantize.py --bits 4 --shapes 8192x28672 --m 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

import kbit_linear  # noqa: E402,F401  (op schemas)
from kbit_linear import format as fmt  # noqa: E402
from kbit_linear import weight_layout  # noqa: E402
from kbit_linear.backends import cuda as kcuda  # noqa: E402

DEFAULT_SHAPES = ["4096x4096", "4096x14336", "14336x4096", "8192x28672"]


def _weight(n: int, k: int, bits: int, dev: torch.device) -> fmt.KbitWeight:
    """A random ``[n, k]`` weight quantized on the GPU, in the layout a layer holds there."""
    packed, absmax, codebook, ts = bc.quantize_rows(torch.randn(n, k, device=dev) * 0.02, bits)
    return fmt.KbitWeight(weight_layout.device_form(packed, bits), absmax, codebook, ts, bits, n, k)


def main(argv: list[str] | None = None) -> None:
    """Parse the options, time every (shape, bits) and print one JSON line each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="in_features x out_features, e.g. 4096x14336")
    ap.add_argument("--bits", nargs="+", type=int, default=[2, 4, 5], choices=fmt.SUPPORTED_BITS)
    ap.add_argument("--m", type=int, default=4096, help="rows of x for the dequantize + cuBLAS timing (0: skip it)")
    ap.add_argument("--json", type=Path, help="write all rows here")
    args = ap.parse_args(argv)
    dev = bc.require_cuda()
    torch.manual_seed(0)
    copy_gbps = bc.measure_copy_bandwidth(dev)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rows = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        for bits in args.bits:
            qw = _weight(n, k, bits, dev)
            dense_bytes = n * k * 2
            copies = bc.weight_copies((qw.packed, qw.absmax), nbytes=bc.tensor_bytes(qw.packed, qw.absmax) + dense_bytes)
            us = bc.time_calls(lambda i: torch.ops.kbit_linear.dequantize(copies[i][0], copies[i][1], qw.codebook, qw.tensor_scale,
                                                                          bits, n, k, torch.float16), len(copies)).us
            gbps = (bc.tensor_bytes(qw.packed, qw.absmax) + dense_bytes) / us / 1e3
            row = {"in": k, "out": n, "bits": bits, "dequantize_us": us, "gbps": gbps, "pct_copy_bw": 100 * gbps / copy_gbps}
            if args.m:
                x = torch.randn(args.m, k, device=dev, dtype=torch.float16)
                row[f"dequant_cublas_m{args.m}_us"] = bc.time_calls(
                    lambda i: kcuda.gemm_cuda(x, copies[i][0], copies[i][1], qw.codebook, qw.tensor_scale, bits, n, path="dequant+cublas"),
                    len(copies), target_ms=5.0, repeats=5).us
            print(json.dumps(row), flush=True)
            rows.append(row)
            del copies, qw
    if args.json:
        bc.write_json(args.json, {"environment": bc.environment(dev), "command": " ".join(["python3", *sys.argv]),
                                  "copy_gbps": copy_gbps, "rows": rows})


if __name__ == "__main__":
    main()
