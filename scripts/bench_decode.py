"""Time the small-M decode kernel against the memory roofline, cuBLAS and torch's int4 tinygemm.

Method (``scripts/_bench_common.py``): every kernel call runs on one of several copies of its
weight, enough copies that together they fill twice the GPU's L2 (its size read from the device
properties); 200 calls cycling through the copies (more for small weights: every copy once) are
captured in one CUDA graph, the graph is replayed several times and the median replay time
divided by the number of calls is reported. The device-to-device copy bandwidth is measured in
the same run and the roofline is ``(packed + absmax + x + out bytes) / copy bandwidth`` (bytes
read + written).

Usage (from the repository root, on a GPU machine):

    python3 scripts/bench_decode.py                      # K = 2..5, M = 1, 4, 16, the listed shapes
    python3 scripts/bench_decode.py --bits 4 --m 1 --shapes 8192x28672 --variants
    python3 scripts/bench_decode.py --json results.json
    ncu -k regex:kbit_decode --launch-skip 2 --launch-count 1 python3 scripts/bench_decode.py \
        --profile-calls 3 --bits 4 --m 1 --dtypes fp16 --shapes 4096x4096

Shapes are ``in_features x out_features``. ``--variants`` also times other launch shapes of the
kernel (warps, warps along K, row groups per warp, loads in flight) for tuning, with each schedule
of ``--variant-schedules``. ``--overlap`` also times each case without programmatic dependent
launch, and behind a torch kernel that writes x. The markdown
table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.backends.cuda import decode, loader  # noqa: E402
from kbit_linear.backends.cuda.tuning import DECODE_VARIANTS  # noqa: E402

MIN_CALLS = 200  # calls per CUDA graph (rounded up to whole rotations through the copies)
DEFAULT_SHAPES = ("4096x4096", "4096x14336", "14336x4096", "8192x28672", "576x192")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}



def time_calls(fn: Callable[[int], object], copies: int) -> float:
    """Median seconds per call of ``fn(i % copies)``, from CUDA-graph replays of whole rotations."""
    calls = -(-max(MIN_CALLS, copies) // copies) * copies
    return bc.time_calls(fn, copies, min_calls=calls, max_calls=calls, repeats=7, fallback=False).us * 1e-6


def rotation(make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """``make()`` weights, enough to fill twice the L2 (no cap: small weights get thousands, so
    that none is still in L2 when its turn comes again)."""
    return bc.weight_copies(make(), make=make, max_copies=None)


def random_kbit(k: int, n: int, bits: int) -> fmt.KbitWeight:
    """A random (non-zero) tiled weight: every bit pattern is a valid kbit weight."""
    n_pad, k_pad = fmt.padded_shape(n, k)
    kt, nt = k_pad // fmt.TILE_K, n_pad // fmt.TILE_N
    cb = fmt.create_normal_float_codebook(bits, "cuda")
    ts = torch.tensor([2.0 ** -6], device="cuda")
    packed = torch.randint(-(2**31), 2**31 - 1, (kt, nt, fmt.TILE_N, 2, bits), device="cuda", dtype=torch.int32)
    absmax = torch.randint(0x50, 0xD0, (kt, nt, fmt.TILE_N, 2), device="cuda", dtype=torch.uint8)
    return fmt.KbitWeight(packed, absmax, cb, ts, bits, n, k)


def kbit_rotation(k: int, n: int, bits: int) -> list[fmt.KbitWeight]:
    """Random kbit weights of one shape, enough to rotate past L2 (as :func:`rotation`)."""
    first = random_kbit(k, n, bits)
    return bc.weight_copies(first, nbytes=bc.tensor_bytes(first.packed, first.absmax),
                            make=lambda: random_kbit(k, n, bits), max_copies=None)


def bench_kbit(k: int, n: int, bits: int, m: int, dtype: torch.dtype, cfg: decode.DecodeConfig | None = None,
               weights: list[fmt.KbitWeight] | None = None, sched: str = "auto", writer: bool = False) -> tuple[float, int]:
    """(seconds per call, bytes moved) for the decode kernel; ``writer``: each call follows a
    torch kernel that writes x (as in a model, where a norm or activation produces it)."""
    if weights is None:
        weights = kbit_rotation(k, n, bits)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    x_src = x.clone()
    out = torch.empty(m, n, device="cuda", dtype=dtype)

    def call(i: int) -> None:
        w = weights[i]
        if writer:
            torch.mul(x_src, 1.0, out=x)
        decode.decode_gemm(x, w.packed, w.absmax, w.codebook, w.tensor_scale, bits, n, out, config=cfg, schedule_kind=sched)

    nbytes = weights[0].packed.nbytes + weights[0].absmax.nbytes + x.nbytes + out.nbytes
    return time_calls(call, len(weights)), nbytes


def bench_cublas(k: int, n: int, m: int, dtype: torch.dtype) -> float:
    """Seconds per call of ``F.linear`` with a dense weight of the same shape."""
    ws = rotation(lambda: torch.randn(n, k, device="cuda", dtype=dtype))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    return time_calls(lambda i: F.linear(x, ws[i]), len(ws))


def bench_tinygemm(k: int, n: int, m: int) -> float | None:
    """torch's int4 tinygemm (group 128, bf16 activations), or None where it is unavailable."""
    try:
        packs = rotation(
            lambda: torch._convert_weight_to_int4pack(torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8), 8)
        )
        sz = torch.randn(k // 128, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        return time_calls(lambda i: torch._weight_int4pack_mm(x, packs[i], 128, sz), len(packs))
    except Exception as e:  # noqa: BLE001 - a missing or changed private API only drops the column
        print(f"tinygemm unavailable for {k}x{n}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def host_overhead_us(k: int, n: int, bits: int, m: int, dtype: torch.dtype, calls: int = 300) -> float:
    """Wall time per eager call (Python + launch), for a shape small enough to be launch-bound."""
    w = random_kbit(k, n, bits)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    return bc.eager_wall_us(lambda: decode.decode_gemm(x, w.packed, w.absmax, w.codebook, w.tensor_scale, bits, n, out),
                            calls, warmup=20, wait=False)


def overlap_row(k: int, n: int, bits: int, m: int, dtype: torch.dtype, weights: list[fmt.KbitWeight], t_on: float) -> dict:
    """Times (us) of one case without programmatic launch and behind a torch kernel that writes
    x; ``t_on`` is the default launch's time."""
    row: dict = dict(pdl_on_us=t_on * 1e6)
    old = loader.set_programmatic_launch(False)
    try:
        row["pdl_off_us"] = bench_kbit(k, n, bits, m, dtype, weights=weights)[0] * 1e6
        row["writer_off_us"] = bench_kbit(k, n, bits, m, dtype, weights=weights, writer=True)[0] * 1e6
    finally:
        loader.set_programmatic_launch(old)
    row["writer_on_us"] = bench_kbit(k, n, bits, m, dtype, weights=weights, writer=True)[0] * 1e6
    plan = decode.decode_plan(m, bits, dtype, n, weights[0].packed.shape[0])
    row["programmatic"] = plan.programmatic
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="in_features x out_features, e.g. 4096x14336")
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    ap.add_argument("--variants", action="store_true", help="also time other launch shapes")
    ap.add_argument("--variant-shapes", nargs="+", default=["4096x4096", "8192x28672"], help="shapes --variants applies to")
    ap.add_argument("--variant-schedules", nargs="+", default=["auto"], choices=list(decode.SCHEDULES),
                    help="schedules each --variants launch shape is timed with")
    ap.add_argument("--overlap", action="store_true",
                    help="also time each case without programmatic launch, and behind a torch kernel that writes x "
                         "(with and without programmatic launch)")
    ap.add_argument("--no-peers", action="store_true", help="skip cuBLAS and tinygemm")
    ap.add_argument("--json", type=Path, help="write all results here")
    ap.add_argument("--profile-calls", type=int, default=0,
                    help="only run this many eager calls per case (no timing), for a profiler such as ncu")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU")
    torch.manual_seed(0)
    if args.profile_calls:
        for shape in args.shapes:
            k, n = (int(v) for v in shape.lower().split("x"))
            for bits in args.bits:
                w = random_kbit(k, n, bits)
                for dname in args.dtypes:
                    for m in args.m:
                        x = torch.randn(m, k, device="cuda", dtype=DTYPES[dname])
                        out = torch.empty(m, n, device="cuda", dtype=DTYPES[dname])
                        for _ in range(args.profile_calls):
                            decode.decode_gemm(x, w.packed, w.absmax, w.codebook, w.tensor_scale, bits, n, out)
        torch.cuda.synchronize()
        return
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    bw = bc.measure_copy_bandwidth(torch.device("cuda", dev), nbytes=2**30, repeats=20) * 1e9  # bytes/s
    head = (f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
            f"date {datetime.date.today()}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(head, flush=True)
    print("command: python3 " + " ".join(sys.argv), flush=True)
    rows, variant_rows, overlap_rows = [], [], []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        peers: dict[tuple[str, int], tuple[float | None, float | None]] = {}
        if not args.no_peers:
            for dname in args.dtypes:
                for m in args.m:
                    cub = bench_cublas(k, n, m, DTYPES[dname])
                    tiny = bench_tinygemm(k, n, m) if dname == "bf16" else None
                    peers[(dname, m)] = (cub, tiny)
            torch.cuda.empty_cache()
        for bits in args.bits:
            weights = kbit_rotation(k, n, bits)
            for dname in args.dtypes:
                dtype = DTYPES[dname]
                for m in args.m:
                    t, nbytes = bench_kbit(k, n, bits, m, dtype, weights=weights)
                    plan = decode.decode_plan(m, bits, dtype, n, weights[0].packed.shape[0])
                    cub, tiny = peers.get((dname, m), (None, None))
                    roof = nbytes / bw
                    row = dict(shape=shape, bits=bits, dtype=dname, m=m, us=t * 1e6, roofline_us=roof * 1e6,
                               pct_roofline=100 * roof / t, cublas_us=None if cub is None else cub * 1e6,
                               tinygemm_us=None if tiny is None else tiny * 1e6, grid=plan.grid, split=plan.split,
                               schedule=plan.schedule, config=plan.name)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.overlap:
                        orow = overlap_row(k, n, bits, m, dtype, weights, t)
                        orow.update(shape=shape, bits=bits, dtype=dname, m=m, roofline_us=roof * 1e6)
                        overlap_rows.append(orow)
                        print("overlap " + json.dumps(orow), flush=True)
                    if args.variants and dname == args.dtypes[0] and shape in args.variant_shapes:
                        for v in DECODE_VARIANTS.get((bits, 1 if m <= 8 else 2), []):
                            cfg = decode.DecodeConfig(*v)
                            for sched in args.variant_schedules:
                                try:
                                    vplan = decode.decode_plan(m, bits, dtype, n, weights[0].packed.shape[0], config=cfg,
                                                               schedule_kind=sched)
                                except ValueError:
                                    continue  # the schedule does not apply to this shape
                                tv, _ = bench_kbit(k, n, bits, m, dtype, cfg=cfg, weights=weights, sched=sched)
                                vr = dict(shape=shape, bits=bits, dtype=dname, m=m, config=v, schedule=vplan.schedule,
                                          grid=vplan.grid, us=tv * 1e6, pct_roofline=100 * roof / tv)
                                variant_rows.append(vr)
                                print("variant " + json.dumps(vr), flush=True)
            del weights
            torch.cuda.empty_cache()
    overhead = host_overhead_us(576, 192, 4, 1, torch.float16)
    if args.json:
        args.json.write_text(json.dumps(dict(header=head, copy_bw=bw, rows=rows, variants=variant_rows, overlap=overlap_rows,
                                             host_us=overhead), indent=1))
    if variant_rows:
        print("\n| shape | K | M | (warps, warps along K, row groups, depth, blocks/SM) | schedule (grid) | us | % roofline |\n"
              "|---|---|---|---|---|---|---|")
        for v in variant_rows:
            print(f"| {v['shape']} | {v['bits']} | {v['m']} | {tuple(v['config'])} | {v['schedule']} ({v['grid']}) | {v['us']:.1f} | "
                  f"{v['pct_roofline']:.0f} |")
    if overlap_rows:
        print("\nProgrammatic dependent launch (PDL), us per call (back to back; 'writer + call': each call follows a "
              "torch kernel that writes x, pair time; PDL is used only where the plan allows it)")
        print("| shape | K | dtype | M | roofline | plan uses PDL | PDL off | PDL on | writer + call, PDL off | writer + call, PDL on |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for o in overlap_rows:
            print(f"| {o['shape']} | {o['bits']} | {o['dtype']} | {o['m']} | {o['roofline_us']:.1f} | {'yes' if o['programmatic'] else 'no'} | "
                  f"{o['pdl_off_us']:.1f} | {o['pdl_on_us']:.1f} | {o['writer_off_us']:.1f} | {o['writer_on_us']:.1f} |")
    print(f"\n{head}\nhost overhead of one eager decode_gemm call (576x192, launch-bound): {overhead:.1f} us")
    print("\n| shape (K x N) | K | dtype | M | us | roofline us | % roofline | cuBLAS us | x vs cuBLAS | tinygemm us | x vs tinygemm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cub = "-" if r["cublas_us"] is None else f"{r['cublas_us']:.1f}"
        vc = "-" if r["cublas_us"] is None else f"{r['cublas_us'] / r['us']:.2f}"
        tg = "-" if r["tinygemm_us"] is None else f"{r['tinygemm_us']:.1f}"
        vt = "-" if r["tinygemm_us"] is None else f"{r['tinygemm_us'] / r['us']:.2f}"
        print(f"| {r['shape']} | {r['bits']} | {r['dtype']} | {r['m']} | {r['us']:.1f} | {r['roofline_us']:.1f} | "
              f"{r['pct_roofline']:.0f} | {cub} | {vc} | {tg} | {vt} |")


if __name__ == "__main__":
    main()
