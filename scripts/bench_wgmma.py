"""Tuning table of the Hopper wgmma kernel: each token tile against cuBLAS fp16 and the other paths.

For every (shape, bits, M) the wgmma kernel is timed with each token tile of
``hopper.TOKEN_TILES`` forced (automatic split; with ``--splits`` also the automatic tile unsplit,
split in two and four and stream-K), beside cuBLAS fp16 on the dense weight, the
decode kernel (where it supports the problem), the mma.sync kernel and dequantize + cuBLAS. This
is the measurement behind ``tuning.WGMMA_TOKEN_TILES`` and ``tuning.WGMMA_ROWS``.

``--plans`` times instead every plan the planner's time model weighs (``tuning.WGMMA_KTILE_US``):
each token tile with K split into 1, 2, 4 and 8 equal pieces, summed in thread block clusters and
in the workspace, and the tile's automatic plan, beside cuBLAS and the dispatcher's own plan, in
the layout a layer holds on the GPU; the JSON keeps every cell (``t{tile}_s{pieces}_{c|w}``).

Method (``scripts/_bench_common.py``): weight copies rotated past twice the L2, calls replayed
from one CUDA graph, median of 7 replays, microseconds per call.

Usage::

    python3 scripts/bench_wgmma.py --json out.json --md out.md
    python3 scripts/bench_wgmma.py --shape 4096 14336 --m 64 256 --bits 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

import kbit_linear  # noqa: E402,F401
from kbit_linear import format as fmt  # noqa: E402
from kbit_linear import weight_layout  # noqa: E402
from kbit_linear.backends import cuda as kcuda  # noqa: E402
from kbit_linear.backends.cuda import decode, hopper, ops, plans, tuning  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
MS = [17, 32, 64, 128, 256, 512, 1024, 4096]


def _time(fn, n_copies: int) -> float:
    return bc.time_calls(fn, n_copies, target_ms=3.0, repeats=7, min_calls=min(2 * n_copies, 200), max_calls=200,
                         fallback=False).us


def _force_tile(tile: int | None, saved: dict) -> None:
    """Every M takes ``tile`` (None: restore the table)."""
    tuning.WGMMA_TOKEN_TILES.clear()
    tuning.WGMMA_TOKEN_TILES.update(saved if tile is None else {"default": ((tile, 1 << 30),)})
    plans.clear()


def _weights(k: int, n: int, bits: int, dtype: torch.dtype) -> tuple[fmt.KbitWeight, list[fmt.KbitWeight], list[torch.Tensor]]:
    """A random ``n x k`` weight quantized in the layout a KbitLinear holds on this GPU (4-bit
    pair codes), its copies rotated past the L2, and copies of the dense weight in ``dtype``."""
    w = torch.randn(n, k, device="cuda") * 0.02
    qw = fmt.quantize(w, bits)
    qw = fmt.KbitWeight(weight_layout.device_form(qw.packed, bits), qw.absmax, qw.codebook, qw.tensor_scale, bits, n, k)
    qws = bc.weight_copies(qw, nbytes=bc.tensor_bytes(qw.packed, qw.absmax),
                           make=lambda: fmt.KbitWeight(qw.packed.clone(), qw.absmax.clone(), qw.codebook, qw.tensor_scale, bits, n, k))
    return qw, qws, bc.weight_copies(w.to(dtype))


def bench(k: int, n: int, bits: int, dtype: torch.dtype, ms: list[int], splits: bool = False) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    qw, qws, dense = _weights(k, n, bits, dtype)
    saved = dict(tuning.WGMMA_TOKEN_TILES)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)

        def call(**kw):
            return lambda i: kcuda.gemm_cuda(x, qws[i % len(qws)].packed, qws[i % len(qws)].absmax, qw.codebook, qw.tensor_scale,
                                             bits, n, **kw)

        row: dict[str, Any] = {"k": k, "n": n, "bits": bits, "dtype": str(dtype)[6:], "m": m}
        row["cublas"] = _time(lambda i: F.linear(x, dense[i % len(dense)]), len(dense))
        try:
            for tile in hopper.TOKEN_TILES:
                _force_tile(tile, saved)
                row[f"wgmma{tile}"] = _time(call(path="wgmma"), len(qws))
        finally:
            _force_tile(None, saved)
        if splits:  # the automatic tile with every K-split choice of the planner forced
            row["unsplit"] = _time(call(path="wgmma", split_k=1), len(qws))
            row["split2"] = _time(call(path="wgmma", split_k=2), len(qws))
            row["split4"] = _time(call(path="wgmma", split_k=4), len(qws))
            row["stream-K"] = _time(call(path="wgmma-splitk"), len(qws))
        row["fused"] = _time(call(path="fused"), len(qws))
        row["dequant+cublas"] = _time(call(path="dequant+cublas"), len(qws))
        if decode.decode_supported(m, bits, dtype):
            row["decode"] = _time(call(path="decode"), len(qws))
        row["auto"] = _time(call(), len(qws))
        row["auto_path"] = kcuda.gemm_path(m, n, k, bits, dtype)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def bench_plans(k: int, n: int, bits: int, ms: list[int]) -> list[dict[str, Any]]:
    """Every (token tile, pieces, cluster or workspace) plan and each tile's automatic plan, fp16."""
    dev = torch.device("cuda")
    qw, qws, dense = _weights(k, n, bits, torch.float16)
    saved_tiles, saved_clusters = dict(tuning.WGMMA_TOKEN_TILES), tuning.WGMMA_CLUSTER_SPLITS
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)

        def call(**kw):
            return lambda i: kcuda.gemm_cuda(x, qws[i % len(qws)].packed, qws[i % len(qws)].absmax, qw.codebook, qw.tensor_scale,
                                             bits, n, **kw)

        row: dict[str, Any] = {"k": k, "n": n, "bits": bits, "m": m, "cublas": _time(lambda i: F.linear(x, dense[i % len(dense)]), len(dense)),
                               "auto": _time(call(), len(qws)), "auto_path": kcuda.gemm_path(m, n, k, bits, torch.float16)}
        try:
            for tile in hopper.TOKEN_TILES:
                for clusters in (True, False):
                    _force_tile(tile, saved_tiles)
                    tuning.WGMMA_CLUSTER_SPLITS = (2, 4, 8) if clusters else ()
                    for pieces in (1, 2, 4, 8):
                        plan = ops._plan(m, n, k, bits, torch.float16, torch.cuda.current_device(), "wgmma", pieces, bits == 4)
                        if clusters and pieces > 1 and plan.cluster == 1:
                            continue  # not a cluster launch (pieces not aligned, or more clusters than the GPU holds)
                        if pieces > 1 or clusters:
                            row[f"t{tile}_s{pieces}_{'c' if clusters else 'w'}"] = _time(call(path="wgmma", split_k=pieces), len(qws))
                tuning.WGMMA_CLUSTER_SPLITS = saved_clusters
                plans.clear()
                row[f"t{tile}_auto"] = _time(call(path="wgmma"), len(qws))
        finally:
            tuning.WGMMA_CLUSTER_SPLITS = saved_clusters
            _force_tile(None, saved_tiles)
        best = min((v, c) for c, v in row.items() if c.startswith("t") and isinstance(v, float))
        row["best"], row["best_plan"] = best
        rows.append(row)
        print(f"| {k}x{n} | {bits} | {m} | {row['cublas']:.1f} | {row['auto']:.1f} ({row['auto_path']}) | {best[0]:.1f} ({best[1]}) |",
              flush=True)
    return rows


