"""How the wgmma planner picks the token tile, splits K and uses clusters (no GPU needed)."""

from __future__ import annotations

import pytest

from kbit_linear.backends.cuda import grouped, hopper, ops, tuning

H100_SMS = 132


H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


@pytest.mark.parametrize(
    "m,k,n,bits,expected",
    [
        # (token tile, split_k, stream-K): the fastest plan of the sweep behind tuning.WGMMA_KTILE_US
        (64, 4096, 4096, 4, (64, 4, False)),  # 32 tiles x 4 pieces: one block per SM
        (128, 4096, 4096, 4, (64, 2, False)),  # two 64-token tiles beat one of 128
        (256, 4096, 4096, 4, (128, 2, False)),  # a cluster of two per tile
        (64, 4096, 14336, 4, (64, 2, False)),  # 224 blocks, two per SM
        (128, 14336, 4096, 4, (128, 4, False)),
        (256, 14336, 4096, 5, (256, 4, False)),  # K = 5 decodes more per weight: the larger tile
        (64, 8192, 28672, 4, (64, None, True)),  # 224 tiles: stream-K over every block slot
        (64, 28672, 8192, 4, (64, 4, False)),
        (256, 28672, 8192, 4, (256, 2, False)),
        (1024, 4096, 4096, 4, (256, 1, False)),  # a full wave of whole tiles
        (64, 4096, 1024, 4, (64, 8, False)),  # 64 blocks in clusters of eight
        (64, 2048, 2048, 4, (64, 4, False)),  # 64 blocks in clusters of four
        (128, 4096, 1024, 4, (64, 4, False)),
    ],
)
def test_h100_llama_shapes_take_the_measured_best_plan(m, k, n, bits, expected):
    assert ops._wgmma_choice(m, n // 128, k // 64, bits, H100_SMS, H100) == expected


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("k_tiles", [1, 2, 3, 7, 64, 100, 224, 448])
@pytest.mark.parametrize("n_tiles", [1, 5, 8, 33, 66, 67, 100, 132])
@pytest.mark.parametrize("m", [17, 64, 100, 256, 700])
def test_an_equal_split_is_whole_pieces_resident_at_once(m, n_tiles, k_tiles, bits):
    tile, split, stream_k = ops._wgmma_choice(m, n_tiles, k_tiles, bits, H100_SMS, H100)
    assert tile in hopper.TOKEN_TILES
    tiles = -(-m // tile) * n_tiles
    if split is not None:
        assert not stream_k and split >= 1 and k_tiles % split == 0 and tiles * split <= hopper.min_blocks_per_sm(tile) * H100_SMS
    elif not stream_k:  # the model covers no tile: every candidate's grid exceeds the resident blocks
        assert tile == hopper.token_tile(m, H100)
        assert all(-(-m // t) * n_tiles > hopper.min_blocks_per_sm(t) * H100_SMS for t in ops._wgmma_token_tiles(m, H100))


def test_grids_larger_than_the_resident_blocks_keep_the_table_tile_and_the_stream_k_rules():
    # 8192->28672 at M = 4096: thousands of tiles at every token tile
    assert ops._wgmma_choice(4096, 224, 128, 4, H100_SMS, H100) == (256, None, False)


def test_a_forced_token_tile_is_the_only_one_weighed(monkeypatch):
    monkeypatch.setitem(tuning.WGMMA_TOKEN_TILES, "default", ((128, 1 << 30),))
    for m in (17, 64, 256, 1000):
        assert ops._wgmma_token_tiles(m, H100) == [128]
        assert ops._wgmma_choice(m, 32, 64, 4, H100_SMS, H100)[0] == 128


@pytest.mark.parametrize(
    "k_tiles,iters,token_tile,expected",
    [
        (64, 16, 256, 4),  # four equal pieces: one cluster of 4 per tile
        (64, 32, 128, 2),
        (64, 8, 64, 8),  # 8 pieces of a 64-token tile: one token group of 8 per block
        (64, 64, 256, 1),  # unsplit
        (63, 21, 256, 1),  # 3 pieces: not a cluster size
        (64, 9, 256, 1),  # stream-K ranges that do not align with the tiles
        (64, 4, 256, 1),  # 16 pieces: more than a portable cluster
    ],
)
def test_aligned_splits_of_two_four_or_eight_pieces_can_run_as_clusters(k_tiles, iters, token_tile, expected, monkeypatch):
    monkeypatch.setattr(tuning, "WGMMA_CLUSTER_SPLITS", (2, 4, 8))
    plan = ops._GemmPlan("wgmma-splitk", grid=64, iters=iters, split=iters % k_tiles != 0)
    assert ops._wgmma_cluster(plan, k_tiles, token_tile, H100_SMS, lambda parts: H100_SMS // parts) == expected


def _h100_clusters(parts: int) -> int:
    return H100_SMS // parts


def test_clusters_where_the_gpu_runs_them_all_at_once_and_fours_and_eights_on_small_grids_only():
    plan = ops._GemmPlan("wgmma-splitk", grid=128, iters=32, split=True)
    assert ops._wgmma_cluster(plan, 64, 128, H100_SMS, _h100_clusters) == 2
    assert ops._wgmma_cluster(plan, 64, 128, H100_SMS, lambda parts: 60) == 1  # 64 clusters: more than the GPU holds
    plan = ops._GemmPlan("wgmma-splitk", grid=448, iters=64, split=True)  # several waves
    assert ops._wgmma_cluster(plan, 128, 256, H100_SMS, _h100_clusters) == 1
    plan = ops._GemmPlan("wgmma-splitk", grid=128, iters=16, split=True)  # four pieces on 128 blocks
    assert ops._wgmma_cluster(plan, 64, 256, H100_SMS, _h100_clusters) == 1
    plan = ops._GemmPlan("wgmma-splitk", grid=64, iters=8, split=True)  # eight pieces on 64 blocks
    assert ops._wgmma_cluster(plan, 64, 64, H100_SMS, _h100_clusters) == 8


def test_the_last_wgmma_row_depends_on_the_weights_layout():
    # pair codes (what a layer holds on the GPU) keep the kernel further than planes do
    assert tuning.wgmma_rows(H100, 8192 * 28672, 4, pairs=True)[1] == 2048
    assert tuning.wgmma_rows(H100, 8192 * 28672, 4, pairs=False)[1] == 1024
    assert tuning.wgmma_rows(H100, 8192 * 28672, 5, pairs=True)[1] == 1024
    assert tuning.wgmma_rows(H100, 8192 * 28672, 5, pairs=False)[1] == 512
    for bits in (2, 3):  # planes are their only layout
        assert tuning.wgmma_rows(H100, 8192 * 28672, bits, pairs=False) == tuning.wgmma_rows(H100, 8192 * 28672, bits, pairs=True)


def test_weights_from_4096_x_4096_take_the_wgmma_kernel_from_row_17():
    assert tuning.wgmma_rows(H100, 4096 * 4096, 4)[0] == 17
    assert tuning.wgmma_rows(H100, 8192 * 28672, 4)[0] == 17
    assert tuning.wgmma_rows(H100, 4096 * 1024, 4)[0] == 33  # the mma.sync kernel is as fast there


def test_an_h200_gives_every_weight_the_wgmma_kernel_after_the_decode_kernels_rows():
    # measured there with the cluster splits and the small token tiles (tuning.WGMMA_EARLY_FIRST_ROW's
    # and tuning.DECODE_MAX_M's comments): the wgmma kernel from M = 9, where the decode kernel stops
    for n, k in [(1024, 4096), (512, 2048), (4096, 1024), (28672, 8192)]:
        for bits in (2, 3, 4, 5):
            assert tuning.wgmma_rows(H200, n * k, bits)[0] == 9
    # the decode kernel keeps M <= 16, and M <= 8 of weights of 128 Mi elements or more
    for gpu in (H100, H200):
        assert tuning.decode_max_m(gpu, 4096 * 4096) == 16
        assert tuning.decode_max_m(gpu, 4096 * 14336) == 16
        assert tuning.decode_max_m(gpu, 8192 * 28672) == 8


@pytest.mark.parametrize(
    "m,k,n,expected_tile",
    [
        # K = 4: the fastest tile of the H200 sweep behind tuning.WGMMA_TOKEN_TILES at M = 16, 32 and 64
        # (the planner's choice wherever the dispatcher sends such a layer to the wgmma kernel)
        (16, 4096, 14336, 16),
        (16, 8192, 28672, 16),
        (16, 14336, 4096, 16),
        (32, 4096, 4096, 32),
        (32, 4096, 14336, 32),
        (32, 14336, 4096, 32),
        (32, 8192, 28672, 32),
        (32, 4096, 1024, 64),  # 8 n-tiles: tile 64 in clusters of eight is faster there
        (64, 8192, 28672, 64),
    ],
)
def test_h200_small_m_takes_the_small_token_tiles(m, k, n, expected_tile):
    assert ops._wgmma_choice(m, n // 128, k // 64, 4, H100_SMS, H200)[0] == expected_tile


def test_the_h100_keeps_its_measured_token_tiles():
    # tiles 16 and 32 are listed for the H200 only (not measured on an H100)
    for m in (17, 24, 32, 64):
        assert ops._wgmma_choice(m, 224, 128, 4, H100_SMS, H100)[0] == 64


def test_every_token_tile_has_its_time_model_rows():
    for tile in hopper.TOKEN_TILES:
        for bits in (2, 3, 4, 5):
            assert tile in tuning.WGMMA_KTILE_US[bits]
        assert tile in tuning.WGMMA_STREAM_K and tile in tuning.WGMMA_FIXUP_US and tile in tuning.WGMMA_CLUSTER_FIXUP_US
        # a cluster of P blocks splits the tile's token groups of 8 (reduce_in_cluster)
        assert all((tile // 8) % p == 0 for p in tuning.WGMMA_CLUSTER_FIXUP_US[tile])


def test_the_grouped_kernel_takes_small_tiles_only_for_few_rows_per_group():
    # tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN's measurements: small tiles up to 8 rows per group
    assert grouped.token_tile_for(32 * 8, 128, H200) == 16  # Qwen3 shape, 32 tokens: 2 rows per expert
    assert grouped.token_tile_for(128 * 8, 128, H200) == 16  # 8 rows per expert
    assert grouped.token_tile_for(256 * 8, 128, H200) == 64  # 16: the groups above 16 would take two tiles
    assert grouped.token_tile_for(512 * 8, 128, H200) == 64
    assert grouped.token_tile_for(2048 * 8, 128, H200) == 128
    assert grouped.token_tile_for(128 * 8, 128, H100) == 64  # the H100's table has no small tiles
