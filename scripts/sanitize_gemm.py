"""A few small kbit GEMM / format-kernel launches for compute-sanitizer (memcheck, racecheck).

Covers the fused kernel with and without split-K, every M blocking, bits 2..5, fp16 and bf16,
shapes that are not tile multiples, a bias, and the quantize / repack / dequantize kernels.
Exits non-zero if a result is wrong. Run: compute-sanitizer --tool memcheck python3 scripts/sanitize_gemm.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.backends import cuda as kcuda  # noqa: E402

CASES = [  # (m, k, n, bits, dtype, kwargs)
    (1, 200, 300, 4, torch.float16, {"path": "fused", "split_k": 3}),
    (17, 576, 192, 5, torch.bfloat16, {"path": "fused-splitk"}),
    (40, 100, 33, 2, torch.float16, {"path": "fused", "split_k": 1}),
    (100, 1536, 129, 3, torch.bfloat16, {"path": "fused"}),
    (130, 264, 200, 4, torch.float16, {"path": "fused-splitk"}),
    (1, 576, 192, 2, torch.float16, {}),  # automatic stream-K: ranges start inside tiles
    (3, 4096, 1024, 4, torch.bfloat16, {}),
]


def main() -> int:
    dev = torch.device("cuda")
    bad = 0
    for m, k, n, bits, dtype, kw in CASES:
        w = torch.randn(n, k, device=dev)
        cb = fmt.create_normal_float_codebook(bits, dev)
        ts = fmt.compute_tensor_scale(w)
        pf, af = torch.ops.kbit_linear.quantize(w, cb, ts, bits)
        packed, absmax = torch.ops.kbit_linear.repack(pf, af, bits)
        wd = torch.ops.kbit_linear.dequantize(packed, absmax, cb, ts, bits, n, k, torch.float32)
        x = torch.randn(m, k, device=dev, dtype=dtype)
        bias = torch.randn(n, device=dev, dtype=dtype)
        y = kcuda.gemm_cuda(x, packed, absmax, cb, ts, bits, n, bias, **kw)
        ref = F.linear(x.float(), wd, bias.float())
        err = ((y.float() - ref).norm() / ref.norm()).item()
        ok = err < 2e-2 and not torch.isnan(y).any().item()
        bad += not ok
        print(f"M={m} {k}->{n} bits={bits} {dtype} {kw}: rel err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
