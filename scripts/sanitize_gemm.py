"""A sweep of kbit GEMM and format-kernel launches for compute-sanitizer (memcheck, racecheck).

Every GEMM path (decode with each schedule, the grouped decode kernel of mixture-of-experts
layers, fused, fused-splitk, wgmma, wgmma-splitk, wgmma with K split over clusters of 2, 4 and 8
blocks, and the grouped wgmma kernel (each token tile, and its fused SwiGLU where a weight's
halves end on an n-tile) on GPUs of compute capability 9.0,
dequantize + cuBLAS), bits 2..5 (``--pairs``: the 4- and 5-bit weights as pair codes),
fp16 and bf16, M from 1 to 300, small odd shapes and Llama-sized ones, a bias, and the quantize /
repack / dequantize kernels that build each weight; with ``--bits`` including 4 (they have no
kbit width, so one process runs them) also the GGUF block-format kernels (dequantize, the
small-M GEMM and the 8-bit-activation path, every type, M 1..64). Every result is checked against the float32 reference; the
script exits non-zero if one is wrong.

    compute-sanitizer --tool racecheck --kernel-name kns=kbit_ --error-exitcode 3 python3 scripts/sanitize_gemm.py
    compute-sanitizer --tool memcheck --kernel-name kns=kbit_ --error-exitcode 3 python3 scripts/sanitize_gemm.py --quick --bits 4

``--quick`` keeps the small shapes only; the default adds the Llama-sized ones. ``--bits``
picks bit widths, so that one process per width can run side by side (the sanitizers are
slow: racecheck takes about a second per Llama-sized decode launch). ``--kernel-name kns=kbit_``
keeps the sanitizer to this package's kernels (cuBLAS's own kernels, taken by the
dequantize + cuBLAS path, are not ours to check). ``--only wgmma`` keeps the launches whose
label starts with the given prefixes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbit_linear import format as fmt  # noqa: E402
from kbit_linear import gguf_format as gf  # noqa: E402
from kbit_linear.backends import cuda as kcuda  # noqa: E402
from kbit_linear.backends.cuda import decode as kdecode  # noqa: E402
from kbit_linear.backends.cuda import grouped as kgrouped  # noqa: E402
from kbit_linear.backends.cuda import hopper, plans, tuning  # noqa: E402
from kbit_linear.backends.cuda.tensors import kernel_rows  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)
# (n, k): out_features, in_features. Small ones are not tile multiples; the stream-K ranges of
# 1000 x 1000 start and end inside row tiles, so short and shared segments both occur; 512 x 200
# is a gate_up weight whose halves end on an n-tile (the grouped kernel's fused SwiGLU).
SMALL_SHAPES = ((129, 100), (1000, 1000), (192, 576), (33, 264), (512, 200))
LLAMA_SHAPES = ((4097, 2048), (4096, 4096), (1024, 4096))
M_ALL = (1, 3, 9, 16, 17, 64, 300)
M_LLAMA = (1, 16, 64, 300)
REL_TOL = 2e-2
GGUF_SHAPES = ((129, 160), (33, 1024), (1000, 4096))
# The small-M kernel's range (M > 64 is the dequantize kernel, checked on its own, + cuBLAS).
GGUF_M = (1, 3, 9, 17, 33, 64)


def _weight(n: int, k: int, bits: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    w = torch.randn(n, k, device=dev)
    w[: max(1, n // 9), : min(k, 40)] *= 20.0  # uneven block scales
    cb = fmt.create_normal_float_codebook(bits, dev)
    ts = fmt.compute_tensor_scale(w)
    pf, af = torch.ops.kbit_linear.quantize(w, cb, ts, bits)
    packed, absmax = torch.ops.kbit_linear.repack(pf, af, bits)
    wd = torch.ops.kbit_linear.dequantize(packed, absmax, cb, ts, bits, n, k, torch.float32)
    return packed, absmax, cb, ts, wd


def _calls(m: int, n: int, k: int, bits: int, dtype: torch.dtype, dev: torch.device, every_path: bool) -> list[tuple[str, dict]]:
    """(label, keyword arguments) of the launches for one problem: the dispatcher's choice, and
    with ``every_path`` each other path and decode schedule that applies (else only the split
    ones, which the large shapes exist to exercise)."""
    # The dequant+cublas path's matmul is cuBLAS's kernel, not ours (and cuBLAS fails under
    # racecheck): the sweep runs our dequantize kernel for it instead.
    calls = [] if kcuda.gemm_path(m, n, k, bits, dtype, dev) == "dequant+cublas" else [("auto", {})]
    if m <= kdecode.MAX_M and kdecode.decode_supported(m, bits, dtype, dev):
        schedules = ("stream-k", "tiles", "tile-split") if every_path else ("stream-k",)
        calls += [(f"decode/{s}", {"schedule": s}) for s in schedules]
        calls.append(("grouped", {"grouped": True}))
    if every_path:
        calls.append(("fused", {"path": "fused", "split_k": 1}))
    calls.append(("fused-splitk", {"path": "fused-splitk"}))
    if hopper.supported(dev.index if dev.index is not None else torch.cuda.current_device()):
        if every_path:
            calls.append(("wgmma", {"path": "wgmma", "split_k": 1}))
        calls.append(("wgmma-splitk", {"path": "wgmma-splitk"}))
        # K split into P pieces summed in thread block clusters, whatever tuning.WGMMA_CLUSTER_SPLITS allows
        calls += [(f"wgmma-cluster/{p}", {"path": "wgmma", "split_k": p, "clusters": True}) for p in (2, 4, 8) if -(-k // fmt.TILE_K) % p == 0]
        calls += [(f"grouped-wgmma/{bt}", {"grouped": True, "token_tile": bt}) for bt in hopper.TOKEN_TILES]
        if kgrouped.swiglu_fusable(-(-n // fmt.TILE_N), n // 2):
            calls += [(f"grouped-wgmma-swiglu/{bt}", {"grouped": True, "token_tile": bt, "swiglu": True}) for bt in hopper.TOKEN_TILES]
    if every_path and m >= 17:
        calls.append(("dequantize", {"dequantize": True}))  # the dequant+cublas path's own kernel
    return calls


def _run(x: torch.Tensor, bias: torch.Tensor, qw: tuple[torch.Tensor, ...], bits: int, n: int,
         kw: dict) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """One launch into a NaN-filled output (None: the decode schedule does not apply); for
    ``dequantize``, the dense weight multiplied in fp32. A launch whose result is not the plain
    product (the fused SwiGLU) returns ``(result, its float32 reference)``."""
    packed, absmax, cb, ts, _ = qw
    if kw.get("dequantize"):  # dense weight in x's dtype, multiplied here in fp32
        w = kcuda.dequantize_cuda(packed, absmax, cb, ts, bits, n, x.shape[1], x.dtype)
        return (x.float() @ w.float().t() + bias.float()).to(x.dtype)
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    if kw.get("grouped"):
        # the weight as experts 1 and 2 of three (expert 0 all zero): x's rows split into two
        # groups, plus an empty one
        m = x.shape[0]
        packed3 = torch.stack((torch.zeros_like(packed), packed, packed))
        absmax3 = torch.stack((torch.zeros_like(absmax), absmax, absmax))
        a = m // 2
        groups = torch.tensor([[1, 0, 2], [0, 0, a], [a, 0, m - a]], dtype=torch.int32, device=x.device)
        ts3 = ts.expand(3).contiguous()
        if "token_tile" in kw:  # the Hopper grouped kernel, a grid of half the items (blocks walk several)
            plan = kgrouped.grouped_plan(m, 3, bits, x.dtype, packed.shape[1], x.get_device(), token_tile=kw["token_tile"],
                                         pairs=fmt.is_pair_codes(packed),
                                         grid=max(1, -(-n // 128)))
            if kw.get("swiglu"):  # silu(gate) * up of the two halves' products, no bias
                # x / 16 (exact): the product of two K-long sums of the sweep's weights passes
                # fp16's 65504 at K = 2048 and up, where an fp16 result is inf by right
                xs = x * 0.0625
                h = torch.full((m, n // 2), float("nan"), dtype=x.dtype, device=x.device)
                kgrouped.launch(plan, kernel_rows(xs), packed3, absmax3, cb, ts3, groups, h, swiglu=True)
                gate, up = F.linear(xs.float(), qw[-1]).chunk(2, dim=-1)
                return h, F.silu(gate) * up
            kgrouped.launch(plan, kernel_rows(x), packed3, absmax3, cb, ts3, groups, out)
        else:
            kdecode.grouped_decode_gemm(x, packed3, absmax3, cb, ts3, groups, bits, n, out, max(a, m - a, 1))
        return out + bias
    if "schedule" in kw:
        try:
            kdecode.decode_gemm(x, packed, absmax, cb, ts, bits, n, out, schedule_kind=kw["schedule"])
        except ValueError:  # this schedule kind does not apply to the shape
            return None
        return out + bias
    if kw.get("clusters"):
        kw = {key: v for key, v in kw.items() if key != "clusters"}
        saved, tuning.WGMMA_CLUSTER_SPLITS = tuning.WGMMA_CLUSTER_SPLITS, (2, 4, 8)
        plans.clear()
        try:
            return kcuda.gemm_cuda(x, packed, absmax, cb, ts, bits, n, bias, out=out, **kw)
        finally:
            tuning.WGMMA_CLUSTER_SPLITS = saved
            plans.clear()
    return kcuda.gemm_cuda(x, packed, absmax, cb, ts, bits, n, bias, out=out, **kw)


def _gguf_sweep(dev: torch.device, verbose: bool) -> tuple[int, int]:
    """The GGUF kernels on random weights of every type: (launches, wrong)."""
    launches = bad = 0
    for qtype, t in sorted(gf.BLOCK_TYPES.items()):
        for n, k in GGUF_SHAPES:
            raw = torch.randint(0, 256, (n, k // gf.BLOCK, t.block_bytes), dtype=torch.uint8)
            w = gf.split_blocks(raw, qtype, n, k)
            w.scale = (torch.rand(w.scale.shape) * 0.01).to(torch.float16)
            if w.mins is not None:
                w.mins = (torch.randn(w.mins.shape) * 0.01).to(torch.float16)
            w = w.to(dev)
            for dtype in DTYPES:
                dense = gf.dequantize(w, dtype)
                launches += 1
                if not torch.equal(torch.ops.kbit_linear.gguf_dequantize(w.qs, w.qh, w.scale, w.mins, qtype, n, k, dtype), dense):
                    bad += 1
                    print(f"WRONG: gguf-dequantize {qtype} {k}->{n} {dtype}", flush=True)
                for m in GGUF_M:
                    if verbose:
                        print(f"launch: M={m} {k}->{n} {qtype} {dtype} gguf-gemm", flush=True)
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                    ref = F.linear(x.float(), dense.float())
                    for label, op in (("gguf-gemm", torch.ops.kbit_linear.gguf_gemm), ("gguf-gemm-a8", torch.ops.kbit_linear.gguf_gemm_a8)):
                        y = op(x, w.qs, w.qh, w.scale, w.mins, qtype, n, None)
                        launches += 1
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        if not err < REL_TOL * (3 if label.endswith("a8") else 1) or torch.isnan(y).any().item():
                            bad += 1
                            print(f"WRONG: M={m} {k}->{n} {qtype} {dtype} {label}: rel err {err:.2e}", flush=True)
        print(f"gguf {qtype}: done", flush=True)
    return launches, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--bits", type=int, nargs="+", default=list(fmt.SUPPORTED_BITS), choices=fmt.SUPPORTED_BITS)
    parser.add_argument("--shapes", nargs="+", help="out x in shapes to run instead of the built-in lists, e.g. 1000x1000")
    parser.add_argument("--only", nargs="+", help="run only the launches whose label starts with one of these (e.g. wgmma decode)")
    parser.add_argument("--pairs", action="store_true",
                        help="hold the 4- and 5-bit weights as pair codes (docs/format.md, section 7a), as modules do on a GPU")
    parser.add_argument("--verbose", action="store_true", help="name each launch before it runs (with CUDA_LAUNCH_BLOCKING=1 the last name is the culprit)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.shapes:
        cases = [(tuple(int(v) for v in s.split("x")), M_ALL, True) for s in args.shapes]
    else:
        cases = [(s, M_ALL, True) for s in SMALL_SHAPES] + ([] if args.quick else [(s, M_LLAMA, False) for s in LLAMA_SHAPES])
    bad = launches = 0
    for (n, k), ms, every_path in cases:
        for bits in args.bits:
            qw = _weight(n, k, bits, dev)
            if args.pairs and fmt.has_pair_codes(bits):
                qw = (fmt.to_pair_codes(qw[0]), *qw[1:])
            wd = qw[-1]
            for dtype in DTYPES:
                bias = torch.randn(n, device=dev, dtype=dtype)
                for m in ms:
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                    ref = F.linear(x.float(), wd, bias.float())
                    for label, kw in _calls(m, n, k, bits, dtype, dev, every_path):
                        if args.only and not label.startswith(tuple(args.only)):
                            continue
                        if args.verbose:
                            print(f"launch: M={m} {k}->{n} bits={bits} {dtype} {label}", flush=True)
                        y = _run(x, bias, qw, bits, n, kw)
                        if y is None:
                            continue
                        y, expected = y if isinstance(y, tuple) else (y, ref)
                        launches += 1
                        err = ((y.float() - expected).norm() / expected.norm()).item()
                        ok = err < REL_TOL and not torch.isnan(y).any().item()
                        if not ok:
                            bad += 1
                            print(f"WRONG: M={m} {k}->{n} bits={bits} {dtype} {label}: rel err {err:.2e}", flush=True)
            print(f"{k}->{n} bits={bits}: done", flush=True)
    if 4 in args.bits and (not args.only or any(o.startswith("gguf") for o in args.only)):
        extra, extra_bad = _gguf_sweep(dev, args.verbose)
        launches, bad = launches + extra, bad + extra_bad
    torch.cuda.synchronize()
    print(f"{launches} GEMM launches checked, {bad} wrong", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
