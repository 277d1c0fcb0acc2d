"""Every dispatch threshold and launch-shape table of the CUDA backend, with where it came from.

The kernels' correctness never depends on a number here: any value gives right results, only
the speed changes. Each table says on which GPU and with which command it was measured; GPUs
not listed take the ``"default"`` row (or, where there is none, no limit). The benchmark
scripts import their candidate lists from here, so a re-tune edits one file.

Which GPU a row applies to: a row's key is matched as a substring of the device name
(``torch.cuda.get_device_properties(i).name``, e.g. ``"NVIDIA H100 80GB HBM3"``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEQUANT_CUBLAS_MIN_M",
    "DECODE_MAX_M",
    "DECODE_LARGE_WEIGHT",
    "FUSED_ROW_BLOCKS",
    "WGMMA_ROWS",
    "WGMMA_LAST_ROW_BY_BITS",
    "WGMMA_LAST_ROW_PLANES",
    "WGMMA_UNSPLIT_MIN_WAVE_FILL",
    "WGMMA_KTILE_US",
    "WGMMA_TWO_PER_SM",
    "WGMMA_STREAM_K",
    "WGMMA_FIXUP_US",
    "WGMMA_CLUSTER_FIXUP_US",
    "WGMMA_CLUSTER_SPLITS",
    "WGMMA_LARGE_CLUSTER_GRID_SHARE",
    "WGMMA_EARLY_FIRST_ROW",
    "WGMMA_TOKEN_TILES",
    "WGMMA_GROUPED_SMALL_TILE_MAX_MEAN",
    "TOKEN_EXPERTS_MAX_GATE_UP_WEIGHTS",
    "FUSED_MIN_SPLIT_ITERS",
    "GGUF_GEMV_MAX_M",
    "GGUF_GEMV_LAUNCH",
    "KV_DECODE_MIN_KEY_BLOCKS",
    "KV_DECODE_SPLIT_TILES_BLOCKS_PER_SM",
    "KV_DECODE_SPLIT_TILES_IDLE_SHARE",
    "KV_MASS_IN_COMBINE_MAX_BLOCKS_PER_SM",
    "KV_DECODE_SHORT_FIRST_SPLIT_MAX_KEY_BLOCKS",
    "KV_DECODE_PAIR_MIN_SPLIT_KEY_BLOCKS",
    "ROUTER_MAX_TOKENS",
    "DecodeConfig",
    "DECODE_CONFIGS",
    "DECODE_CONFIGS_BY_GPU",
    "DECODE_SPLIT_COST_BYTES",
    "DECODE_SPLIT_PIECE_COST_BYTES",
    "DECODE_SEGMENT_COST_BYTES",
    "DECODE_SHARED_SEGMENT_COST_BYTES",
    "DECODE_VARIANTS",
    "all_decode_configs",
    "decode_configs",
    "dequant_cublas_min_m",
    "decode_max_m",
    "wgmma_rows",
    "wgmma_token_tiles",
]


# ---------------------------------------------------------------------------------------
# dispatch between the paths (kbit_linear.backends.cuda.ops)
# ---------------------------------------------------------------------------------------

# Rows from which the dequantize + cuBLAS path is taken instead of the fused kernel, per GPU,
# by bits. Measured on an H100 80GB HBM3 (2026-11-22, scripts/kernel_bench.py,
# bench/results/kernels-first-version.md): fused vs dequantize + F.linear at M = 128 / 256, us,
# bits 4 fp16:
#   4096->4096 27.6 vs 30.3 / 42.6 vs 35.8;  4096->14336 70.8 vs 108.7 / 130.3 vs 115.7;
#   14336->4096 69.3 vs 113.7 / 125.0 vs 122.6;  8192->28672 236.8 vs 412.9 / 483.4 vs 438.3;
#   bits 2, 3, 5 and bf16 on 4096->14336 cross between the same two sizes.
# Other GPUs use the same until measured.
DEQUANT_CUBLAS_MIN_M: dict[str, dict[int, int]] = {
    "H100": {2: 256, 3: 256, 4: 256, 5: 256},
    "default": {2: 256, 3: 256, 4: 256, 5: 256},
}

# Largest M handed to the decode kernel where it supports the problem, per GPU, and the smaller
# limit for weights of at least DECODE_LARGE_WEIGHT elements; GPUs not listed take it wherever
# decode_supported says so. H100, fp16, decode vs fused(-splitk) us, one run
# (`python3 scripts/kernel_bench.py --dispatch`, bench/results/decode.md): decode is faster or
# equal at M = 4..16 on 4096->4096, 4096->14336 and 14336->4096 for bits 2..5 (e.g. bits 4
# M = 16: 11.9 vs 18.4, 24.7 vs 28.1, 23.7 vs 29.7), while on 8192->28672 the fused kernel wins
# from M = 12 (bits 4 M = 16: 87.4 vs 78.9). The H200 needed no row at first: there the decode kernel was
# the fastest or within 2 % of the fused and wgmma kernels at M = 8..16 on 8192->28672,
# 28672->8192 and 4096->14336 for bits 2, 4, 5 (`scripts/bench_wgmma.py --m 8 12 16`,
# 2026-11-24; bits 4 M = 16 on 8192->28672: 80.1 vs 80.7 fused, 81.9 wgmma; gemm-sm90-h100.md).
# That changed with the wgmma kernel's token tile of 16 (WGMMA_TOKEN_TILES): H200, us, decode vs
# the wgmma kernel at tile 16 (2026-11-29, `bench_wgmma.py --plans --m 8 16 32 64 --bits 4` and
# `bench_wgmma.py --shape 4096 14336 --shape 14336 4096 --shape 8192 28672 --m 12 16 24 32 --bits
# 2 5`, bench/results/gemm-sm90-small-tiles-h200.md): 8192->28672 at M = 12 / 16: K = 2 65.4 /
# 72.0 vs 60.0 / 59.9, K = 4 (M = 16) 81.0 vs 56.7, K = 5 98.4 / 104.0 vs 74.1 / 74.1; at M = 8
# a tie (K = 4 56.7 vs 56.5). The 56 Mi-element shapes split by orientation and width:
# 4096->14336 gains at K = 4 and 5 (M = 16: 24.5 vs 19.2, 32.3 vs 24.5) and at K = 2 ties at
# M = 12 (19.7 vs 19.8) and gains at M = 16 (21.7 vs 19.7), but 14336->4096 loses at K = 2 (M = 12:
# 18.4 vs 22.6) and at K = 4 the planner's plan ties (M = 16: 22.3 vs 22.6), so they stay on the
# decode kernel; 4096->4096 and smaller lose (10.9 vs 11.2 at K = 4, M = 16).
DECODE_MAX_M: dict[str, tuple[int, int]] = {"H100": (16, 8), "NVIDIA H200": (16, 8)}
DECODE_LARGE_WEIGHT = 128 * 2**20


def dequant_cublas_min_m(device_name: str, bits: int) -> int:
    """Rows from which a GPU named ``device_name`` takes the dequantize + cuBLAS path."""
    for key, table in DEQUANT_CUBLAS_MIN_M.items():
        if key != "default" and key in device_name:
            return table[bits]
    return DEQUANT_CUBLAS_MIN_M["default"][bits]


def decode_max_m(device_name: str, weight_elements: int) -> int:
    """Largest M the dispatcher hands the decode kernel on a GPU named ``device_name``."""
    for key, (limit, large_limit) in DECODE_MAX_M.items():
        if key in device_name:
            return large_limit if weight_elements >= DECODE_LARGE_WEIGHT else limit
    return 1 << 30


# ---------------------------------------------------------------------------------------
# the fused mma.sync kernel (kernels/gemm.cu)
# ---------------------------------------------------------------------------------------

# Block tile heights in 16-row units (the MB template argument, one kernel instance each); a
# problem takes the smallest that holds its M (kernel_bench.py, kernels-first-version.md).
FUSED_ROW_BLOCKS = (1, 2, 4, 8)

# Fewest k-tiles per block when splitting K: the cp.async pipeline fill costs about 2.
FUSED_MIN_SPLIT_ITERS = 4


# ---------------------------------------------------------------------------------------
# the Hopper warpgroup-MMA kernel (kernels/gemm_sm90.cu), sm_90 GPUs only
# ---------------------------------------------------------------------------------------

# Rows a GPU of compute capability 9.0 hands the wgmma kernel, per GPU, as (first, last): below,
# the decode or mma.sync kernel; above, dequantize + cuBLAS. First measured (with planes) on an H100 80GB HBM3
# (2026-11-22, `python3 scripts/bench_wgmma.py --m 33 64 ... 4096 --bits 4`,
# bench/results/gemm-sm90-h100.md), bits 4 fp16, us, best wgmma tile vs the mma.sync kernel vs
# dequantize + cuBLAS:
#   M = 33: 8192->28672 95.0 vs 137.5, 4096->14336 34.5 vs 45.2 (mma.sync's 64-row tile);
#   M = 1024: 735.1 vs 873.3 (d+cuBLAS), 206.8 vs 220.5, 14336->4096 214.1 vs 217.1, but
#   4096->4096 74.6 vs 64.0; M = 1536: 1115.9 vs 1197.3, 318.9 vs 311.3, 335.1 vs 300.6;
#   M = 2048: d+cuBLAS ahead or equal on every shape (1603.2 vs 1574.8 on 8192->28672).
# With 4-bit pair codes (what a 4-bit layer holds on the GPU) the kernel keeps up to M = 2048:
# H100 (2026-11-24, the same script, `--m 1024 1536 2048 4096 --bits 2 3 4`, fp16, us, wgmma tile
# 256 vs dequantize + cuBLAS), K = 4, M = 2048: 4096->4096 99.1 vs 110.6, 4096->14336 348.4 vs
# 382.4, 14336->4096 335.0 vs 371.1, 8192->28672 1522.2 vs 1549.8, 28672->8192 1436.4 vs 1511.8;
# M = 1536: 93.7 vs 90.1, 294.6 vs 317.4, 305.2 vs 305.6, 1113.3 vs 1212.3, 995.7 vs 1180.3;
# M = 4096: dequantize + cuBLAS ahead on 4 of 5 (8192->28672 3043.1 vs 2827.0). K = 2 and 3
# (planes) stay at 1024 (WGMMA_LAST_ROW_BY_BITS): at M = 2048 they win on some shapes and lose
# on others (K = 2 8192->28672 1542.3 vs 1446.0, 28672->8192 1253.3 vs 1413.9).
WGMMA_ROWS: dict[str, tuple[int, int]] = {"default": (33, 2048)}

# Lower last wgmma row for some index widths, per GPU (K = 2 and 3 above; K = 4 takes WGMMA_ROWS).
# K = 5 was held to M = 512 while it decoded from planes (H100, 2026-11-23, M = 1024 8192->28672
# 1041.1 us against 909.4 for dequantize + cuBLAS). With 5-bit pair codes (what a 5-bit layer
# holds on the GPU) the kernel wins at M = 1024 on every Llama shape: H100 (2026-11-24,
# `bench_wgmma.py --bits 5 --m 1024 2048 --splits`, fp16, us, tile 256 with its automatic split
# vs dequantize + cuBLAS) 4096->4096 53.3 vs 64.4, 4096->14336 206.4 vs 220.8, 14336->4096 174.9
# vs 214.5, 8192->28672 765.0 vs 865.1; at M = 2048 it ties or loses on three of four (109.0 vs
# 107.7, 387.2 vs 374.3, 368.6 vs 363.2; 1459.6 vs 1597.6).
WGMMA_LAST_ROW_BY_BITS: dict[str, dict[int, int]] = {"default": {2: 1024, 3: 1024, 5: 1024}}

# Last wgmma row for a 4- or 5-bit weight that reaches the GPU as bit-planes instead of the pair
# codes a layer holds there (the ops take both layouts): the limits measured from planes before
# pair codes raised them (K = 4: 1024, WGMMA_ROWS' comment; K = 5: 512, the 2026-11-23 figures
# above).
WGMMA_LAST_ROW_PLANES: dict[str, dict[int, int]] = {"default": {4: 1024, 5: 512}}

# (first row, smallest weight in elements N * K): weights at least that large take the wgmma
# kernel from that row instead of WGMMA_ROWS' first, per GPU. H100, fp16, us, wgmma (tile 64,
# the planner's split) vs the mma.sync kernel (2026-11-24, `python3 scripts/bench_wgmma.py
# --shape 4096 4096 --shape 4096 1024 --shape 4096 14336 --shape 14336 4096 --m 17 24 32 --bits
# 2 4 5`): K = 4 at M = 17 / 32: 4096->4096 13.8 / 13.6 vs 15.1 / 14.8, 4096->14336 30.2 / 26.2
# vs 31.5 / 32.4, 14336->4096 26.9 / 26.9 vs 30.9 / 31.4; K = 5 4096->4096 16.5 vs 18.2; but
# 4096->1024 (4 M elements) 12.6-12.9 vs 11.9-12.6, K = 5 15.9 vs 13.2. (8192->28672 took the
# wgmma kernel from M = 17 before: 92.0 vs 100.2 us at M = 17 with the first plans.)
# H200: every weight, since the planner's splits in clusters of up to eight blocks serve small
# weights (2026-11-29, `bench_wgmma.py --shape 4096 1024 --shape 2048 4096 --shape 4096 2048
# --shape 2048 512 --shape 1024 4096 --shape 2048 2048 --m 17 24 32 --bits 2 3 4 5 --dtypes
# fp16`, bench/results/gemm-sm90-small-m17-h200.json): wgmma (tile 64) vs mma.sync at M = 17..32,
# K = 2..5: 4096->1024 8.6-9.8 vs 11.4-12.5 us, 4096->2048 11.0-12.6 vs 13.7-15.3, 2048->512
# 7.1-7.9 vs 8.7-9.6, 2048->2048 8.4-9.3 vs 9.0-9.6, 2048->4096 10.5-11.5 vs 10.9-12.3; only
# 1024->4096 ties (7.9-8.8 vs 7.9-8.5, K = 3 and 5 0.3-0.4 us slower). The H100 row above was
# measured before those cluster plans reached small weights; it awaits the same sweep there.
# The H200 row starts at M = 9: with the token tile of 16 the wgmma kernel takes M = 9..16 of
# the weights DECODE_MAX_M does not keep on the decode kernel (its comment has the figures).
WGMMA_EARLY_FIRST_ROW: dict[str, tuple[int, int]] = {"NVIDIA H200": (9, 0), "default": (17, 16 * 2**20)}

# Smallest share of the last wave that a grid of whole tiles (no split of K) must fill for the
# wgmma kernel to run unsplit: tiles / (slots * waves) with waves = ceil(tiles / slots). Below it,
# stream-K evens the tail. Applies to grids of more tiles than resident blocks; smaller ones
# follow the time model below (WGMMA_KTILE_US). H100 (2026-11-23, fp16, K = 4, us, unsplit vs stream-K as planned before
# this rule): M = 1024 4096->4096 (128 tiles on 132 slots, 0.97) 53.7 vs 73.9, 14336->4096 (0.97)
# 200.0 vs 205.4, 28672->8192 (256 tiles, 0.97) 819.3 vs 839.0; 4096->14336 (448 tiles, 0.85)
# 251.7 vs 228.9, which stays stream-K.
WGMMA_UNSPLIT_MIN_WAVE_FILL = 0.9

# The wgmma planner's time model (ops._wgmma_options): for each token tile it weighs splitting
# every tile's K into s equal pieces (one block each, s dividing the k-tiles, the grid resident at
# once) against stream-K, in microseconds:
#   split s:   k-tile time * k_tiles / s + fix-up(s)
#   stream-K:  k-tile time * STREAM_K[tile] * iters + fix-up(pieces), twice (with one more
#              piece) where the blocks' ranges do not align with the tiles (two segments each)
# and takes the cheapest (tile, plan); grids of more tiles than resident blocks keep the rules of
# _plan_stream_k. The k-tile time is one block's per 64 in-features with the SM to itself; a split
# whose grid puts two blocks of token tile 64 on an SM runs WGMMA_TWO_PER_SM times slower. The
# fix-up: base + per_split * s where the partial tiles meet in the workspace, or the cluster
# cost where the split runs as clusters (WGMMA_CLUSTER_SPLITS, WGMMA_CLUSTER_FIXUP_US).
# Fitted to one H100 sweep (2026-11-24) of every tile x split 1/2/4/8 with and without clusters x
# stream-K on the five Llama shapes at M = 33..512, K = 4 pair codes, and K = 2 / 5 at M = 64 / 256:
# the cells of `python3 scripts/bench_wgmma.py --plans --shape 4096 4096 --shape 4096 14336 --shape
# 14336 4096 --shape 8192 28672 --shape 28672 8192 --m 33 64 128 256 512` (its run on the committed
# code: bench/results/gemm-sm90-plans-h100.json; bench/results/gemm-sm90-h100.md, "Split K in
# thread block clusters"). The model's pick is within 1 % of the fastest measured plan (geometric
# mean over the 45 cases), e.g. K = 4, us, pick vs best vs the previous plan: 4096->4096 M = 64
# tile 64 s = 4 13.5 (13.5; stream-K 16.3); M = 256 tile 128 s = 2 in a cluster 20.2 (19.5; tile
# 256 s = 4 27.9); 14336->4096 M = 128 tile 128 s = 4 34.8 (34.8; 59.9); 4096->14336 M = 64
# tile 64 s = 2, 224 blocks, 23.6 (23.6; 28.7).
# Tiles 16 and 32 (H200 only, WGMMA_TOKEN_TILES) take tile 64's time times 0.79 and 0.84, the
# ratios of the k-tile times fitted to every forced plan of the H200 sweep of 2026-11-29 (K = 4,
# M = 8..64, five Llama shapes; DECODE_MAX_M's comment): 0.315 / 0.335 / 0.40 us for 16 / 32 / 64
# there. With them the model picks the measured fastest tile in 18 of the 20 cases of that sweep
# (not 4096->1024 at M = 8 and 16, which the decode kernel takes).
WGMMA_KTILE_US: dict[int, dict[int, float]] = {
    2: {16: 0.266, 32: 0.283, 64: 0.337, 128: 0.445, 256: 0.59},
    3: {16: 0.269, 32: 0.286, 64: 0.34, 128: 0.45, 256: 0.60},  # not measured: between K = 2 and 4
    4: {16: 0.265, 32: 0.281, 64: 0.335, 128: 0.43, 256: 0.60},
    5: {16: 0.419, 32: 0.445, 64: 0.53, 128: 0.64, 256: 0.774},
}
WGMMA_TWO_PER_SM = 1.75
WGMMA_STREAM_K: dict[int, float] = {16: 1.6, 32: 1.6, 64: 1.6, 128: 1.1, 256: 1.1}  # <= 64: two blocks per SM
# token tile -> (base, per_split) of the workspace fix-up, us (16 and 32: tile 64's, not fitted apart)
WGMMA_FIXUP_US: dict[int, tuple[float, float]] = {16: (0.87, 1.07), 32: (0.87, 1.07), 64: (0.87, 1.07), 128: (1.2, 1.64),
                                                  256: (0.0, 4.05)}
# token tile -> {P: fix-up of a tile summed in a cluster of P blocks}, us. P = 2 from the sweep
# above; P = 4 and 8 from small layers (`bench_wgmma.py --plans --shape 4096 1024 --shape 2048
# 2048 --shape 4096 4096 --shape 1024 4096 --m 64 128 256 512`, 2026-11-24, H100,
# bench/results/gemm-sm90-plans-small-h100.json): e.g. 4096->1024 M = 64 tile 64, clusters of
# eight 9.6 us against four pieces through the workspace 13.1.
WGMMA_CLUSTER_FIXUP_US: dict[int, dict[int, float]] = {
    16: {2: 1.93},  # 16 and 32: tile 64's; P must divide the tile's token groups of 8
    32: {2: 1.93, 4: 3.0},
    64: {2: 1.93, 4: 3.0, 8: 3.9},
    128: {2: 3.2, 4: 4.7, 8: 7.5},
    256: {2: 6.0, 4: 9.2, 8: 15.8},
}

# Splits of a tile's K into P equal pieces that the wgmma kernel sums in the shared memory of a
# thread block cluster of the P blocks (kernels/gemm_sm90.cu, reduce_in_cluster) instead of in
# the global workspace, where the GPU runs all of the grid's clusters at once (the driver's count,
# ops._wgmma_cluster) and, for P > 2, the grid has at most WGMMA_LARGE_CLUSTER_GRID_SHARE of the
# SM count in blocks. Empty: every split uses the workspace. Sweep above, us, cluster vs
# workspace: P = 2 is faster on every grid the GPU holds at once (4096->4096 M = 256 tile 128
# 20.2 vs 22.9, tile 256 28.0 vs 30.9; 28672->8192 M = 256 tile 256 163.8 vs 168.3) but slower
# over several waves (8192->28672 M = 256, 448 blocks: 223.8 vs 207.8). P = 4 and 8 win on small
# grids (small-layer run above: 4096->1024 M = 64, 64 blocks in clusters of eight, 9.6 vs 13.1;
# 2048->2048 M = 64, 64 blocks in fours, 8.8 vs 10.6) and lose on grids of 128 blocks: at one
# block per SM the H100 holds 66 clusters of two, 30 of four and 15 of eight
# (cuOccupancyMaxActiveClusters), so 128 blocks in fours take two waves (4096->4096 M = 256 tile
# 256: 41.5 vs 27.9); at two blocks per SM (tile 64) they fit and still lose (4096->4096 M = 64,
# 128 blocks in fours: 15.3 vs 13.7).
WGMMA_CLUSTER_SPLITS: tuple[int, ...] = (2, 4, 8)
WGMMA_LARGE_CLUSTER_GRID_SHARE = 0.5

# Token tiles (the kernel's BT) by rows, per GPU: (tile, largest M that takes it), in order; an M
# above every limit takes the largest tile, 256. Same run: 64 is fastest up to M = 64 (8192->28672
# M = 64: 96.8 vs 129.1 with 128), 128 at M = 96..128 (127.3 vs 180.1 with 64), 256 from M = 192
# on the large shapes (M = 256: 206.6 vs 278.6 with 128; 4096->4096 and at M = 384 4096->14336
# prefer 128, by 3-20 us). The dense planner weighs this tile and its neighbours (half and
# double) with the time model above; the grouped kernel takes it as it is.
# H200 (2026-11-29, `bench_wgmma.py --plans --shape 4096 4096 --shape 4096 1024 --shape 4096 14336
# --shape 14336 4096 --shape 8192 28672 --m 8 16 32 64 --bits 4`, best plan of each tile, us):
# tile 32 at M = 32 8192->28672 62.3 vs 70.3 with 64, 4096->14336 20.8 vs 25.0, 14336->4096 22.6
# vs 25.9, 4096->4096 11.9 vs 13.5 (4096->1024 9.7 vs 9.2: the model keeps 64 there); tile 16 at
# M = 16 56.7 vs 60.4 with 32 on 8192->28672, 19.2 vs 20.5 on 4096->14336. Half the MMA work and
# half the accumulators of the next tile; the decode of the weights is the same. The H100 keeps
# the default until the same sweep runs there.
WGMMA_TOKEN_TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "NVIDIA H200": ((16, 16), (32, 32), (64, 64), (128, 128)),
    "default": ((64, 64), (128, 128)),
}

# The grouped kernel (mixture-of-experts layers) picks its tile from the mean rows per group, and
# groups scatter around the mean: a tile below 64 pays a second m-tile, i.e. a second decode of the
# expert's weight tile, for every group above it. So it takes the small tiles only up to this mean.
# H200, KbitExperts graph replay, K = 4, us, tiles by the mean vs tile 64 (2026-11-29, random
# top-k routing, bench/results/gemm-sm90-small-tiles-h200.md): Qwen3-30B-A3B shape, mean 2 / 4 /
# 8 rows (32 / 64 / 128 tokens): 207 / 215 / 222 vs 251 / 262 / 270; Mixtral-8x7B mean 8: 399 vs
# 510; but mean 16: Qwen3 292 vs 282, Mixtral 588 vs 504; mean 32 (tile 32): 337 vs 301, 639 vs 512
# (first of two rounds each).
WGMMA_GROUPED_SMALL_TILE_MAX_MEAN = 8

# One token through the experts (kbit_linear::experts_one_token): the two one-token kernels
# (experts_token.cu) take the call up to this many weights in one expert's gate_up matrix
# (2 * intermediate * hidden); larger experts run the grouped path. The two kernels save four
# launches but stream less evenly (a block barrier every unit of 16 rows). H200, CUDA-graph
# replay, one token, us, two kernels vs grouped path, 16 calls with 16 routings per replay
# (2026-11-29, scripts/ab_experts_token.py; bench/results/moe-h100.md, "One token in two kernels"):
# Qwen3-30B-A3B shape (3.1 M weights), K = 2..5: 17.8 / 19.2 / 19.5 / 23.9 vs 24.9 / 28.3 / 28.8 /
# 31.0 (1.30-1.48x; the final grid, second run); Mixtral-8x7B shape (117 M): 95.3 / 114.1 / 106.4 / 133.8 vs 75.2 / 86.5 /
# 86.1 / 100.8 (0.75-0.81x). Nothing measured in between: the bound keeps the small-expert
# families (OLMoE 4.2 M, Qwen2-MoE and DeepSeek-V2-Lite 5.8 M) and leaves the rest as they were.
TOKEN_EXPERTS_MAX_GATE_UP_WEIGHTS = 8 * 1024 * 1024


def wgmma_rows(device_name: str, weight_elements: int = 0, bits: int = 4, pairs: bool = True) -> tuple[int, int]:
    """``(first, last)`` rows an sm_90 GPU named ``device_name`` hands the wgmma kernel for a
    weight of ``weight_elements`` (``N * K``) at ``bits`` per index, held as pair codes
    (``pairs``, where the width has them) or as bit-planes."""
    first, last = _row(WGMMA_ROWS, device_name)
    early_row, min_weight = _row(WGMMA_EARLY_FIRST_ROW, device_name)
    if weight_elements >= min_weight:
        first = min(first, early_row)
    last = min(last, _row(WGMMA_LAST_ROW_BY_BITS, device_name).get(bits, last))
    if not pairs:
        last = min(last, _row(WGMMA_LAST_ROW_PLANES, device_name).get(bits, last))
    return first, last


def wgmma_token_tiles(device_name: str) -> tuple[tuple[int, int], ...]:
    """``(token tile, largest M)`` pairs, in order, for a GPU named ``device_name``."""
    return _row(WGMMA_TOKEN_TILES, device_name)


def _row(table: dict, device_name: str):
    for key, value in table.items():
        if key != "default" and key in device_name:
            return value
    return table["default"]


# ---------------------------------------------------------------------------------------
# the decode kernel (kernels/decode.cu)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of one decode kernel instance.

    Attributes:
        warps: warps per block (NW).
        k_warps: of them, warps side by side along K (KS; divides ``warps``). They share the
            rows of a row tile, each taking every KS-th chunk of the block's range, and sum
            their partials in shared memory. A row tile is ``warps // k_warps * row_groups * 16``
            output rows.
        row_groups: 16-row groups per warp (R): x fragments are reused over them.
        depth: work items of plane loads kept in flight per warp (D), i.e. ``depth * row_groups``
            row groups of one 128-wide chunk each.
        min_blocks: blocks per SM the register budget is sized for (MINB).
    """

    warps: int
    k_warps: int
    row_groups: int
    depth: int
    min_blocks: int

    def __post_init__(self) -> None:
        if min(self.warps, self.k_warps, self.row_groups, self.depth, self.min_blocks) < 1 or self.warps % self.k_warps:
            raise ValueError(f"{self}: every field must be >= 1 and k_warps must divide warps")

    @property
    def row_slots(self) -> int:
        """Warps side by side along N in a row tile (NW / KS)."""
        return self.warps // self.k_warps

    @property
    def tile_rows(self) -> int:
        """Output rows of one row tile."""
        return self.row_slots * self.row_groups * 16


