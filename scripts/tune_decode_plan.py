"""Measure and check the decode kernel's plan cost model (``tuning.DECODE_*_COST_BYTES``).

The decode plan (``kbit_linear.backends.cuda.decode``) picks a launch shape and a schedule by a
cost in bytes (:func:`decode.schedule`). This script measures what every choice really takes and
says how far the plans the model picks are from the fastest one, so its constants can be refitted
when a kernel or a GPU changes.

``collect`` (GPU): for each bit width, M and problem, every launch shape of
``tuning.DECODE_VARIANTS`` and ``all_decode_configs()`` on every schedule that applies, timed in CUDA
graphs over weight copies (or expert routings) that together exceed twice the L2; dense layers
from 2048->512 to 28672->8192 and the grouped (mixture-of-experts) launches of Qwen3-MoE and
Mixtral expert shapes. 4- and 5-bit weights are pair codes, as layers hold them on the GPU.

``evaluate`` (no GPU needed): for each collected case, the plan the code makes now (its own
planner, with the collected GPU's SM count and shared memory) and its measured time against the
fastest measured choice; the geometric mean and the worst case per bit width. Every group of a
collected grouped case has rows, so a grouped whole-tile plan's switch to stream-K (which
depends on how many experts a call hits) never fires there: the cases measure the plan's choice,
not that switch. ``--fit`` also
searches the four cost constants (random search from the current values) and prints the best
set with its figures: the constants are then rounded and written into ``tuning.py`` by hand.

Usage (from the repository root):

    python3 scripts/tune_decode_plan.py collect --bits 4 --m 1 4 16 --json decode-fit.json   # on the GPU
    python3 scripts/tune_decode_plan.py evaluate decode-fit.json [more.json ...] [--fit]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.backends.cuda import decode, loader, plans, tuning  # noqa: E402

DENSE = ("4096x4096", "4096x14336", "14336x4096", "8192x28672", "28672x8192", "4096x6144", "4096x1024", "2048x4096",
         "4096x2048", "2048x512", "3584x18944", "18944x3584", "1024x4096", "5120x13824", "2048x5120")
"""Dense layers, in_features x out_features (Llama-3-8B/70B, Qwen2-7B, Qwen3-MoE attention (2048x5120: q, k and v
fused), small ones)."""

GROUPED = ((2048, 1536, 128, 8), (768, 2048, 128, 8), (2048, 1536, 128, 32), (768, 2048, 128, 32),
           (4096, 28672, 8, 2), (14336, 4096, 8, 2), (4096, 28672, 8, 8), (14336, 4096, 8, 8))
"""Grouped launches: (in_features, out_features per expert, experts, groups used): Qwen3-30B-A3B's
gate_up and down at one and four tokens, Mixtral-8x7B's at one token and at four or more."""

COSTS = ("DECODE_SEGMENT_COST_BYTES", "DECODE_SHARED_SEGMENT_COST_BYTES", "DECODE_SPLIT_COST_BYTES",
         "DECODE_SPLIT_PIECE_COST_BYTES")
"""The cost constants ``decode.schedule`` reads (``--fit`` varies them)."""


# ---------------------------------------------------------------------------------------
# collect (GPU)
# ---------------------------------------------------------------------------------------


def _time_rotation(calls: list[Callable[[], None]], min_calls: int = 120) -> float:
    """Median microseconds per call of a CUDA graph that cycles through ``calls``."""
    return bc.time_calls(lambda i: calls[i](), len(calls), min_calls=max(min_calls, len(calls)), max_calls=max(min_calls, len(calls)),
                         repeats=5, fallback=False).us


def _shape_key(config: tuning.DecodeConfig) -> list[int]:
    """A launch shape as the JSON stores it: its fields in order."""
    return list(vars(config).values())


def _launch_shapes(bits: int, mt: int) -> list[tuning.DecodeConfig]:
    shapes = [tuning.DecodeConfig(*v) for v in tuning.DECODE_VARIANTS[(bits, mt)]]
    return shapes + [c for c in tuning.all_decode_configs()[(bits, mt)] if c not in shapes]


