#!/usr/bin/env python3
"""One kbit GEMM and its cuBLAS twin per M, each last call inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include "kbit_m256/" --nvtx-include "cublas_m256/" \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section LaunchStats \\
        python3 scripts/ncu_gemm.py --shape 4096 4096 --m 256 1024 --bits 4

The ranges are ``kbit_m<M>`` (the ``KbitLinear`` forward: whatever kernel the dispatcher picks)
and ``cublas_m<M>`` (``nn.Linear`` on the same dense weight), after three warm-up calls each so
that the kernels are compiled and the plans cached before the profiled call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common  # noqa: E402,F401  (puts the repository on sys.path)
import kbit_linear  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("IN", "OUT"), help="in_features out_features")
    p.add_argument("--m", type=int, nargs="+", default=[256, 1024], help="token counts")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5])
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    dense = nn.Linear(*args.shape, bias=False, device="cuda", dtype=dtype)
    kbit = kbit_linear.KbitLinear.from_linear(dense, bits=args.bits)
    for m in args.m:
        x = torch.randn(m, args.shape[0], device="cuda", dtype=dtype)
        with torch.no_grad():
            for _ in range(3):
                kbit(x)
                dense(x)
            torch.cuda.synchronize()
            with torch.cuda.nvtx.range(f"kbit_m{m}"):
                kbit(x)
            with torch.cuda.nvtx.range(f"cublas_m{m}"):
                dense(x)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