# Per (bits, n8 fragments): the launch shapes a plan chooses from (by the cost in
# decode.schedule()): narrow row tiles (32 rows, all 16 warps along K) for shapes with few
# output rows, wide ones (128 rows, 4 x 4 warps) for wide shapes, and with one fragment a
# 512-row shape whose warps each own their rows (one warp along K: no in-block reduction), which
# streams long ranges fastest. All fit 128 registers per thread (16 warps per SM; `nvcc -Xptxas
# -v`, sm_90), timed with `scripts/bench_decode.py --variants` on an H100 (bench/results/decode.md).
# K = 3's narrow shape was (8, 8, 2, 2, 2) (two blocks of 8 warps per SM) until a sweep of every
# variant (2026-11-24, `--bits 3 --m 1 4 --variants` on the five Llama layers, fp16) had
# (16, 16, 2, 2, 1) faster on the narrow layers: 14336->4096 15.7 vs 19.3 us at M = 1. The
# 512-row shape: (16, 1, 2, 2, 1) at K = 2..4, (16, 1, 2, 1, 1) at K = 5 (two items in flight
# spill there); e.g. 8192->28672 K = 4 at M = 1 47.2 against 54.3 us with (16, 4, 2, 2, 1), and
# the grouped expert launches of Mixtral / Qwen3-MoE shapes 10-30 % faster (the fit below). With
# two fragments it would need more shared memory than an A100 block has (the reduction slots
# double), so those keep two shapes. K = 3 and 4 also have a 64-row shape, 8 warps along K with two
# items in flight (16, 8, 2, 2, 1), for layers of a few thousand rows that whole 32-row tiles would
# put two to a block: on the collected H100 cases (`decode-plan-fit-h100.json`, evaluated with
# `scripts/tune_decode_plan.py evaluate`) the plans come to 1.3 / 1.6 % above the fastest measured
# choice at K = 3 / 4 (were 2.0 / 1.9 %; worst 9.4 / 12.7 %, were 17.2 / 12.8 %), e.g. 4096->6144 at
# M = 1 and 4 about 10 % faster and 28672->8192 at K = 4 4 % slower. Timed on an H200 before and after
# (`small-calls-ab-h200.md`, one run): 2048->5120 8.6 -> 7.1 us (K = 4, M = 1), 4096->6144 12.5 -> 10.3,
# 28672->8192 48.0 -> 43.9 (faster there too); the 2048- and 4096-column layers keep their shapes. Its K = 4 instances (pair
# codes) spill on sm_90 (4-20 bytes, the grouped ones 56; K = 3 none): the timings include that.
DECODE_CONFIGS: dict[tuple[int, int], tuple[DecodeConfig, ...]] = {
    (2, 1): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 4, 2, 2, 1), DecodeConfig(16, 1, 2, 2, 1)),
    (3, 1): (DecodeConfig(16, 16, 2, 2, 1), DecodeConfig(16, 8, 2, 2, 1), DecodeConfig(16, 4, 2, 2, 1),
             DecodeConfig(16, 1, 2, 2, 1)),
    (4, 1): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 8, 2, 2, 1), DecodeConfig(16, 4, 2, 2, 1),
             DecodeConfig(16, 1, 2, 2, 1)),
    (5, 1): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 4, 2, 1, 1), DecodeConfig(16, 1, 2, 1, 1)),
    (2, 2): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 4, 2, 2, 1)),
    (3, 2): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 4, 2, 1, 1)),
    (4, 2): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 4, 2, 1, 1)),
    (5, 2): (DecodeConfig(16, 16, 2, 1, 1), DecodeConfig(16, 4, 2, 1, 1)),
}