def _collect_case(bits: int, m: int, k: int, n: int, experts: int | None, used: int | None) -> dict[str, Any]:
    dtype = torch.float16
    cb = fmt.create_normal_float_codebook(bits, "cuda")
    l2 = bc.l2_bytes()
    if experts is None:
        first = bc.random_tiles(k, n, bits)
        nbytes = bc.tensor_bytes(*first)
        weights = [first] + [bc.random_tiles(k, n, bits) for _ in range(bc.copies_past_l2(nbytes, l2) - 1)]
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        scale = torch.tensor([2.0 ** -6], device="cuda")
        k_tiles, groups, packed0 = first[0].shape[0], None, first[0]

        def calls(plan: decode.DecodePlan) -> list[Callable[[], None]]:
            return [lambda w=w: decode.launch(plan, x, w[0], w[1], cb, scale, out) for w in weights]
    else:
        packed0, absmax = bc.random_tiles(k, n, bits, experts)
        x = torch.randn(used * m, k, device="cuda", dtype=dtype)
        out = torch.empty(used * m, n, device="cuda", dtype=dtype)
        scale = torch.full((experts,), 2.0 ** -6, device="cuda")
        # routings that hit different experts, enough that their weights exceed twice the L2
        per_routing = (packed0[0].nbytes + absmax[0].nbytes) * used
        gen = torch.Generator().manual_seed(0)
        routings = []
        for _ in range(min(16, bc.copies_past_l2(per_routing, l2))):
            ids = torch.randperm(experts, generator=gen)[:used].sort().values.to(torch.int32)
            rows = torch.arange(used, dtype=torch.int32) * m
            routings.append(torch.stack([ids, rows, torch.full((used,), m, dtype=torch.int32)]).cuda().contiguous())
        k_tiles, groups = packed0.shape[1], used

        def calls(plan: decode.DecodePlan) -> list[Callable[[], None]]:
            return [lambda g=g: decode.launch_grouped(plan, x, packed0, absmax, cb, scale, g, out) for g in routings]

    pairs = fmt.is_pair_codes(packed0)
    mt = 1 if m <= 8 else 2
    auto = decode.decode_plan(m, bits, dtype, n, k_tiles, torch.device("cuda"), groups=groups, pairs=pairs)
    case = {"bits": bits, "m": m, "mt": mt, "k": k, "n": n, "experts": experts, "groups": groups,
            "auto": {"config": _shape_key(auto.config), "schedule": auto.schedule, "grid": auto.grid,
                     "us": _time_rotation(calls(auto))},
            "variants": []}
    for cfg in _launch_shapes(bits, mt):
        for kind in ("stream-k", "tiles", "tile-split"):
            try:
                plan = decode.decode_plan(m, bits, dtype, n, k_tiles, torch.device("cuda"), config=cfg, schedule_kind=kind,
                                          groups=groups, pairs=pairs)
            except ValueError:  # this schedule does not apply to the shape
                continue
            case["variants"].append({"config": _shape_key(cfg), "schedule": kind, "grid": plan.grid,
                                     "us": _time_rotation(calls(plan))})
    return case


def collect(args: argparse.Namespace) -> None:
    device = bc.require_cuda()
    props = loader.device_properties(loader._device_index(device))
    payload = {"environment": bc.environment(device), "sm_count": props.sm_count, "shared_per_sm": props.shared_per_sm,
               "max_shared_per_block": props.max_shared_per_block, "cases": []}
    for bits in args.bits:
        for m in args.m:
            problems = [(int(s.split("x")[0]), int(s.split("x")[1]), None, None) for s in DENSE]
            problems += [g for g in GROUPED if m <= 8 or g[3] <= 8]
            for k, n, experts, used in problems:
                case = _collect_case(bits, m, k, n, experts, used)
                best = min(case["variants"], key=lambda v: v["us"])
                print(f"K={bits} M={m} {_label(case)}: plan {case['auto']['us']:.1f} us, fastest {best['us']:.1f} "
                      f"({tuple(best['config'])} {best['schedule']})", flush=True)
                payload["cases"].append(case)
                bc.write_json(args.json, payload)
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------
# evaluate (CPU)
# ---------------------------------------------------------------------------------------


def _label(case: dict[str, Any]) -> str:
    shape = f"{case['k']}x{case['n']}"
    return shape if case["experts"] is None else f"{shape} grouped E{case['experts']} G{case['groups']}"


def _measured(case: dict[str, Any], config: list[int], kind: str, grid: int) -> float | None:
    """The timing of (launch shape, schedule, grid) in ``case``; None where that exact choice was
    not timed (a split of another piece count, say)."""
    return next((v["us"] for v in case["variants"]
                 if v["config"] == config and v["schedule"] == kind and v["grid"] == grid), None)


def gpu_properties(data: dict[str, Any]) -> SimpleNamespace:
    """What the planner reads of the GPU a collected file comes from (its name picks
    ``tuning.DECODE_CONFIGS_BY_GPU``)."""
    return SimpleNamespace(sm_count=data["sm_count"], shared_per_sm=data["shared_per_sm"],
                           max_shared_per_block=data["max_shared_per_block"], name=data["environment"]["gpu"])


