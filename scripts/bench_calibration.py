"""Time calibrated rounding (``quantize_model(..., calibration=...)``) of a Llama-3-8B-shaped model on one GPU.

The model has random bf16 weights (``bench_generate.py``'s builder) and the calibration data are
random token ids, so the time is that of real 8B-shaped work: the block-by-block forward passes
that collect each layer's input Hessian and the GPTQ column sweep of every weight. Accuracy is
not measured here (``eval_ppl.py`` does that on real models). Reported per bit width: wall
seconds for the whole model, the peak GPU memory, the sweep alone (``gptq_quantize_blocks``) on
one weight of each Llama shape, and with ``--data-free`` the same model quantized data-free.

Usage::

    python3 scripts/bench_calibration.py --bits 4 --md bench/results/calibration-h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402
import bench_generate as bg  # noqa: E402

# (out_features, in_features) of the Llama-3-8B projections: q/o, k/v, gate/up, down.
SWEEP_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


def timed(fn: Any) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the GPU synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def sweep_seconds(shape: tuple[int, int], bits: int, dev: torch.device, act_order: bool) -> float:
    """Seconds of one ``gptq_quantize_blocks`` call on a random weight and Hessian of ``shape``."""
    from kbit_linear.calibration import gptq_quantize_blocks

    n, k = shape
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(n, k, device=dev, generator=g)
    x = torch.randn(2048, k, device=dev, generator=g)
    h = x.T @ x
    gptq_quantize_blocks(w[:64], h, bits, act_order=act_order)  # warm-up: kernels and caches
    _, s = timed(lambda: gptq_quantize_blocks(w, h, bits, act_order=act_order))
    return s


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Quantize the model data-free and calibrated at each width; return the measurements."""
    dev = bc.require_cuda()
    import kbit_linear

    config = bg.llama3_8b_config(args.layers)
    results: list[dict[str, Any]] = []
    for bits in args.bits:
        row: dict[str, Any] = {"bits": bits}
        if args.data_free:
            model = bg.build_bf16(config, dev)
            _, row["data_free_s"] = timed(lambda: kbit_linear.quantize_model(model, bits, progress=False))
            del model
            torch.cuda.empty_cache()

        model = bg.build_bf16(config, dev)
        tokens = torch.randint(0, config.vocab_size, (args.sequences, args.seq_len),
                               generator=torch.Generator().manual_seed(1))
        cal = kbit_linear.Calibration(tokens=tokens, batch_size=args.batch_size)
        torch.cuda.reset_peak_memory_stats(dev)
        summary, row["calibrated_s"] = timed(
            lambda: kbit_linear.quantize_model(model, bits, calibration=cal, progress=not args.quiet))
        row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        row["layers_converted"] = len(summary.converted)
        del model, summary
        torch.cuda.empty_cache()

        row["sweep_s"] = {f"{n}x{k}": sweep_seconds((n, k), bits, dev, act_order=True) for n, k in SWEEP_SHAPES}
        results.append(row)
        print(json.dumps(row), flush=True)
    return {"environment": bc.environment(dev), "layers": args.layers, "sequences": args.sequences,
            "seq_len": args.seq_len, "batch_size": args.batch_size, "results": results}


def _seconds(value: float | None) -> str:
    """A table cell for a time that may not have been measured."""
    return "not run" if value is None else f"{value:.1f}"


def report(payload: dict[str, Any]) -> str:
    """A markdown page for ``payload``."""
    env = payload["environment"]
    lines = [
        "# Calibrated rounding of a Llama-3-8B-shaped model: wall time on one GPU", "",
        f"- date: {env['date_utc']}; GPU: {env['gpu']} ({env['sm_count']} SMs); torch {env['torch']}, "
        f"transformers {env['transformers']}",
        f"- command: `{env['command']}`",
        f"- model: Llama-3-8B shape, {payload['layers']} decoder layers, random bf16 weights; every linear layer "
        f"but `lm_head` quantized; calibration: {payload['sequences']} x {payload['seq_len']} random tokens, "
        f"{payload['batch_size']} sequences per forward call, the library's defaults otherwise (activation "
        "order, fitted levels)",
        "- the sweep columns: one `gptq_quantize_blocks` call on a random weight (out x in) with a random "
        "Hessian, activation order", "",
    ]
    shapes = list(payload["results"][0]["sweep_s"]) if payload["results"] else []
    lines.append("| K | data-free s | calibrated s | peak GPU GiB | layers | " + " | ".join(f"sweep {s} s" for s in shapes) + " |")
    lines.append("|---" * (5 + len(shapes)) + "|")
    for r in payload["results"]:
        sweeps = " | ".join(f"{r['sweep_s'][s]:.2f}" for s in shapes)
        lines.append(f"| {r['bits']} | {_seconds(r.get('data_free_s'))} | {r['calibrated_s']:.1f} | {r['peak_gib']:.1f} | "
                     f"{r['layers_converted']} | {sweeps} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run, print and optionally save the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, nargs="+", default=[4], choices=[2, 3, 4, 5])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the 8B shape")
    ap.add_argument("--sequences", type=int, default=32, help="calibration sequences (the library's default: 32)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (the library's default: 512)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward call")
    ap.add_argument("--data-free", action="store_true", help="also time the data-free quantization of the same model")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--md", help="write the markdown page here")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)
    for name in ("layers", "sequences", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    payload = run(args)
    page = report(payload)
    print(page)
    if args.md:
        bc.write_text(args.md, page)
    if args.json:
        bc.write_json(args.json, payload)


if __name__ == "__main__":
    main()
