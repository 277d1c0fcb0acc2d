"""Kernel benchmark: ``C = A @ W^T`` with kbit weights against cuBLAS and the peers a user would
pick instead, in one run on one GPU, beside the measured hardware limits.

Rows per (shape, M, activation dtype):

* ``kbit K=2..5``: ``torch.ops.kbit_linear.gemm`` with the CUDA backend; the path column names the
  kernel that ``kbit_linear.backends.cuda.gemm_path`` says was taken.
* ``cuBLAS``: ``F.linear`` with the dense fp16/bf16 weight.
* ``tinygemm int4 g128``: ``torch._weight_int4pack_mm`` (torch's int4 kernel; CUDA accepts only
  bf16 activations, so it has bf16 rows only).
* ``bnb NF4 b64``: ``bitsandbytes.matmul_4bit``, blocksize 64, no double quantization
  (when bitsandbytes imports and its CUDA library loads).
* ``gemlite int4 g64`` (and ``int2`` with ``--gemlite-bits 4 2``): gemlite's Triton kernels,
  HQQ-style asymmetric groups of 64 (when gemlite imports). gemlite uses the tuned H100 configs
  it ships where it has one for the (M, N, K); elsewhere its GEMM kernels pick between their
  two default configs (the full search compiles ~23 Triton variants per shape and M, minutes
  per shape).
* Marlin has no prebuilt build for this torch; it is reported as absent.

Method (``scripts/_bench_common.py``): weight copies rotated so the working set is at least twice
L2, many calls replayed from one CUDA graph (plain CUDA-event timing, marked ``events``, where a
peer cannot be captured), median of repeats. Device-to-device copy bandwidth and the fp16 matmul
peak (8192^3) are measured in the same run. The roofline of a row is
``max((weight bytes + A bytes + C bytes) / copy bandwidth, 2*M*N*K / matmul peak)``.

Each peer's output is also compared with ``A @ W^T`` in float32 on the unquantized weight
(``rel_err`` in the JSON): it includes the peer's quantization error and flags a broken setup.

Usage::

    python3 scripts/bench_gemm.py --json out.json --plot out.png --md out.md
    python3 scripts/bench_gemm.py --quick
    python3 scripts/bench_gemm.py --shape 5120 13824 --no-default-shapes --m 1 16
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above)

DEFAULT_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
DEFAULT_MS = [1, 4, 16, 64, 256, 1024, 4096]
QUICK_SHAPES = [(4096, 4096), (4096, 14336)]
QUICK_MS = [1, 16, 256, 1024]
ALL_BITS = [2, 3, 4, 5]
PEERS = ["cublas", "tinygemm", "bnb", "gemlite", "kbit"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MARLIN_NOTE = (
    "Marlin: no prebuilt wheel works with torch 2.11 (the PyPI builds target older torch ABIs); "
    "not measured here"
)


@dataclass
class Impl:
    """One prepared implementation at one shape and activation dtype.

    Attributes:
        name: row label.
        kind: "kbit", "cublas" or "peer".
        call: ``call(x, i)`` computes ``x @ W^T`` with weight copy ``i``.
        n_copies: weight copies ``call`` rotates through.
        weight_bytes: bytes of one copy of the stored weight (planes or codes plus scales).
        path: ``path(m, dtype)`` names the kernel taken at ``M = m`` (kbit only).
    """

    name: str
    kind: str
    call: Callable[[torch.Tensor, int], torch.Tensor]
    n_copies: int
    weight_bytes: int
    path: Callable[[int, torch.dtype], str] = field(default=lambda m, dtype: "")
    setup_s: float = 0.0


# ---------------------------------------------------------------------------------------
# implementations
# ---------------------------------------------------------------------------------------


def make_cublas(w: torch.Tensor, dtype: torch.dtype, l2: int) -> Impl:
    """Dense ``F.linear`` on ``w`` cast to ``dtype``."""
    one = w.to(dtype)
    copies = bc.weight_copies(one, l2)
    return Impl("cuBLAS", "cublas", lambda x, i: F.linear(x, copies[i]), len(copies), bc.tensor_bytes(one))


def _tinygemm_pack(w: torch.Tensor, group: int = 128, inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups along in_features in tinygemm's layout.

    Dequantized weight: ``q * scale + min`` stored as ``(q - 8) * scale + zero`` with
    ``zero = min + 8 * scale``; scales and zeros interleaved as bf16 ``[K/group, N, 2]``.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(packed_u8, inner_k_tiles)
    zero = lo + 8 * scale
    sz = torch.cat([scale, zero], dim=-1).reshape(n, k // group, 2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def make_tinygemm(w: torch.Tensor, l2: int) -> Impl:
    """torch's int4 tinygemm, group 128 (bf16 activations only)."""
    packed, sz = _tinygemm_pack(w)
    copies = bc.weight_copies((packed, sz), l2)
    return Impl(
        "tinygemm int4 g128", "peer",
        lambda x, i: torch._weight_int4pack_mm(x, copies[i][0], 128, copies[i][1]), len(copies), bc.tensor_bytes(packed, sz),
    )


