"""Time decode attention over the quantized KV cache beside PyTorch SDPA on a bf16 cache.

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), one query per row, for
each context length and batch: SDPA (``F.scaled_dot_product_attention(..., enable_gqa=True)``,
what transformers' ``"sdpa"`` attention runs) on a bf16 cache, the fused kbit kernels
(``kbit_linear.backends.cuda.kv_attention``: offsets + attention + combine, and the mass
kernel the cache's allocator uses) on caches whose widths give an average of 8 (uniform int8:
the seed's baseline), 4, 3.5 and 2.5 bits (the 64 most recent tokens and 4 sinks at 8 bits, the
window's start rounded down to a tile as the cache does: ``kv_cache.movable_positions``; the rest
split between the two widths around the average at random positions) and ``4-alloc``: an
average of 4 bits as the cache's allocator sets it from 8 bits ranking token by token
(``allocate_row`` on random importance, ``allocate_by_tile=False``; the 8-bit window and sinks
count against the budget, so about 1-2 % of the other tokens go to 3 bits, spread over most key
blocks), and ``4-tiles``: the same ranking by tile (those tokens in whole tiles of a key block;
the cache's default from ``kv_cache.TILE_ALLOCATION_FROM`` positions on), all in one run:
CUDA-graph replay of many calls, cache copies rotated past L2, median of repeats
(``_bench_common.time_calls``). Bytes per token count payload, scales and metadata; the
roofline is those bytes read at the device-to-device copy rate (read + write bytes per second)
measured in the same run. As in a decode step, each cache keeps its per-key-block offsets
between calls (the ``workspace``; the cache recomputes them when widths change, every
``block_size`` tokens).

Usage::

    python3 scripts/bench_kv_attention.py --md bench/results/kv-attention-h100.md \\
        --json bench/results/kv-attention-h100.json --plot bench/results/kv-attention-h100.png
    python3 scripts/bench_kv_attention.py --context 4096 --batch 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (needs the path above; puts the repository on the path)

from kbit_linear.backends.cuda import kv_attention as kkv  # noqa: E402
from kbit_linear.kv_cache import MASS_INTERVAL, allocate_row, movable_positions  # noqa: E402
from kbit_linear.kv_format import TIERS, KVBucket, key_block_ranges, quantize_tokens  # noqa: E402

HQ, H, D = 32, 8, 128
BLOCK, WINDOW, SINKS = 64, 64, 4
CONTEXTS = [4096, 32768, 131072]
BATCHES = [1, 8]
MIXES = {"int8": (8, 8), "4": (4, 8), "3.5": (3, 4), "2.5": (2, 3), "4-alloc": (3, 4), "4-tiles": (3, 4)}  # average -> (lower, upper width)
ALLOCATED = {"4-alloc": (4.0, False), "4-tiles": (4.0, True)}  # mixes whose widths the allocator sets -> (kv_bits, allocate_by_tile)


def _tiers(batch: int, s: int, avg: float, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    """Widths per position: window and sinks at 8, the rest lo/hi at random with mean ``avg`` where possible."""
    tier = torch.full((batch, s), lo, dtype=torch.int8)
    if hi != lo:
        frac = (avg - lo) / (hi - lo) if avg < hi else 0.0
        tier[torch.rand(batch, s, generator=g) < frac] = hi
    tier[~_movable(s).expand(batch, s)] = 8  # the sinks, the window and the open key block
    return tier


def _movable(s: int) -> torch.Tensor:
    """bool ``[1, s]``: the positions the allocator may move in a row of ``s`` (no padding)."""
    return movable_positions(s, WINDOW, SINKS, s // BLOCK * BLOCK, torch.zeros(1, dtype=torch.int64), BLOCK)


def _allocated_tiers(batch: int, s: int, kv_bits: float, by_tile: bool, g: torch.Generator) -> torch.Tensor:
    """Widths per position as ``KbitKVLayer.reallocate`` sets them from 8 bits for ``kv_bits``
    (``by_tile``: with ``allocate_by_tile``), with random importance: the window, the sinks and
    the open key block stay at 8 bits and count against the budget."""
    tier = _tiers(batch, s, 8.0, 8, 8, g)
    idx = torch.nonzero(_movable(s)[0]).reshape(-1)
    for b in range(batch):
        importance = torch.zeros(s)
        importance[idx] = torch.rand(idx.numel(), generator=g)
        tier[b, idx] = allocate_row(tier[b], importance, idx, kv_bits, BLOCK, by_tile=by_tile)
    return tier


def _cache(batch: int, s: int, mix: str, dev: torch.device, seed: int) -> dict[str, Any]:
    """A random cache of the mix on ``dev``: buckets, key ranges, tier, bytes held."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = MIXES[mix]
    if mix in ALLOCATED:
        tier = _allocated_tiers(batch, s, *ALLOCATED[mix], g).to(dev)
    else:
        tier = _tiers(batch, s, float(mix) if mix != "int8" else 8.0, lo, hi, g).to(dev)
    nb = s // BLOCK
    kmin = torch.empty(batch, nb, H, D, dtype=torch.float16, device=dev)
    krange = torch.empty_like(kmin)
    for b in range(batch):  # key ranges block by block (one row's keys at a time keeps memory low)
        k = torch.randn(nb * BLOCK, H, D, device=dev)
        kmin[b], krange[b] = key_block_ranges(k.reshape(nb, BLOCK, H, D))
    buckets = []
    for t in TIERS:
        rows, pos = torch.nonzero(tier == t, as_tuple=True)
        parts = []
        for i in range(0, rows.numel(), 1 << 18):  # quantize in slices of 256 K tokens
            r, p = rows[i:i + (1 << 18)], pos[i:i + (1 << 18)]
            k = torch.randn(r.numel(), H, D, device=dev)
            v = torch.randn(r.numel(), H, D, device=dev)
            parts.append(quantize_tokens(k, v, t, r, p, batch, kmin, krange, BLOCK))
        if not parts:
            parts.append(KVBucket.empty(t, batch, H, D, dev))
        fields = {n: torch.cat([x.tensors()[n] for x in parts]) for n in parts[0].tensors() if n != "row_start"}
        row_start = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        row_start[1:] = torch.bincount(rows, minlength=batch).cumsum(0)
        buckets.append(KVBucket(t, row_start, **fields))
    nbytes = sum(x.numel() * x.element_size() for bk in buckets for x in bk.tensors().values())
    nbytes += 2 * kmin.numel() * 2 + tier.numel()
    # the workspace keeps the per-key-block offsets between calls, as the cache does between steps
    return {"buckets": buckets, "kmin": kmin, "krange": krange, "tier": tier, "nbytes": nbytes, "workspace": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", nargs="+", type=int, default=CONTEXTS)
    ap.add_argument("--batch", nargs="+", type=int, default=BATCHES)
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--md")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    dev = bc.require_cuda()
    env = bc.environment(dev)
    copy_gbps = bc.measure_copy_bandwidth(dev)
    l2 = bc.l2_bytes(dev)
    scaling = D**-0.5
    rows = []
    payload: dict[str, Any] = {"env": env, "copy_gbps": copy_gbps, "rows": rows}
    for s in args.context:
        for batch in args.batch:
            g = torch.Generator(device=dev).manual_seed(s + batch)
            q = torch.randn(batch, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
            bf16_bytes = 2 * batch * H * s * D * 2
            try:
                n = bc.copies_past_l2(bf16_bytes, l2, max_copies=8)
                kv = [(torch.randn(batch, H, s, D, device=dev, dtype=torch.bfloat16, generator=g),
                       torch.randn(batch, H, s, D, device=dev, dtype=torch.bfloat16, generator=g)) for _ in range(n)]
            except torch.OutOfMemoryError:
                print(f"context {s} batch {batch}: bf16 cache does not fit, skipped", flush=True)
                continue
            sdpa = bc.time_calls(lambda i: F.scaled_dot_product_attention(q, kv[i][0], kv[i][1], scale=scaling,
                                                                          enable_gqa=True), n)
            del kv
            torch.cuda.empty_cache()
            row = {"context": s, "batch": batch, "sdpa_bf16_us": sdpa.us, "sdpa_method": sdpa.method, "bf16_bytes_per_token": bf16_bytes / (batch * s)}
            for mix in args.mixes:
                cache = _cache(batch, s, mix, dev, seed=s + batch)
                n = bc.copies_past_l2(cache["nbytes"], l2, max_copies=8)
                caches = [cache] + [_cache(batch, s, mix, dev, seed=s + batch + i) for i in range(1, n)]

                def call(i: int, need_mass: bool) -> Any:
                    c = caches[i]
                    return kkv.kv_decode_attention_cuda(q, c["buckets"], c["kmin"], c["krange"], BLOCK, s, c["tier"], None,
                                                        scaling, need_mass=need_mass, workspace=c["workspace"])

                with_mass = bc.time_calls(lambda i: call(i, True), n)
                no_mass = bc.time_calls(lambda i: call(i, False), n)
                roof = cache["nbytes"] / (copy_gbps * 1e3)  # bytes read at the copy's (read + write) rate
                row[f"kbit_{mix}_us"] = with_mass.us
                row[f"kbit_{mix}_nomass_us"] = no_mass.us
                row[f"kbit_{mix}_bytes_per_token"] = cache["nbytes"] / (batch * s)
                row[f"kbit_{mix}_roofline_us"] = roof
                row[f"kbit_{mix}_method"] = with_mass.method
                del caches, cache
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
            bc.write_outputs(args, payload, _markdown(payload), _plot)


def mean_step_us(with_mass_us: float, no_mass_us: float, interval: int = MASS_INTERVAL) -> float:
    """A decode step's mean attention time when one step in ``interval`` records the mass."""
    return no_mass_us + (with_mass_us - no_mass_us) / interval


def _markdown(payload: dict[str, Any]) -> str:
    env, rows = payload["env"], payload["rows"]
    mixes = [m for m in MIXES if rows and f"kbit_{m}_us" in rows[0]]
    lines = ["# Decode attention over the quantized KV cache vs SDPA on bf16", ""]
    lines += bc.env_lines(env) + [f"- copy bandwidth measured in the same run: {payload['copy_gbps']:.0f} GB/s (read + write)",
                                  f"- shape: {HQ} query heads, {H} KV heads, head_dim {D}, one query per row; key blocks of "
                                  f"{BLOCK}, {WINDOW} recent tokens (from a tile boundary) and {SINKS} sinks at 8 bits", ""]
    headers = ["context", "batch", "SDPA bf16 us"]
    for m in mixes:
        headers += [f"{m} bits us (no mass)", "x SDPA", f"x SDPA, mass 1 step in {MASS_INTERVAL}", "roofline us",
                    "bytes/token vs bf16"]
    table = []
    for r in rows:
        line = [r["context"], r["batch"], bc.fmt(r["sdpa_bf16_us"])]
        for m in mixes:
            mean_step = mean_step_us(r[f"kbit_{m}_us"], r[f"kbit_{m}_nomass_us"])
            line += [f"{bc.fmt(r[f'kbit_{m}_us'])} ({bc.fmt(r[f'kbit_{m}_nomass_us'])})",
                     f"{r['sdpa_bf16_us'] / r[f'kbit_{m}_us']:.2f}x", f"{r['sdpa_bf16_us'] / mean_step:.2f}x",
                     bc.fmt(r[f"kbit_{m}_roofline_us"]),
                     f"{r[f'kbit_{m}_bytes_per_token'] / r['bf16_bytes_per_token']:.3f}"]
        table.append(line)
    lines.append(bc.markdown_table(headers, table))
    lines += ["", "`x SDPA` = SDPA's time over the kbit time with the mass on every step; `x SDPA, mass 1 step in "
              f"{MASS_INTERVAL}` = over a decode step's mean time in a `KbitKVCache` at its default `mass_interval`, "
              f"which records the mass on one step in {MASS_INTERVAL}; "
              "bytes per token include scales, key ranges, positions, row starts and the tier array."]
    return "\n".join(lines)


def _plot(payload: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = payload["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for batch, marker in ((1, "o"), (8, "s")):
        rs = [r for r in rows if r["batch"] == batch]
        if not rs:
            continue
        ctx = [r["context"] for r in rs]
        axes[0].plot(ctx, [r["sdpa_bf16_us"] for r in rs], marker=marker, color="black", label=f"SDPA bf16, batch {batch}")
        for m, color in zip(MIXES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")):
            if f"kbit_{m}_us" in rs[0]:
                axes[0].plot(ctx, [r[f"kbit_{m}_us"] for r in rs], marker=marker, color=color, label=f"kbit {m} bits, batch {batch}")
                if batch == rs[0]["batch"]:
                    axes[1].plot(ctx, [r[f"kbit_{m}_bytes_per_token"] / r["bf16_bytes_per_token"] for r in rs], marker="o",
                                 color=color, label=f"{m} bits")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("decode attention time per layer (us)")
    axes[1].set_ylabel("cache bytes per token / bf16")
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    bc.save_figure(fig, path)


if __name__ == "__main__":
    main()
