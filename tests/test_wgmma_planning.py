"""How the wgmma kernel's grid splits K when there is at most one tile per SM (no GPU needed)."""

from __future__ import annotations

import pytest

from kbit_linear.backends.cuda import ops, tuning

H100_SMS = 132


@pytest.mark.parametrize(
    "tiles,k_tiles,token_tile,expected",
    [
        (112, 64, 256, 1),  # 4096->14336 at M = 256: 85 % of the SMs busy beats stream-K's fix-ups
        (112, 64, 128, 1),  # the same at M = 128
        (32, 224, 256, 4),  # 14336->4096 at M = 256: four pieces of 56 k-tiles
        (64, 448, 256, 2),  # 28672->8192 at M = 256
        (8, 64, 256, 4),  # 4096->1024 at M = 256: more pieces would cost more fix-up than they save
        (32, 64, 128, 4),  # 4096->4096 at M = 128
        (128, 64, 256, 1),  # a full wave
    ],
)
def test_h100_llama_shapes_take_the_measured_best_split(tiles, k_tiles, token_tile, expected):
    assert ops._wgmma_single_wave_split(tiles, k_tiles, H100_SMS, token_tile) == expected


@pytest.mark.parametrize("token_tile", sorted(tuning.WGMMA_SPLIT_FIXUP_KTILES))
@pytest.mark.parametrize("k_tiles", [1, 2, 3, 7, 64, 100, 224, 448])
@pytest.mark.parametrize("tiles", [1, 5, 8, 33, 66, 67, 100, 132])
def test_a_split_is_whole_pieces_in_one_wave(tiles, k_tiles, token_tile):
    split = ops._wgmma_single_wave_split(tiles, k_tiles, H100_SMS, token_tile)
    if split is None:  # stream-K
        return
    assert split >= 1 and k_tiles % split == 0 and tiles * split <= H100_SMS


def test_stream_k_where_the_model_does_not_apply():
    assert ops._wgmma_single_wave_split(133, 64, H100_SMS, 256) is None  # more tiles than SMs
    assert ops._wgmma_single_wave_split(32, 64, H100_SMS, 64) is None  # two blocks per SM: the stream-K rule


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
def test_aligned_splits_of_two_four_or_eight_pieces_run_as_clusters(k_tiles, iters, token_tile, expected):
    plan = ops._GemmPlan("wgmma-splitk", iters=iters, split=iters % k_tiles != 0)
    assert ops._wgmma_cluster(plan, k_tiles, token_tile) == expected
