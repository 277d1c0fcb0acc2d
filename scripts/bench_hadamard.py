#!/usr/bin/env python3
"""What the randomized Hadamard rotation costs a ``KbitLinear`` forward pass on the GPU.

For Llama-3-8B's layer shapes, K = 3, fp16, M = 1, 16, 256 and 4096 rows: the forward pass of a
plain ``KbitLinear`` and of the same layer quantized with ``hadamard=True`` (its input rotated by the
``kbit_linear::hadamard_rotate`` op, on CUDA one pass of ``kernels/hadamard.cu``, before the
kbit GEMM), and the rotation alone; CUDA-graph replay with
weight copies rotated past L2 (``_bench_common.time_calls``), plus the eager wall time of one
call at M = 1 (host overhead included, as ``model.generate`` pays it).

Usage::

    python3 scripts/bench_hadamard.py --md bench/results/hadamard-h100.md --json bench/results/hadamard-h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (puts the repository on the path)

from kbit_linear import KbitLinear  # noqa: E402
from kbit_linear import _ops  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
ROWS = [1, 16, 256, 4096]
BITS = 3


def _layers(k: int, n: int, rotated: bool, copies: int, dev: torch.device) -> list[KbitLinear]:
    torch.manual_seed(0)
    dense = nn.Linear(k, n, bias=False, device=dev, dtype=torch.float16)
    first = KbitLinear.from_linear(dense, bits=BITS, hadamard=rotated)
    out = [first]
    for _ in range(1, copies):  # same sizes, separate storage
        layer = KbitLinear(k, n, bias=False, bits=BITS, device=dev, hadamard=rotated)
        layer.load_state_dict(first.state_dict())
        out.append(layer)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.plot = None
    dev = bc.require_cuda()
    env = bc.environment(dev)
    l2 = bc.l2_bytes(dev)
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"env": env, "bits": BITS, "rows": rows}
    for k, n in SHAPES:
        probe = _layers(k, n, False, 1, dev)[0]
        copies = bc.copies_past_l2(sum(t.numel() * t.element_size() for t in probe.state_dict().values()), l2)
        plain, rotated = _layers(k, n, False, copies, dev), _layers(k, n, True, copies, dev)
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            with torch.no_grad():
                t_plain = bc.time_calls(lambda i: plain[i](x), copies)
                t_rot = bc.time_calls(lambda i: rotated[i](x), copies)
                t_only = bc.time_calls(lambda i: _ops.hadamard_rotate(x, rotated[i].hadamard_signs), copies)
                row = {"in": k, "out": n, "m": m, "plain_us": t_plain.us, "hadamard_us": t_rot.us, "rotation_us": t_only.us,
                       "method": t_rot.method}
                if m == 1:
                    row["plain_eager_us"] = bc.eager_wall_us(lambda: plain[0](x), 200, warmup=20, repeats=5)
                    row["hadamard_eager_us"] = bc.eager_wall_us(lambda: rotated[0](x), 200, warmup=20, repeats=5)
            rows.append(row)
            print(row, flush=True)
        del plain, rotated
        torch.cuda.empty_cache()
    bc.write_outputs(args, payload, _markdown(payload), lambda p, path: None)


def _markdown(payload: dict[str, Any]) -> str:
    lines = ["# Cost of the Hadamard rotation in a KbitLinear forward pass", ""]
    lines += bc.env_lines(payload["env"])
    lines += ["", f"K = {payload['bits']}, fp16 activations, no bias; microseconds per call (CUDA-graph replay, weights "
              "rotated past L2); eager = wall time of one eager call at M = 1.", ""]
    table = []
    for r in payload["rows"]:
        extra = r["hadamard_us"] / r["plain_us"] - 1
        eager = (f"{r['plain_eager_us']:.1f} / {r['hadamard_eager_us']:.1f}" if "plain_eager_us" in r else "-")
        table.append([f"{r['in']}x{r['out']}", r["m"], bc.fmt(r["plain_us"]), bc.fmt(r["hadamard_us"]),
                      f"{100 * extra:+.0f} %", bc.fmt(r["rotation_us"]), eager])
    lines.append(bc.markdown_table(["in x out", "M", "plain us", "Hadamard us", "extra", "rotation alone us",
                                    "eager plain / Hadamard us (M = 1)"], table))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
