"""How many decode tiles a cache's widths cost: the allocator's layouts, ranked by token or by tile.

The KV decode kernel takes each key block's entries of one width ``TILE_ENTRIES`` (16) at a time,
so a key block costs ``sum over widths of ceil(count / 16)`` tiles: 4 for 64 tokens of one
width, 5 for 63 at 4 bits and one at 3. This replays the allocator alone (``allocate_row``,
as ``KbitKVLayer.reallocate`` calls it: the sinks, the recent window and the open key block at 8
bits and counted against the budget) over a growing context, one allocation every key block
from ``--start`` tokens on, with one random importance per token, drawn once (a running mean
of the attention mass changes slowly): ranked token by token (``allocate_by_tile=False``), and
ranked by groups of a key block's tokens (``allocate_by_tile=True``; the cache's default decides
by the row's length, ``kv_cache.TILE_ALLOCATION_FROM``). It counts the tiles of the final widths against the
smallest count the same context could have (the same sinks, window and open key block at 8 bits,
every other token at one width). CPU only; it times nothing.

    python3 scripts/kv_tile_count.py --context 8192 --kv-bits 4 3.5 3 2.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kbit_linear.kv_cache import allocate_row, movable_positions  # noqa: E402
from kbit_linear.kv_format import TIERS, TILE_ENTRIES  # noqa: E402


def _movable(length: int, block: int, window: int, sinks: int) -> torch.Tensor:
    """bool ``[length]``: the positions one row's allocator may move (sinks from position 0, every complete key block ranged)."""
    return movable_positions(length, window, sinks, length // block * block, torch.zeros(1, dtype=torch.int64), block)[0]


def tiles(tier: torch.Tensor, block: int) -> int:
    """Decode tiles of one row's widths ``tier`` (int ``[s]``): per key block and width, ceil(count / tile)."""
    s = tier.numel()
    n = (s + block - 1) // block
    blk = torch.arange(s) // block
    counts = torch.zeros(n, TIERS[-1] + 1, dtype=torch.int64).index_put_((blk, tier.long()), torch.ones(s, dtype=torch.int64),
                                                                        accumulate=True)
    return int(((counts + TILE_ENTRIES - 1) // TILE_ENTRIES).sum())


def replay(context: int, kv_bits: float, start: int, block: int, window: int, sinks: int, seed: int, by_tile: bool) -> torch.Tensor:
    """One row's widths after allocations every ``block`` tokens from ``start`` to ``context``,
    the tokens ranked by their own importance or (``by_tile``) their group's."""
    g = torch.Generator().manual_seed(seed)
    importance = torch.rand(context, generator=g)
    tier = torch.full((context,), 8, dtype=torch.int8)
    for s in range(start, context + 1, block):
        idx = torch.nonzero(_movable(s, block, window, sinks)).reshape(-1)
        if idx.numel() == 0:
            continue
        tier[idx] = allocate_row(tier[:s], importance[:s], idx, kv_bits, block, by_tile=by_tile)
    return tier


def uniform(context: int, block: int, window: int, sinks: int) -> torch.Tensor:
    """The fewest-tiles layout of a context: the 8-bit tokens of ``replay`` (sinks, window, open
    key block) and every other token at one width."""
    return torch.where(_movable(context, block, window, sinks), TIERS[0], 8).to(torch.int8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kv-bits", type=float, nargs="+", default=[4.0, 3.5, 3.0, 2.5])
    ap.add_argument("--start", type=int, default=1024, help="tokens at the first allocation (the prompt)")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"| kv_bits | ranked | tiles after one allocation at {args.context} | after allocations every {args.block} from "
          f"{args.start} | fewest (one width below 8 bits) | tokens per width (the latter) |")
    print("|---|---|---|---|---|---|")
    fewest = tiles(uniform(args.context, args.block, args.window, args.sinks), args.block)
    for bits in args.kv_bits:
        for by_tile in (False, True):
            once = replay(args.context, bits, args.context, args.block, args.window, args.sinks, args.seed, by_tile)
            grown = replay(args.context, bits, args.start, args.block, args.window, args.sinks, args.seed, by_tile)
            widths = ", ".join(f"{t}: {int((grown == t).sum())}" for t in TIERS)
            print(f"| {bits:g} | {'by tile' if by_tile else 'by token'} | {tiles(once, args.block)} | {tiles(grown, args.block)} | "
                  f"{fewest} | {widths} |")

if __name__ == "__main__":
    main()
