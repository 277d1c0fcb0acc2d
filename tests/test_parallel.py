"""Tensor parallelism: exact slicing of the format and of layers, plan checks, and whole models
sharded over two processes (``tests/tp_worker.py`` under ``torchrun``).

The two-process CPU test (gloo, float32, ~15 s) checks that the sharded model's logits equal the
whole model's within float32 rounding and that greedy generation gives the same tokens; the GPU
variant (markers ``cuda`` and ``multi_gpu``, nccl, bfloat16) checks the same tokens against the
whole model on one GPU.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import kbit_linear
from kbit_linear import format as fmt
from kbit_linear.parallel import shard_plan, slice_linear

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "tp_worker.py"


# ---------------------------------------------------------------------------------------
# the format: slice_weight
# ---------------------------------------------------------------------------------------


def _qweight(n: int, k: int, bits: int, seed: int = 0) -> fmt.KbitWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    w[: n // 3, : min(k, 40)] *= 30.0  # uneven block scales, some near the E4M4 top
    return fmt.quantize(w, bits)


def _col_spans(k: int) -> list[tuple[int, int]]:
    """32-aligned (start, stop) pairs of in_features: on and off the 64-wide k-tiles, stop also at k."""
    starts = sorted({0, 32, 64, (k - 1) // 32 * 32} & set(range(0, k, 32)))
    return sorted({(a, b) for a in starts for b in (a + 32, a + 64, a + 96, k) if b <= k and (b % 32 == 0 or b == k)})


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("n,k", [(256, 128), (300, 200), (192, 96), (129, 65), (3, 33)], ids=lambda v: str(v))
def test_slice_weight_equals_slice_of_reference(n: int, k: int, bits: int) -> None:
    q = _qweight(n, k, bits)
    full = fmt.dequantize(q)
    row_spans = [(0, n), (0, min(128, n)), (n // 2, n), (1, max(2, n // 3))]
    if n > 128:
        row_spans.append((128, n))
    for rows in row_spans:
        for cols in _col_spans(k):
            s = fmt.slice_weight(q, rows, cols)
            assert s.shape == (rows[1] - rows[0], cols[1] - cols[0])
            assert torch.equal(fmt.dequantize(s), full[rows[0]:rows[1], cols[0]:cols[1]]), (rows, cols)
            # a valid weight of its own shape: tiles, padding made of zero blocks
            fmt.check_tiled(s.packed, s.absmax, bits, *s.shape)
            p, a = fmt.untile_blocks(s.packed, s.absmax, bits, *s.shape)
            assert fmt.tile_blocks(p, a, bits)[0].equal(s.packed)


def test_slice_weight_keeps_whole_tiles_when_aligned() -> None:
    q = _qweight(512, 256, 4)
    s = fmt.slice_weight(q, (128, 384), (64, 192))
    assert torch.equal(s.packed, q.packed[1:3, 1:3])
    assert torch.equal(s.absmax, q.absmax[1:3, 1:3])
    assert torch.equal(s.tensor_scale, q.tensor_scale) and torch.equal(s.codebook, q.codebook)


def test_slice_weight_user_codebook() -> None:
    cb = torch.linspace(-1, 0.9, 8)
    q = fmt.quantize(torch.randn(200, 96), 3, cb)
    s = fmt.slice_weight(q, (7, 150), (32, 96))
    assert torch.equal(s.codebook, cb)
    assert torch.equal(fmt.dequantize(s), fmt.dequantize(q)[7:150, 32:96])


@pytest.mark.parametrize(
    "rows,cols,match",
    [
        ((0, 0), None, "0 <= start < stop"),
        ((5, 3), None, "0 <= start < stop"),
        ((0, 301), None, "out_features=300"),
        (None, (16, 64), "multiples of 32"),
        (None, (0, 48), "multiples of 32"),
        (None, (0, 201), "in_features=200"),
    ],
)
def test_slice_weight_bad_ranges(rows, cols, match) -> None:
    with pytest.raises(ValueError, match=match):
        fmt.slice_weight(_qweight(300, 200, 4), rows, cols)


def test_slice_weight_bad_types() -> None:
    q = _qweight(64, 64, 2)
    with pytest.raises(TypeError, match="qweight"):
        fmt.slice_weight(torch.zeros(2, 2), (0, 1))
    with pytest.raises(TypeError, match="rows"):
        fmt.slice_weight(q, (0.0, 1))
    with pytest.raises(TypeError, match="cols"):
        fmt.slice_weight(q, None, 32)


# ---------------------------------------------------------------------------------------
# layers: slice_linear
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_slice_linear_kbit(bias: bool) -> None:
    torch.manual_seed(0)
    layer = kbit_linear.KbitLinear.from_linear(nn.Linear(160, 300, bias=bias), bits=3)
    x = torch.randn(5, 160)
    rows, cols = (100, 250), (32, 128)
    part = slice_linear(layer, rows=rows, cols=cols)
    assert isinstance(part, kbit_linear.KbitLinear) and (part.out_features, part.in_features) == (150, 96)
    assert torch.equal(part.dequantize(), layer.dequantize()[100:250, 32:128])
    ref = torch.nn.functional.linear(x[:, 32:128], layer.dequantize()[100:250, 32:128], layer.bias[100:250] if bias else None)
    torch.testing.assert_close(part(x[:, 32:128]), ref, rtol=1e-5, atol=1e-5)
    assert layer.out_features == 300 and layer.weight.shape == fmt.tiled_shapes(300, 160, 3)[0]  # unchanged


def test_slice_linear_dense_and_errors() -> None:
    lin = nn.Linear(64, 40)
    part = slice_linear(lin, rows=(10, 30))
    assert torch.equal(part.weight, lin.weight[10:30]) and torch.equal(part.bias, lin.bias[10:30])
    with pytest.raises(TypeError, match="KbitLinear or nn.Linear"):
        slice_linear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="rows"):
        slice_linear(lin, rows=(0, 41))


# ---------------------------------------------------------------------------------------
# the plan: resolution and refusals (no process group needed)
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _llama_cached(overrides: tuple[tuple[str, int], ...]) -> LlamaForCausalLM:
    cfg = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    kbit_linear.quantize_model(model, bits=4, progress=False)
    return model


def _llama(**overrides: int) -> LlamaForCausalLM:
    """A tiny quantized Llama (built once per configuration: shard_plan changes nothing)."""
    return _llama_cached(tuple(sorted(overrides.items())))


def test_shard_plan_uses_the_models_plan() -> None:
    model = _llama()
    shards = {s.name: s for s in shard_plan(model, world_size=2, rank=1)}
    assert shards["model.layers.1.self_attn.q_proj"].style == "colwise"
    assert shards["model.layers.1.self_attn.q_proj"].span == (128, 256)
    assert shards["model.layers.0.mlp.down_proj"].style == "rowwise"
    assert shards["model.layers.0.mlp.down_proj"].span == (256, 512)
    assert shards["lm_head"].style == "colwise_gather_output"
    assert "model.norm" not in shards
    # the embedding is in Llama's plan from some transformers 5.x release on (not in 5.17)
    own = model.tp_plan if getattr(model, "tp_plan", None) else {}
    assert ("model.embed_tokens" in shards) == any(key.endswith("embed_tokens") for key in own)
    if "model.embed_tokens" in shards:
        assert shards["model.embed_tokens"].style == "embedding_rowwise"


def test_shard_plan_user_plan_and_replicate() -> None:
    model = _llama()
    plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.gate_proj": "replicate",
            "model.layers.*.mlp.down_proj.weight": "rowwise"}  # parameter entries are covered by their module's
    shards = shard_plan(model, 2, 0, plan)
    assert [(s.name, s.style) for s in shards] == [
        ("model.layers.0.mlp.gate_proj", "replicate"), ("model.layers.0.mlp.up_proj", "colwise"),
        ("model.layers.1.mlp.up_proj", "colwise")]


def test_a_given_plan_entry_that_names_no_module_is_refused() -> None:
    """A misspelled entry would leave q_proj whole while o_proj is split: refused by name."""
    model = _llama()
    plan = {"model.layers.*.self_attn.qproj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"plan entries \['model.layers.\*.self_attn.qproj'\] name no module"):
        shard_plan(model, 2, 0, plan)
    shard_plan(model, 2, 0)  # the model's own plan may cover modules this model lacks


def test_shard_plan_refuses_uneven_splits_naming_the_layer() -> None:
    model = _llama()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj: out_features=128 does not split evenly over 3"):
        shard_plan(model, 3, 0, {"model.layers.*.self_attn.k_proj": "colwise"})
    with pytest.raises(ValueError, match=r"model\.embed_tokens: num_embeddings=256 does not split evenly over 3"):
        shard_plan(model, 3, 0, {"model.embed_tokens": "embedding_rowwise"})
    # in_features 512 over 8 ranks = 64 per rank is fine; over 32 it would cut a 32-weight block
    model = _llama(intermediate_size=320)  # 320 / 2 = 160 per rank: fine; 320 / 4 = 80: cuts a block
    shard_plan(model, 2, 0, {"model.layers.*.mlp.down_proj": "rowwise"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: in_features=320 over 4 ranks gives 80"):
        shard_plan(model, 4, 0, {"model.layers.*.mlp.down_proj": "rowwise"})


def test_shard_plan_refuses_cut_rotation_blocks_before_anything_is_cut() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    kbit_linear.quantize_model(model, bits=4, hadamard=True, progress=False)  # down_proj: 384 in, rotation blocks of 128
    shard_plan(model, 3, 0, {"model.layers.*.mlp.down_proj": "rowwise"})  # 128 per rank: whole blocks
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: in_features=384 over 2 ranks gives 192 per "
                                         r"rank, which cuts the layer's Hadamard rotation blocks of 128"):
        shard_plan(model, 2, 0, {"model.layers.*.mlp.down_proj": "rowwise"})


def test_shard_plan_replicates_for_replicated_with_grad_allreduce_and_refuses_embedding_subclasses() -> None:
    model = _llama()
    shards = shard_plan(model, 2, 0, {"model.norm": "replicated_with_grad_allreduce"})
    assert [(s.name, s.style) for s in shards] == [("model.norm", "replicate")]

    class ScaledEmbedding(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 8.0

    model = nn.Sequential(ScaledEmbedding(16, 8))
    with pytest.raises(TypeError, match="0: style 'embedding_rowwise' shards a plain nn.Embedding, got ScaledEmbedding"):
        shard_plan(model, 2, 0, {"0": "embedding_rowwise"})


def test_shard_plan_refuses_cut_heads() -> None:
    model = _llama(num_key_value_heads=1, head_dim=64)  # k_proj 64 rows over 2 ranks: half a head each
    with pytest.raises(ValueError, match=r"k_proj: out_features=64 over 2 ranks gives 32 per rank, which cuts a head of 64"):
        shard_plan(model, 2, 0)


def test_shard_plan_bad_arguments() -> None:
    model = _llama()
    with pytest.raises(ValueError, match="unsupported tensor-parallel styles \\['packed_colwise'\\]"):
        shard_plan(model, 2, 0, {"lm_head": "packed_colwise"})
    with pytest.raises(TypeError, match="model.norm: style 'colwise' shards KbitLinear or nn.Linear"):
        shard_plan(model, 2, 0, {"model.norm": "colwise"})
    with pytest.raises(TypeError, match="embedding_rowwise.*nn.Embedding"):
        shard_plan(model, 2, 0, {"lm_head": "embedding_rowwise"})
    with pytest.raises(ValueError, match="names no module"):
        shard_plan(model, 2, 0, {"model.nothing": "colwise"})
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        shard_plan(nn.Sequential(nn.Linear(4, 4)), 2, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_plan(model, 2, 2)
    with pytest.raises(TypeError, match="world_size"):
        shard_plan(model, 2.0, 0)
    with pytest.raises(TypeError, match="plan must be a dict"):
        shard_plan(model, 2, 0, ["lm_head"])


def test_shard_for_tensor_parallel_needs_a_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        kbit_linear.shard_for_tensor_parallel(_llama())


def test_shard_for_tensor_parallel_names_a_bad_process_group() -> None:
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a process group in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup or None, got str"):
            kbit_linear.shard_for_tensor_parallel(_llama(), process_group="foo")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# whole models over two processes
# ---------------------------------------------------------------------------------------


def _torchrun(out: Path, *args: str, timeout: int) -> dict[str, dict]:
    """Run the worker on two processes and return rank 0's and rank 1's results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {f"rank{r}": json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


def _check_ranks(results: dict[str, dict], rel_tol: float) -> None:
    for rank, per_model in results.items():
        assert per_model["world_size"] == 2
        for name, r in ((k, v) for k, v in per_model.items() if isinstance(v, dict)):
            where = f"{rank}, model {name}"
            # the model's own plan: transformers releases differ in whether it shards the embedding
            assert {"colwise", "rowwise"} <= set(r["styles"]) <= {"colwise", "colwise_gather_output", "embedding_rowwise",
                                                                 "rowwise"}, where
            assert r["tp_tokens"] == r["whole_tokens"], f"{where}: greedy tokens differ (top-2 margin {r['min_top2_margin']})"
            assert r["logits_max_abs_diff"] <= rel_tol * r["logits_max_abs"], f"{where}: {r}"
            assert r["tp_bytes"] < 0.7 * r["whole_bytes"], where  # norms and scales stay replicated
        assert per_model["retiled_bias_tied"]["tied"], rank
        assert "out_features=96" in per_model["retiled_bias_tied"]["q_proj"]  # 192 rows -> 96 per rank
    # both ranks computed the same thing
    assert results["rank0"]["aligned"]["tp_tokens"] == results["rank1"]["aligned"]["tp_tokens"]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_processes_cpu_match_one(tmp_path: Path) -> None:
    """gloo, float32: logits within float32 rounding of the whole model's, identical greedy tokens."""
    results = _torchrun(tmp_path, "--backend", "gloo", "--dtype", "float32", timeout=300)
    _check_ranks(results, rel_tol=1e-5)


@pytest.mark.cuda
@pytest.mark.multi_gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="needs torch.distributed with nccl")
def test_two_gpus_match_one(tmp_path: Path) -> None:
    """nccl, bfloat16, the CUDA kernels: the same greedy tokens as the whole model on one GPU."""
    results = _torchrun(tmp_path, "--backend", "nccl", "--dtype", "bfloat16", timeout=600)
    _check_ranks(results, rel_tol=3e-2)