# The launch shapes a plan chooses from on the GPUs named here (a name containing the key), in place of
# DECODE_CONFIGS' for the same (bits, fragments); other GPUs keep DECODE_CONFIGS until measured. The
# order breaks ties of the cost model. H200, K = 4 with one fragment: DECODE_CONFIGS' four with, after
# the first, a 16-row shape (16, 16, 1, 2, 1) and a 64-row one with one item in flight (16, 8, 2, 1, 1), for the
# layers of a few thousand rows that leave SMs idle at 32 or 64 rows a tile (no spills, 119-128
# registers). On the H200 cases of `scripts/tune_decode_plan.py collect --bits 4 --m 1 4`
# (`bench/results/decode-plan-fit-k4-h200.json`, 2026-11-30, `bench/results/decode-plan-h200.md`) the
# plans come to 1.6 % above the fastest measured choice (were 4.3 %; worst 14.6 %, was 21.1 %):
# 4096->1024 6.3 -> 5.2 us at M = 1, 4096->2048 6.5 -> 6.0, 2048->5120 7.4 -> 6.7, 4096->6144
# 10.7 -> 9.9, 28672->8192 47.8 -> 45.1, with the cost constants below unchanged. The H100 (same SMs,
# less bandwidth) was not measured with them.
DECODE_CONFIGS_BY_GPU: dict[str, dict[tuple[int, int], tuple[DecodeConfig, ...]]] = {
    "H200": {(4, 1): (DECODE_CONFIGS[(4, 1)][0], DecodeConfig(16, 16, 1, 2, 1), DecodeConfig(16, 8, 2, 1, 1),
                      *DECODE_CONFIGS[(4, 1)][1:])},
}