PLANS_HEADER = "| in x out | bits | M | cuBLAS us | auto us (path) | best forced plan us (tile, pieces, cluster/workspace) |\n|---|---|---|---|---|---|"


COLUMNS = ["cublas"] + [f"wgmma{t}" for t in hopper.TOKEN_TILES] + ["unsplit", "split2", "split4", "stream-K", "fused", "dequant+cublas", "decode", "auto"]
HEADER = ("| in x out | bits | dtype | M | " + " | ".join(f"{c} us" for c in COLUMNS) + " | auto path | best wgmma / cuBLAS |\n|"
          + "---|" * (len(COLUMNS) + 6))


def _line(r: dict[str, Any]) -> str:
    best = min(r[f"wgmma{t}"] for t in hopper.TOKEN_TILES)
    cells = [bc.fmt(r.get(c)) if c in r else "-" for c in COLUMNS]
    return f"| {r['k']}x{r['n']} | {r['bits']} | {r['dtype']} | {r['m']} | " + " | ".join(cells) + f" | {r['auto_path']} | {best / r['cublas']:.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=2, type=int, action="append", metavar=("IN", "OUT"), help="shapes (default: four Llama shapes)")
    ap.add_argument("--m", nargs="+", type=int, default=MS)
    ap.add_argument("--bits", nargs="+", type=int, default=[4])
    ap.add_argument("--dtypes", nargs="+", default=["fp16"], choices=["fp16", "bf16"])
    ap.add_argument("--splits", action="store_true", help="also time the automatic tile unsplit, split in two and four, and stream-K")
    ap.add_argument("--plans", action="store_true", help="time every plan of the planner's time model instead (fp16)")
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--md", help="write the markdown table")
    args = ap.parse_args()
    dev = bc.require_cuda()
    if not hopper.supported(dev.index if dev.index is not None else torch.cuda.current_device()):
        sys.exit("the wgmma kernel needs a GPU of compute capability 9.0")
    env = bc.environment(dev)
    head = f"{env.get('gpu', torch.cuda.get_device_name())}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}"
    rows = []
    if args.plans:
        print(head + "\n\n" + PLANS_HEADER, flush=True)
        for k, n in args.shape or SHAPES:
            for bits in args.bits:
                rows += bench_plans(k, n, bits, args.m)
        if args.json:
            bc.write_json(args.json, {"environment": env, "rows": rows})
        return
    print(head + "\n\n" + HEADER, flush=True)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for k, n in args.shape or SHAPES:
        for bits in args.bits:
            for d in args.dtypes:
                rows += bench(k, n, bits, dtypes[d], args.m, args.splits)
    if args.json:
        bc.write_json(args.json, {"environment": env, "rows": rows})
    if args.md:
        bc.write_text(args.md, head + "\n\n" + HEADER + "\n" + "\n".join(_line(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
