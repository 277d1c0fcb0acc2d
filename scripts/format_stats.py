#!/usr/bin/env python3
"""Print the quality of the kbit format on Gaussian weights, with NF4 (blocksize 64) for comparison.

For K = 2..5: SQNR with the stored E4M4 scales and with exact fp32 block absmax, the largest
absolute error, the largest error relative to its block absmax, and bits per weight including
the scales. NF4 is the bitsandbytes 4-bit normal-float table with a float32 absmax per 64
weights (4.5 bits/weight), quantized by the same nearest-entry rule.

    python scripts/format_stats.py [--n 1048576] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from kbit_linear import format as fmt

# The 16 NF4 levels of bitsandbytes / QLoRA (asymmetric, with an exact zero).
NF4_LEVELS = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    return float(10 * torch.log10(w.pow(2).sum() / (w - w_hat).pow(2).sum()))


def blockwise_fp32(w: torch.Tensor, codebook: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-entry quantization with exact float32 absmax per ``block`` weights; returns (w_hat, absmax)."""
    blocks = w.reshape(-1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    x = blocks / amax.clamp_min(torch.finfo(torch.float32).tiny)
    mids = (codebook[:-1] + codebook[1:]) * 0.5
    idx = torch.searchsorted(mids, x.contiguous(), right=False)
    return (codebook[idx] * amax).reshape(w.shape), amax


def row(name: str, bpw: float, w: torch.Tensor, w_hat: torch.Tensor, block: int, fp32_db: float | None) -> str:
    """One markdown row of the table."""
    err = (w - w_hat).abs()
    amax = w.reshape(-1, block).abs().amax(-1, keepdim=True)
    rel = (err.reshape(-1, block) / amax).max().item()
    fp32 = f"{fp32_db:.2f}" if fp32_db is not None else "-"
    return f"| {name} | {bpw:.3f} | {sqnr_db(w, w_hat):.2f} | {fp32} | {err.max().item():.4f} | {rel:.4f} | {err.mean().item():.4f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 20, help="number of N(0,1) values (multiple of 1024)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.n <= 0 or args.n % 1024:
        parser.error("--n must be a positive multiple of 1024")

    g = torch.Generator().manual_seed(args.seed)
    w = torch.randn(args.n // 1024, 1024, generator=g)
    print(f"{args.n} N(0,1) values, seed {args.seed}\n")
    print("| format | bits/weight | SQNR dB (stored scales) | SQNR dB (fp32 absmax) | max abs err | max err / block absmax | mean abs err |")
    print("|---|---|---|---|---|---|---|")
    for bits in fmt.SUPPORTED_BITS:
        w_hat = fmt.dequantize(fmt.quantize(w, bits))
        ref, _ = blockwise_fp32(w, fmt.create_normal_float_codebook(bits), fmt.BLOCK_SIZE)
        bpw = bits + 8 / fmt.BLOCK_SIZE
        print(row(f"kbit K={bits} (E4M4 / 32)", bpw, w, w_hat, fmt.BLOCK_SIZE, sqnr_db(w, ref)))
    nf4_hat, _ = blockwise_fp32(w, torch.tensor(NF4_LEVELS), 64)
    print(row("NF4 (fp32 absmax / 64)", 4 + 32 / 64, w, nf4_hat, 64, None))


if __name__ == "__main__":
    main()