def decode_configs(device_name: str, bits: int, mt: int) -> tuple[DecodeConfig, ...]:
    """The launch shapes a decode plan chooses from on a GPU named ``device_name``, for ``bits``
    and ``mt`` n8 fragments: that GPU's :data:`DECODE_CONFIGS_BY_GPU` entry, else :data:`DECODE_CONFIGS`'."""
    for key, table in DECODE_CONFIGS_BY_GPU.items():
        if key in device_name and (bits, mt) in table:
            return table[(bits, mt)]
    return DECODE_CONFIGS[(bits, mt)]


def all_decode_configs() -> dict[tuple[int, int], tuple[DecodeConfig, ...]]:
    """Every launch shape a decode plan may choose on any GPU, per (bits, fragments): what the
    build checks and the GPU tests cover."""
    out = {key: tuple(cfgs) for key, cfgs in DECODE_CONFIGS.items()}
    for table in DECODE_CONFIGS_BY_GPU.values():
        for key, cfgs in table.items():
            out[key] = out.get(key, ()) + tuple(c for c in cfgs if c not in out.get(key, ()))
    return out

# The plan's cost model (decode.schedule()), in bytes of weight one SM streams in the same time
# (3 TB/s over 132 SMs: ~23 KB/us). Fitted (2026-11-24) to every launch shape x schedule of
# `tuning.DECODE_VARIANTS` timed in CUDA graphs on an H100 over 256 cases: K = 2..5, M = 1, 4, 16,
# fourteen dense layers from 2048->512 to 28672->8192 and the grouped expert launches of Qwen3-MoE
# and Mixtral shapes (`scripts/tune_decode_plan.py`, `bench/results/decode-plan-fit-h100.json`,
# `bench/results/decode.md`). The plans it picks are 1.5 / 2.0 / 1.9 / 0.6 % slower than the fastest measured variant (geometric mean
# over the cases, K = 2 / 3 / 4 / 5), against 1.5 / 2.1 / 5.6 / 4.0 % for the constants before.