def _picks(cases: list[dict[str, Any]], props: SimpleNamespace) -> list[tuple[dict[str, Any], float | None]]:
    """The measured time of the plan the planner makes now for each case (None: that choice
    was not measured), on faked device properties (no GPU, no compilation)."""
    saved = loader.device_properties, loader.get_kernel
    loader.device_properties = lambda index: props
    loader.get_kernel = lambda source, name, device, *a: name
    plans.clear()
    try:
        out = []
        for c in cases:
            k_tiles = fmt.padded_shape(c["n"], c["k"])[1] // fmt.TILE_K
            plan = decode.decode_plan(c["m"], c["bits"], torch.float16, c["n"], k_tiles, 0, groups=c["groups"],
                                      pairs=fmt.has_pair_codes(c["bits"]))
            out.append((c, _measured(c, _shape_key(plan.config), plan.schedule, plan.grid)))
        return out
    finally:
        loader.device_properties, loader.get_kernel = saved
        plans.clear()  # the plans hold the faked kernels


def _summary(picks: list[tuple[dict[str, Any], float | None]]) -> dict[int, tuple[float, float, str]]:
    """Per bit width: geometric mean and worst of (plan time / fastest time), and the worst
    case. A plan whose exact choice was not timed counts as the slowest variant of the case."""
    logs: dict[int, list[tuple[float, str]]] = {}
    for case, us in picks:
        times = [v["us"] for v in case["variants"]]
        ratio = (us if us is not None else max(times)) / min(times)
        logs.setdefault(case["bits"], []).append((math.log(ratio), f"M={case['m']} {_label(case)}"))
    return {b: (math.exp(sum(x for x, _ in v) / len(v)), math.exp(max(v)[0]), max(v)[1]) for b, v in sorted(logs.items())}


def collected_picks(cases: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float | None]]:
    """The plans the collecting code made (``auto``), timed as variants: the same timing runs
    as the current plans' (a plan timed twice varies by up to ~10 % on the largest launches)."""
    return [(c, _measured(c, c["auto"]["config"], c["auto"]["schedule"], c["auto"]["grid"])) for c in cases]


def _print(summary: dict[int, tuple[float, float, str]], title: str) -> None:
    print(title)
    for bits, (geo, worst, where) in summary.items():
        print(f"  K = {bits}: plans {100 * (geo - 1):.1f} % above the fastest choice on average, worst {100 * (worst - 1):.1f} % ({where})")


def evaluate(args: argparse.Namespace) -> None:
    cases: list[dict[str, Any]] = []
    props = None
    for path in args.json:
        data = json.loads(Path(path).read_text())
        p = gpu_properties(data)
        if props is not None and p != props:
            raise SystemExit(f"{path} comes from another GPU ({p}) than the files before it ({props})")
        props = p
        cases += data["cases"]
    if not cases:
        raise SystemExit("no cases in the given files")
    _print(_summary(collected_picks(cases)), "plans as collected:")
    _print(_summary(_picks(cases, props)), "plans the code makes now: " + ", ".join(f"{n} {getattr(tuning, n)}" for n in COSTS))
    if not args.fit:
        return

    def score(values: dict[str, float]) -> float:
        for name, value in values.items():
            setattr(decode, name, value)
        return sum(math.log(geo) for geo, _, _ in _summary(_picks(cases, props)).values())

    rng = random.Random(0)
    best = {n: float(getattr(tuning, n)) for n in COSTS}
    best_score = score(best)
    try:
        for _ in range(args.fit_steps):
            trial = dict(best)
            for name in rng.sample(COSTS, rng.randint(1, 2)):
                trial[name] = max(0.0, trial[name] + rng.gauss(0.0, 0.15 * max(trial[name], 8192.0)))
            s = score(trial)
            if s < best_score - 1e-9:
                best, best_score = trial, s
        score(best)
        _print(_summary(_picks(cases, props)), "best constants found: " + ", ".join(f"{n} {v:.0f}" for n, v in best.items()))
    finally:
        for name in COSTS:
            setattr(decode, name, getattr(tuning, name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="time every launch shape x schedule (GPU)")
    c.add_argument("--bits", type=int, nargs="+", default=list(fmt.SUPPORTED_BITS), choices=fmt.SUPPORTED_BITS)
    c.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    c.add_argument("--json", type=Path, required=True)
    e = sub.add_parser("evaluate", help="how far the plans are from the fastest measured choice")
    e.add_argument("json", nargs="+", type=Path)
    e.add_argument("--fit", action="store_true", help="also search the cost constants")
    e.add_argument("--fit-steps", type=int, default=600)
    args = parser.parse_args()
    for m in getattr(args, "m", []):
        if not 1 <= m <= decode.MAX_M:
            parser.error(f"--m values must be in 1..{decode.MAX_M}, got {m}")
    collect(args) if args.command == "collect" else evaluate(args)


if __name__ == "__main__":
    main()