# ---------------------------------------------------------------------------------------
# transformers' own tensor-parallel loading is refused with directions
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_from_pretrained_tp_plan_is_refused_with_directions(tmp_path: Path) -> None:
    """What from_pretrained(tp_plan="auto") hands the quantizer: the pending layer's weight as a
    DTensor (a one-process gloo mesh stands in for torchrun)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from kbit_linear.integrations.transformers import KbitHfQuantizer

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Module()
        model.proj = nn.Linear(64, 128)
        model.proj.weight = nn.Parameter(distribute_tensor(model.proj.weight.detach(), mesh, [Replicate()]))
        hfq = KbitHfQuantizer(kbit_linear.KbitConfig(bits=4), pre_quantized=False)  # quantize at load
        hfq.pending = {"proj"}
        with pytest.raises(ValueError, match=r"proj\.weight: kbit layers cannot be sharded by from_pretrained\(tp_plan=.*shard_for_tensor_parallel"):
            hfq.param_needs_quantization(model, "proj.weight")
        assert not hfq.param_needs_quantization(model, "proj.bias")
    finally:
        dist.destroy_process_group()


def test_slices_of_a_hadamard_rotated_layer_keep_its_rotation_or_refuse():
    torch.manual_seed(4)
    dense = nn.Linear(512, 96)
    layer = kbit_linear.KbitLinear.from_linear(dense, bits=3, hadamard=True)  # rotation blocks of 256
    x = torch.randn(3, 512)
    rows = slice_linear(layer, rows=(32, 96))
    torch.testing.assert_close(rows(x), layer(x)[:, 32:96])
    cols = [slice_linear(layer, cols=(c, c + 256)) for c in (0, 256)]
    assert all(c.hadamard_signs is not None for c in cols)
    summed = cols[0](x[:, :256]) + cols[1](x[:, 256:]) - layer.bias
    torch.testing.assert_close(summed, layer(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cols[1].dequantize(), layer.dequantize()[:, 256:])
    for bad in [(0, 128), (128, 384)]:
        with pytest.raises(ValueError, match="rotation blocks"):
            slice_linear(layer, cols=bad)