# Each segment (the block's chunks of one row tile) whose rows one warp owns: its store and a
# pipeline restart.
DECODE_SEGMENT_COST_BYTES = 8 * 1024

# Each segment whose rows several warps share (k_warps > 1): the in-block reduction on top.
DECODE_SHARED_SEGMENT_COST_BYTES = 22 * 1024

# A launch that splits row tiles over blocks: the finalisation chain (workspace atomics,
# counter, the last contributor's reads and store) ...
DECODE_SPLIT_COST_BYTES = 52 * 1024

# ... plus this much per block a row tile's K is cut among (the last contributor reads every
# partial).
DECODE_SPLIT_PIECE_COST_BYTES = 2560

# The launch shapes `scripts/bench_decode.py --variants` times, per (bits, n8 fragments), as
# (warps, warps along K, row groups, depth, min blocks per SM): the tuned ones above and their
# neighbours.
DECODE_VARIANTS: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {
    (2, 1): [(16, 16, 2, 1, 1), (16, 16, 2, 2, 1), (16, 4, 2, 2, 1), (16, 4, 2, 3, 1), (16, 1, 2, 1, 1), (16, 1, 2, 2, 1)],
    (3, 1): [(8, 8, 2, 2, 2), (16, 16, 2, 1, 1), (16, 16, 2, 2, 1), (16, 8, 2, 2, 1), (16, 4, 2, 2, 1), (16, 1, 2, 1, 1), (16, 1, 2, 2, 1)],
    (4, 1): [(16, 16, 2, 1, 1), (16, 16, 2, 2, 1), (16, 4, 2, 2, 1), (16, 4, 4, 1, 1), (16, 8, 2, 2, 1), (16, 8, 2, 1, 1),
             (16, 16, 1, 2, 1), (16, 8, 1, 2, 1), (16, 1, 2, 1, 1), (16, 1, 2, 2, 1)],
    (5, 1): [(16, 16, 2, 1, 1), (16, 4, 2, 1, 1), (16, 1, 2, 1, 1)],
    (2, 2): [(16, 16, 2, 1, 1), (16, 4, 2, 2, 1), (16, 4, 2, 1, 1), (16, 1, 2, 1, 1)],
    (3, 2): [(16, 16, 2, 1, 1), (16, 4, 2, 1, 1), (16, 1, 2, 1, 1)],
    (4, 2): [(16, 16, 2, 1, 1), (16, 4, 2, 1, 1), (16, 1, 2, 1, 1)],
    (5, 2): [(16, 16, 2, 1, 1), (16, 4, 2, 1, 1), (16, 1, 2, 1, 1)],
}