def make_bnb(bnb: Any, w: torch.Tensor, dtype: torch.dtype, l2: int) -> Impl:
    """bitsandbytes NF4, blocksize 64, fp32 absmax (no double quantization)."""
    def build() -> tuple[torch.Tensor, Any]:
        return bnb.functional.quantize_4bit(w.to(dtype), blocksize=64, compress_statistics=False, quant_type="nf4")

    wq, state = build()
    nbytes = bc.tensor_bytes(wq, state.absmax)
    copies = bc.weight_copies((wq, state), l2, nbytes=nbytes, make=build)
    return Impl(
        "bnb NF4 b64", "peer", lambda x, i: bnb.matmul_4bit(x, copies[i][0].t(), quant_state=copies[i][1]), len(copies), nbytes
    )


def _hqq_groups(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max groups in HQQ's convention ``W ~ (W_q - zero) * scale``."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    qmax = 2**bits - 1
    scale = (hi - lo).clamp(min=1e-6) / qmax
    zero = -lo / scale
    q = (g / scale + zero).round().clamp(0, qmax).to(torch.uint8).reshape(n, k)
    return q, scale.reshape(n, k // group), zero.reshape(n, k // group)


def make_gemlite(gemlite: Any, w: torch.Tensor, dtype: torch.dtype, bits: int, l2: int) -> Impl:
    """gemlite weight-only ``bits``-bit, groups of 64."""
    from gemlite.helper import A16Wn

    q, scale, zero = _hqq_groups(w, bits, 64)

    def build() -> Any:
        return A16Wn(device=str(w.device), dtype=dtype).from_weights(q, scale, zero, W_nbits=bits, group_size=64)

    first = build()
    nbytes = bc.tensor_bytes(first.W_q, first.scales, getattr(first, "zeros", None))
    layers = bc.weight_copies(first, l2, nbytes=nbytes, make=build)
    return Impl(f"gemlite int{bits} g64", "peer", lambda x, i: layers[i](x), len(layers), nbytes)


def _has_pair_codes(bits: int) -> bool:
    from kbit_linear import format as kfmt

    return kfmt.has_pair_codes(bits)


def make_kbit(w: torch.Tensor, bits: int, l2: int, cuda_backend: Any, planes: bool = False) -> Impl:
    """kbit weights through ``torch.ops.kbit_linear.gemm`` (the CUDA backend's kernels), in the
    layout a ``KbitLinear`` holds on the GPU (pair codes at 4 and 5 bits), or with ``planes`` as bit-planes."""
    from kbit_linear import format as kfmt
    from kbit_linear import weight_layout

    n_out, k_in = w.shape
    packed, absmax, codebook, ts = bc.quantize_rows(w, bits)
    if not planes:
        packed = weight_layout.device_form(packed, bits)
    copies = bc.weight_copies((packed, absmax), l2)

    def call(x: torch.Tensor, i: int) -> torch.Tensor:
        return torch.ops.kbit_linear.gemm(x, copies[i][0], copies[i][1], codebook, ts, bits, n_out, None)

    def path(m: int, dtype: torch.dtype) -> str:
        return str(cuda_backend.gemm_path(m, n_out, k_in, bits, dtype, w.device, pairs=kfmt.is_pair_codes(packed)))

    return Impl(f"kbit K={bits}" + (" planes" if planes else ""), "kbit", call, len(copies), bc.tensor_bytes(packed, absmax), path)


# ---------------------------------------------------------------------------------------
# one measurement
# ---------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """``||out - x @ w^T|| / ||x @ w^T||`` in float32."""
    ref = x.float() @ w.float().t()
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def measure(impl: Impl, x: torch.Tensor, args: argparse.Namespace) -> bc.Timing:
    """Time ``impl`` at activations ``x``."""
    return bc.time_calls(lambda i: impl.call(x, i), impl.n_copies, target_ms=args.target_ms, repeats=args.repeats)


def roofline_us(weight_bytes: int, m: int, n: int, k: int, act_bytes: int, ceilings: dict[str, float]) -> float:
    """Ideal microseconds: the larger of the memory time and the matmul time."""
    moved = weight_bytes + act_bytes * m * (n + k)
    return 1e6 * max(moved / (ceilings["copy_gbps"] * 1e9), 2 * m * n * k / (ceilings["matmul_tflops"] * 1e12))


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def prepare_peers(
    args: argparse.Namespace, w: torch.Tensor, dtype: torch.dtype, l2: int, libs: dict[str, Any], notes: list[str]
) -> list[Impl]:
    """Every non-kbit implementation that applies to ``dtype``; failures become notes."""
    names = args.peers
    out: list[Impl] = []
    steps: list[tuple[str, Callable[[], Impl]]] = []
    if "cublas" in names:
        steps.append(("cuBLAS", lambda: make_cublas(w, dtype, l2)))
    if "tinygemm" in names and dtype == torch.bfloat16:
        steps.append(("tinygemm", lambda: make_tinygemm(w, l2)))
    if "bnb" in names and libs.get("bitsandbytes") is not None:
        steps.append(("bnb", lambda: make_bnb(libs["bitsandbytes"], w, dtype, l2)))
    if "gemlite" in names and libs.get("gemlite") is not None:
        for b in args.gemlite_bits:
            steps.append((f"gemlite int{b}", lambda b=b: make_gemlite(libs["gemlite"], w, dtype, b, l2)))
    for label, make in steps:
        try:
            t = time.perf_counter()
            out.append(make())
            out[-1].setup_s = time.perf_counter() - t
        except Exception as exc:  # noqa: BLE001  (a peer that fails to set up is reported, not fatal)
            notes.append(f"{label} {tuple(w.shape[::-1])} {dtype}: setup failed: {type(exc).__name__}: {exc}"[:300])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every requested row; returns the JSON payload."""
    device = bc.require_cuda()
    torch.manual_seed(0)
    env = bc.environment(device)
    l2 = env["l2_bytes"]
    notes: list[str] = [MARLIN_NOTE]
    libs: dict[str, Any] = {}
    for lib in ("bitsandbytes", "gemlite"):
        key = "bnb" if lib == "bitsandbytes" else lib
        if key in args.peers:
            mod, why = bc.optional_import(lib)
            libs[lib] = mod
            if mod is None:
                notes.append(f"{lib}: not importable ({why}); row absent")
            elif lib == "gemlite":
                # GEMM kernels (M >= 5): shipped tuned configs where gemlite has one, else a
                # choice between its 2 default configs instead of a ~23-config search. (A single
                # default config would bypass the shipped cache, so the GEMV kernels keep "fast".)
                mod.set_autotune({"GEMM": "default", "GEMM_SPLITK": "default"})
                notes.append("gemlite: shipped H100 configs where gemlite has one for the (M, N, K); otherwise "
                             "GEMM kernels (M >= 5) pick between gemlite's 2 default configs instead of its "
                             "~23-config search, GEMV kernels (M <= 4) run gemlite's fast autotune")
    cuda_backend = None
    if "kbit" in args.peers:
        ok, why = bc.kbit_cuda_status()
        if ok:
            import kbit_linear.backends.cuda as cuda_backend  # noqa: F811
        else:
            notes.append(f"kbit rows absent: {why}")

    t0 = time.perf_counter()
    ceilings = {
        "copy_gbps": bc.measure_copy_bandwidth(device),
        "matmul_tflops": bc.measure_matmul_peak(device),
    }
    print(f"# {env['gpu']}: copy {ceilings['copy_gbps']:.0f} GB/s, fp16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s", flush=True)

    rows: list[dict[str, Any]] = []
    for k_in, n_out in args.shapes:
        ts = time.perf_counter()
        w = torch.randn(n_out, k_in, device=device) * 0.02
        kbit_impls: list[Impl] = []
        if cuda_backend is not None:
            for bits in args.bits:
                for planes in (False, True) if args.planes and _has_pair_codes(bits) else (False,):
                    try:
                        t = time.perf_counter()
                        kbit_impls.append(make_kbit(w, bits, l2, cuda_backend, planes))
                        kbit_impls[-1].setup_s = time.perf_counter() - t
                    except Exception as exc:  # noqa: BLE001
                        notes.append(f"kbit K={bits} {k_in}x{n_out}: setup failed: {type(exc).__name__}: {exc}"[:300])
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            impls = prepare_peers(args, w, dtype, l2, libs, notes) + kbit_impls
            x_check = torch.randn(16, k_in, device=device, dtype=dtype)
            errs: dict[str, float] = {}
            for impl in impls:
                try:
                    errs[impl.name] = rel_err(impl.call(x_check, 0), x_check, w)
                except Exception as exc:  # noqa: BLE001
                    notes.append(f"{impl.name} {k_in}x{n_out} {dname}: call failed: {type(exc).__name__}: {exc}"[:300])
            for m in args.ms:
                x = torch.randn(m, k_in, device=device, dtype=dtype)
                for impl in impls:
                    if impl.name not in errs:
                        continue
                    try:
                        t_wall = time.perf_counter()
                        t = measure(impl, x, args)
                        t_wall = time.perf_counter() - t_wall
                    except Exception as exc:  # noqa: BLE001
                        notes.append(f"{impl.name} {k_in}x{n_out} {dname} M={m}: timing failed: {type(exc).__name__}: {exc}"[:300])
                        continue
                    path = impl.path(m, dtype)
                    rows.append({
                        "in": k_in, "out": n_out, "m": m, "dtype": dname, "impl": impl.name, "kind": impl.kind,
                        "path": path, "weight_bytes": impl.weight_bytes, "copies": impl.n_copies,
                        "rel_err": errs[impl.name], "setup_s": impl.setup_s, "wall_s": t_wall, **t.as_dict(),
                    })
            del impls
            torch.cuda.empty_cache()
        del kbit_impls, w
        torch.cuda.empty_cache()
        print(f"# {k_in}x{n_out}: {time.perf_counter() - ts:.1f} s", flush=True)

    derive(rows, ceilings)
    payload = {
        "env": env, "ceilings": ceilings, "rows": rows, "notes": notes,
        "config": {"shapes": args.shapes, "ms": args.ms, "bits": args.bits, "dtypes": args.dtypes,
                   "peers": args.peers, "repeats": args.repeats, "target_ms": args.target_ms},
    }
    if "kbit" in args.peers and cuda_backend is not None:
        payload["host_overhead"] = host_overhead(device, args)
    payload["wall_s"] = time.perf_counter() - t0
    return payload


def derive(rows: list[dict[str, Any]], ceilings: dict[str, float]) -> None:
    """Add TFLOP/s, GB/s, % of copy bandwidth, roofline and speedups to every row (in place)."""
    cublas = {(r["in"], r["out"], r["m"], r["dtype"]): r["us"] for r in rows if r["kind"] == "cublas"}
    best: dict[tuple[int, int, int], tuple[float, str]] = {}
    for r in rows:
        if r["kind"] != "kbit":
            key = (r["in"], r["out"], r["m"])
            if key not in best or r["us"] < best[key][0]:
                best[key] = (r["us"], f"{r['impl']} {r['dtype']}" if r["kind"] == "peer" else f"cuBLAS {r['dtype']}")
    for r in rows:
        m, n, k, us = r["m"], r["out"], r["in"], r["us"]
        moved = r["weight_bytes"] + 2 * m * (n + k)
        r["tflops"] = 2 * m * n * k / (us * 1e-6) / 1e12
        r["weight_gbps"] = r["weight_bytes"] / (us * 1e-6) / 1e9
        r["pct_copy_bw"] = 100 * moved / (us * 1e-6) / 1e9 / ceilings["copy_gbps"]
        r["roofline_us"] = roofline_us(r["weight_bytes"], m, n, k, 2, ceilings)
        c = cublas.get((k, n, m, r["dtype"]))
        r["vs_cublas"] = c / us if c else None
        b = best.get((k, n, m))
        r["best_peer"] = b[1] if b else None
        r["best_peer_us"] = b[0] if b else None
        r["vs_best_peer"] = b[0] / us if b else None


def host_overhead(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Host time of one eager ``KbitLinear`` forward at M = 1 (4096 -> 4096, 4 bits, fp16).

    Wall time of many back-to-back eager calls, per call, minus the GPU time per call measured
    from a CUDA graph: what the CPU adds when the GPU is not the limit. ``nn.Linear`` is measured
    the same way for reference.
    """
    res: dict[str, Any] = {}
    lin = torch.nn.Linear(4096, 4096, bias=False, device=device, dtype=torch.float16)
    try:
        klin = bc.kbit_api("KbitLinear").from_linear(lin, bits=4)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"KbitLinear unavailable: {type(exc).__name__}: {exc}"[:300]}
    x = torch.randn(1, 4096, device=device, dtype=torch.float16)
    for name, mod in (("KbitLinear", klin), ("nn.Linear", lin)):
        with torch.inference_mode():
            gpu = bc.time_calls(lambda i: mod(x), 1, target_ms=1.0, repeats=args.repeats)
            wall = bc.eager_wall_us(lambda: mod(x), 2000, warmup=50)
        res[name] = {"eager_wall_us": wall, "gpu_us": gpu.us, "host_overhead_us": wall - gpu.us, "gpu_method": gpu.method}
    return res


# ---------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------


def long_table(rows: list[dict[str, Any]]) -> str:
    """Every row with every column."""
    headers = ["in x out", "M", "dtype", "impl", "path", "us", "TFLOP/s", "weight GB/s", "% copy BW",
               "vs cuBLAS", "vs best peer", "timing"]
    body = []
    for r in rows:
        body.append([
            f"{r['in']}x{r['out']}", r["m"], r["dtype"], r["impl"], r["path"] or "", bc.fmt(r["us"]),
            bc.fmt(r["tflops"]), bc.fmt(r["weight_gbps"], 0), bc.fmt(r["pct_copy_bw"], 0),
            bc.fmt(r["vs_cublas"], 2), bc.fmt(r["vs_best_peer"], 2), r["method"],
        ])
    return bc.markdown_table(headers, body)


def pivot_table(rows: list[dict[str, Any]], dtype: str, ceilings: dict[str, float]) -> str:
    """One line per (shape, M): microseconds of every implementation side by side."""
    sel = [r for r in rows if r["dtype"] == dtype or (r["kind"] == "peer" and r["impl"].startswith("tinygemm"))]
    names: list[str] = []
    for r in sel:
        label = r["impl"] if r["dtype"] == dtype else f"{r['impl']} ({r['dtype']})"
        if label not in names:
            names.append(label)
    peers = [n for n in names if not n.startswith("kbit")]
    kbits = [n for n in names if n.startswith("kbit")]
    cells: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in sel:
        label = r["impl"] if r["dtype"] == dtype else f"{r['impl']} ({r['dtype']})"
        d = cells.setdefault((r["in"], r["out"], r["m"]), {})
        star = "" if r["method"] == "graph" else "*"
        d[label] = f"{r['us']:.1f}{star}"
        if r["kind"] == "kbit" and r["path"]:
            d[label] += f" ({r['path']})"
        d["_best"] = r["best_peer_us"]
    headers = ["in x out", "M"] + peers + ["best peer"] + kbits + ["ideal K=4", "ideal K=2"]
    body = []
    for (k, n, m), d in cells.items():
        best = d.get("_best")
        ideal = [roofline_us(int(n * k * (b / 8 + 1 / 32)), m, n, k, 2, ceilings) for b in (4, 2)]
        body.append([f"{k}x{n}", m] + [d.get(p, "-") for p in peers] + [bc.fmt(best)]
                    + [d.get(b, "-") for b in kbits] + [bc.fmt(v) for v in ideal])
    return bc.markdown_table(headers, body)


def report(payload: dict[str, Any], with_rows: bool = True) -> str:
    """The markdown report: environment, pivot tables, host overhead, notes, and (optionally)
    the table of all rows."""
    env, ceil, rows = payload["env"], payload["ceilings"], payload["rows"]
    out = ["# kbit GEMM benchmark", ""] + bc.env_lines(env, ceil) + [f"- wall time of the run: {payload['wall_s']:.0f} s", ""]
    out += [
        "Microseconds per `C = A @ W^T` (CUDA-graph replay of many calls, weight copies rotated past L2, "
        "median of repeats; `*` = plain event timing, the call could not be captured). Ideal = "
        "max((packed bytes + A + C) / copy bandwidth, flops / matmul peak) for kbit at K bits. "
        "tinygemm accepts only bf16 activations; its bf16 time is shown in the fp16 table too. "
        "Best peer = the fastest non-kbit row at that shape and M in either activation dtype. "
        "kbit cells name the kernel path.", "",
    ]
    for dtype in payload["config"]["dtypes"]:
        if any(r["dtype"] == dtype for r in rows):
            out += [f"## {dtype} activations", "", pivot_table(rows, dtype, ceil), ""]
    if payload.get("host_overhead"):
        out += ["## Host overhead of one eager forward (M = 1, 4096 -> 4096, fp16)", ""]
        ho = payload["host_overhead"]
        if "error" in ho:
            out += [ho["error"], ""]
        else:
            out += [bc.markdown_table(
                ["module", "eager wall us/call", "GPU us/call", "host overhead us"],
                [[k, bc.fmt(v["eager_wall_us"]), bc.fmt(v["gpu_us"]), bc.fmt(v["host_overhead_us"])] for k, v in ho.items()],
            ), ""]
    if payload["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in payload["notes"]] + [""]
    if with_rows:
        out += ["## All rows", "", long_table(rows), ""]
    return "\n".join(out)


def plot(payload: dict[str, Any], path: str) -> None:
    """Time vs M per shape (log-log), one row of panels per activation dtype, roofline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows, ceil = payload["rows"], payload["ceilings"]
    shapes = list(dict.fromkeys((r["in"], r["out"]) for r in rows))
    dtypes = [d for d in payload["config"]["dtypes"] if any(r["dtype"] == d for r in rows)]
    if not shapes or not dtypes:
        return
    fig, axes = plt.subplots(len(dtypes), len(shapes), figsize=(4.2 * len(shapes), 3.8 * len(dtypes)), squeeze=False)
    styles = {"cuBLAS": ("black", "-"), "tinygemm int4 g128": ("tab:gray", "-"), "bnb NF4 b64": ("tab:brown", "-"),
              "gemlite int4 g64": ("tab:olive", "-"), "gemlite int2 g64": ("tab:cyan", "-"),
              "kbit K=2": ("tab:red", "-"), "kbit K=3": ("tab:orange", "-"), "kbit K=4": ("tab:blue", "-"),
              "kbit K=5": ("tab:purple", "-")}
    for i, dt in enumerate(dtypes):
        for j, (k, n) in enumerate(shapes):
            ax = axes[i][j]
            sel = [r for r in rows if r["in"] == k and r["out"] == n and r["dtype"] == dt]
            for name in dict.fromkeys(r["impl"] for r in sel):
                pts = sorted((r["m"], r["us"]) for r in sel if r["impl"] == name)
                color, ls = styles.get(name, (None, "-"))
                lw = 2.0 if name.startswith("kbit") else 1.2
                mk = "o" if name.startswith("kbit") else "."
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, lw=lw, marker=mk, ms=4, label=name)
            ms = sorted({r["m"] for r in sel})
            for bits, color in ((4, "tab:blue"), (2, "tab:red")):
                ideal = [roofline_us(int(n * k * (bits / 8 + 1 / 32)), m, n, k, 2, ceil) for m in ms]
                ax.plot(ms, ideal, ":", color=color, lw=1.2, label=f"roofline K={bits}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_title(f"{k} -> {n}, {dt}", fontsize=9)
            ax.set_xlabel("M (tokens)", fontsize=8)
            if j == 0:
                ax.set_ylabel("us per call (lower is better)", fontsize=8)
            ax.grid(True, which="both", alpha=0.25)
            ax.tick_params(labelsize=7)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    ncol = min(len(labels), max(3, 2 * len(shapes)))
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=ncol, fontsize=8)
    env = payload["env"]
    fig.suptitle(f"C = A @ W^T on {env['gpu']} (copy {ceil['copy_gbps']:.0f} GB/s, fp16 {ceil['matmul_tflops']:.0f} TFLOP/s)", fontsize=10)
    legend_rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, 0.03 + 0.035 * legend_rows / len(dtypes), 1, 0.96))
    bc.save_figure(fig, path)


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small subset (2 shapes, 4 values of M): about a minute")
    p.add_argument("--shape", nargs=2, type=int, action="append", metavar=("IN", "OUT"), default=[],
                   help="an extra shape (in_features out_features); repeatable")
    p.add_argument("--no-default-shapes", action="store_true", help="time only the --shape shapes")
    p.add_argument("--m", nargs="+", type=int, help="values of M (default 1 4 16 64 256 1024 4096)")
    p.add_argument("--bits", nargs="+", type=int, default=ALL_BITS, help="kbit widths (default 2 3 4 5)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS, help="which rows to time")
    p.add_argument("--planes", action="store_true",
                   help="also time the 4- and 5-bit weights as bit-planes (the modules hold pair codes on a GPU): a layout A/B")
    p.add_argument("--gemlite-bits", nargs="+", type=int, default=[4], choices=[2, 4],
                   help="gemlite weight widths (default 4; each width costs Triton compiles per shape and M)")
    p.add_argument("--repeats", type=int, default=5, help="timed graph replays per row (median reported)")
    p.add_argument("--target-ms", type=float, default=2.0, help="GPU time per graph replay")
    p.add_argument("--json", help="write all rows and the environment as JSON")
    p.add_argument("--plot", help="write the PNG plot")
    p.add_argument("--md", help="write the markdown report")
    args = p.parse_args(argv)
    shapes = [] if args.no_default_shapes else list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    shapes += [tuple(s) for s in args.shape if tuple(s) not in shapes]
    for k, n in shapes:
        if k <= 0 or n <= 0:
            p.error(f"--shape values must be positive, got {k} {n}")
    if not shapes:
        p.error("no shapes: give --shape IN OUT or drop --no-default-shapes")
    args.shapes = shapes
    args.ms = args.m or (QUICK_MS if args.quick else DEFAULT_MS)
    if any(m <= 0 for m in args.ms):
        p.error("--m values must be positive")
    if any(b not in ALL_BITS for b in args.bits):
        p.error(f"--bits must be among {ALL_BITS}")
    if args.repeats < 1 or args.target_ms <= 0:
        p.error("--repeats must be >= 1 and --target-ms > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run, then print the report and write the requested files."""
    args = parse_args(argv)
    payload = run(args)
    text = report(payload)
    bc.write_outputs(args, payload, text, plot)
    # The summary last: a reader of the tail of the output sees it.
    print(long_table(payload["rows"]) + "\n")
    print(report(payload, with_rows=False))


if __name__ == "__main__":
    main()