# ---------------------------------------------------------------------------------------
# GGUF block formats (kbit_linear.backends.cuda.gguf)
# ---------------------------------------------------------------------------------------

# Largest M (rows of x) handed to the GGUF small-M kernel; larger M dequantizes the weight and
# calls cuBLAS. 64 is the kernel's limit (eight n8 tensor-core fragments) and about the
# cross-over: H100, fp16, Q4_0, `scripts/bench_gguf.py` (2026-11-23), kernel vs dequantize +
# cuBLAS at M = 64: 8192->28672 346 vs ~380 us, 4096->14336 87 vs ~97, 4096->4096 30 vs ~27.
# (Giving M > 8 two to four row tiles per block, to share x, was slower at every M: 14336x4096
# M = 16 41 vs 27 us.)
GGUF_GEMV_MAX_M = 64

# Launch shape of the GGUF small-M kernel per n8 token fragments (M <= 8, 16, 32, 64): (warps
# per block, splitting K; steps of 4 consecutive 32-weight blocks whose loads a warp keeps in
# flight). H100, fp16, one run of `scripts/bench_gguf.py --shapes 4096x14336 8192x28672 --m 1 16
# 32 64 --types Q4_0 Q8_0 --launch W,U` for (W, U) in (8,2) (8,1) (4,2) (4,1) (2,2) (8,3) (16,1)
# (16,2) (2026-11-23); Q4_0 4096x14336 / 8192x28672 us: M = 1 (8,2) 15.9 / 54.6, (8,1) 17.1 / 51.5;
# M = 16 (8,1) 28.7 / 93.8, (8,2) 33.0 / 98.8; M = 32 (8,2) 50.8 / 160.1, (8,1) 54.1 / 167.7;
# M = 64 (8,1) 90.9 / 298.2, (8,2) 105.3 / 349.4. Differences under ~5 % are within the noise.
GGUF_GEMV_LAUNCH: dict[int, tuple[int, int]] = {1: (8, 2), 2: (8, 1), 4: (8, 2), 8: (8, 1)}


# ---------------------------------------------------------------------------------------
# decode attention over the quantized KV cache (kbit_linear.backends.cuda.kv_attention)
# ---------------------------------------------------------------------------------------

# The context is split so that the decode grid fills whole waves of resident blocks (flash-decoding:
# one sequence must fill the GPU), each split at least KV_DECODE_MIN_KEY_BLOCKS key blocks (one
# per warp, so no warp of a block idles). H100, scripts/bench_kv_attention.py (2026-11-23): with
# 4 blocks per SM wanted, 32k context batch 1 ran 1.3 waves (512 blocks, 396 resident); whole
# waves took 32k batch 8 from 306 to 232 us. (Warps sharing a key block's tiles round-robin was
# 2x slower: each warp then forms Q' for every key block.)
KV_DECODE_MIN_KEY_BLOCKS = 4
# Where whole key blocks per warp would leave more than this share of the SMs without a block,
# the block's warps share each key block's tiles instead (and a split may be one key block), in
# splits sized for KV_DECODE_SPLIT_TILES_BLOCKS_PER_SM blocks per SM: two warps per scheduler hide
# each other's prologue, while four would each form Q' for every key block and pay a prologue
# for one or two tiles. H200, 4-bit cache, Llama-3-8B heads, batch 1, call us without the mass
# (2026-12-01, .../kv-attention-kernel.md), (key blocks a split, shared or whole), with the sinks
# in a whole tile (no longer so): 4k tokens (2, shared) 10.4, (1, shared) 11.2, (4, whole) 11.3;
# 8k (4, whole) 13.0, (2, shared) 14.2; sinks as now: 2k (1, shared) 9.8, (4, whole) 11.8; the
# shared tiles rotating among the warps (a key block's fifth tile to another warp than the next
# block's): 2.5 bits at 3k and 4k 1.04x and 1.02x over whole key blocks (0.96x and 0.95x before
# the rotation). H100, 2026-11-23: 1k tokens whole 18.4 / shared 15.6 (32 vs 128 blocks).
KV_DECODE_SPLIT_TILES_IDLE_SHARE = 0.0
KV_DECODE_SPLIT_TILES_BLOCKS_PER_SM = 2
# The combine launch also takes the allocator's mass where its grid, mass blocks included, has at
# most this many blocks per SM (short contexts at small batch): the mass kernel's own launch
# costs more there than its work, while each mass block forms its rows' max and sum again from
# the splits. At one block per SM the grid also stays within loader.short_grid_may_overlap.
# H200, 4-bit cache, batch 1 (2026-12-01): calls with the mass 12.46 against 13.97 us at 4k
# tokens, a step's mean (the mass on one step in 4) 1.02-1.03x at 2k-8k tokens.
KV_MASS_IN_COMBINE_MAX_BLOCKS_PER_SM = 1
# The first split of a row is made short (kv_attention._first_split_shift) only for splits of at
# most this many key blocks: then a warp takes about that many tiles (4 a key block), and key
# block 0's extra tile (the sinks at 8 bits) lengthens the block the grid waits for by an eighth
# or more. H200, batch 1, a step's mean, short first split against none, same run (2026-12-01):
# 4k tokens (2 a split) 4 bits 1.06x, by token 1.07x, 2.5 bits 1.02x; 32k (8 a split) 4 bits
# 1.02x, others 0.99-1.01x; 128k (32 a split) 0.99x at every mix.
KV_DECODE_SHORT_FIRST_SPLIT_MAX_KEY_BLOCKS = 8
# A decode block takes two KV heads (kv_attention.pairs_heads) only where its plan gives splits
# of at least this many key blocks (two a warp, whole key blocks): a pair's tile is twice the
# latency of a head's, so where each warp runs only a few tiles (one wave, latency-bound) two
# heads a block gain nothing; where warps run many, the fewer instructions per token do.
# H200, a call without the mass, pair against one head a block, same run (2026-12-01): batch 8:
# 32k tokens (8 a split) 4 bits 1.12x, 2.5 bits 1.12x; 128k 1.31x, 1.13x; batch 1, 128k (16 a
# split) 1.07x, 1.12x; but one key block a warp: 32k batch 1 0.84x, 1.02x; 4k batch 8 0.87x, 0.98x.
KV_DECODE_PAIR_MIN_SPLIT_KEY_BLOCKS = 8


# ---------------------------------------------------------------------------------------
# the one-launch router of mixture-of-experts layers (kbit_linear.backends.cuda.router)
# ---------------------------------------------------------------------------------------

# Most tokens the router kernel takes; more go to the reference (GEMM, softmax, top-k, sort),
# whose launches matter less as the token count grows while the kernel's one block per expert
# re-reads x for every token. H200, bf16, us per call, transformers' router vs the kernel
# (scripts/bench_router.py, bench/results/router-h200.md), Qwen3-30B-A3B / Mixtral / OLMoE:
# 2026-11-29 17:50 UTC, 8 tokens 27.3 vs 13.0, 21.1 vs 12.8, 21.7 vs 12.6; 16 tokens 28.6 vs
# 23.6, 22.0 vs 23.0, 22.1 vs 22.8. After the kernel's faster top-k (19:35 UTC): 8 tokens 27.0
# vs 11.3, 22.1 vs 10.6, 19.3 vs 9.9; 16 tokens 27.7 vs 20.2, 22.2 vs 19.4, 22.2 vs 17.6: ahead
# at 16 now, but counts between 8 and 16 were not timed, so the limit is not raised yet.
ROUTER_MAX_TOKENS = 8
