"""Every CUDA path on a second GPU (markers ``cuda`` and ``multi_gpu``; skipped with fewer than two).

Per-device state (compiled kernels, their shared-memory limits, launch plans, split-K buffers,
the thread's bound device) must follow the tensors' device, never the current device or the
device that happened to be used first. So every path runs on ``cuda:1`` with the current device
set to 0 and to 1, eagerly and in a CUDA graph, with programmatic launch on and off; a fresh
process uses ``cuda:1`` before ``cuda:0``; and a small Llama split over both GPUs with
``device_map="auto"`` generates the same greedy tokens as on one GPU.

Tolerances as in ``test_kernels_cuda.py``: quantize, repack and dequantize bit-identical to the
reference; the GEMM within a relative Frobenius error of 5e-3 (fp16) / 2e-2 (bf16) of the
float32 reference, written into NaN-filled outputs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kbit_linear
from kbit_linear import format as fmt
from kbit_linear.backends import cuda as kcuda
from kbit_linear.backends.cuda import driver, loader, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
]

REPO = Path(__file__).resolve().parent.parent
SECOND = torch.device("cuda", 1)
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (path, rows of x): each forced path at a size where it is the natural choice
PATHS = (("decode", 3), ("decode", 12), ("fused", 40), ("fused-splitk", 64), ("dequant+cublas", 300))
N, K = 1000, 1000  # odd tiles on both sides


@contextlib.contextmanager
def _current(index: int) -> Iterator[None]:
    with torch.cuda.device(index):
        yield


@contextlib.contextmanager
def _programmatic(on: bool) -> Iterator[None]:
    old = loader.set_programmatic_launch(on)
    try:
        yield
    finally:
        loader.set_programmatic_launch(old)


def _dense(bits: int, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(bits)
    lin = nn.Linear(K, N).to(dtype)
    with torch.no_grad():
        lin.weight[:50, :40] *= 25.0  # uneven block scales
    return lin


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _gemm(layer: kbit_linear.KbitLinear, x: torch.Tensor, path: str, **kw) -> torch.Tensor:
    out = torch.full((x.shape[0], layer.out_features), float("nan"), dtype=x.dtype, device=x.device)
    kcuda.gemm_cuda(x, layer.weight, layer.absmax, layer.codebook, layer.tensor_scale, layer.bits, layer.out_features,
                    layer.bias, path=path, out=out, **kw)
    return out


@pytest.mark.skipif(not all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(min(2, torch.cuda.device_count()))),
                    reason="the wgmma kernel needs compute capability 9.0 on both GPUs")
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("current", [0, 1], ids=["current0", "current1"])
@pytest.mark.parametrize("bits", [2, 4, 5])
def test_wgmma_plans_and_cluster_launches_on_the_second_gpu(bits, current, pdl):
    # The wgmma kernel's automatic plan, a forced stream-K, and K split in two as a cluster launch
    # (cuLaunchKernelEx with the cluster attribute) on cuda:1 whichever device is current.
    dense = _dense(bits, torch.bfloat16)
    with _current(current), _programmatic(pdl):
        layer = kbit_linear.KbitLinear.from_linear(dense.to(SECOND), bits=bits)
        w = layer.dequantize()
        for m, kw in ((200, {"path": "wgmma"}), (64, {"path": "wgmma-splitk"}), (100, {"path": "wgmma", "split_k": 2})):
            if kw.get("split_k") == 2:
                plan = ops._plan(m, N, K, bits, torch.bfloat16, 1, "wgmma", 2, layer.weight.dtype is torch.uint8)
                assert plan.cluster == 2, plan
            x = torch.randn(m, K, dtype=torch.bfloat16, device=SECOND)
            out = _gemm(layer, x, **kw)
            assert not torch.isnan(out).any(), f"{kw}: unwritten output elements"
            err = _rel_err(out, F.linear(x.float(), w, layer.bias.float()))
            assert err < REL_TOL[torch.bfloat16], f"{kw} M={m}: relative error {err:.2e}"
        assert torch.cuda.current_device() == current


@pytest.mark.skipif(not all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(min(2, torch.cuda.device_count()))),
                    reason="the wgmma kernel needs compute capability 9.0 on both GPUs")
def test_cluster_occupancy_on_one_gpu_after_a_cluster_launch_on_the_other():
    # Cluster launches and the driver's cluster-occupancy query share one launch configuration per
    # thread; a launch leaves its stream in it, and the query used to pass that stream on, so a
    # cuda:0 cluster launch made the next cuda:1 plan fail with CUDA_ERROR_INVALID_HANDLE. The
    # query uses the configuration of launches without programmatic launch: so do these.
    plans = []
    for device in (torch.device("cuda", 0), SECOND):
        layer = kbit_linear.KbitLinear.from_linear(_dense(4, torch.bfloat16).to(device), bits=4)
        x = torch.randn(100, K, dtype=torch.bfloat16, device=device)
        with _programmatic(False):
            out = _gemm(layer, x, "wgmma", split_k=2)  # launches with clusters of 2 on cuda:0 first
        plan = ops._plan(100, N, K, 4, torch.bfloat16, device.index, "wgmma", 2, layer.weight.dtype is torch.uint8)
        assert plan.cluster == 2, plan
        assert _rel_err(out, F.linear(x.float(), layer.dequantize(), layer.bias.float())) < REL_TOL[torch.bfloat16]
        plans.append(plan)
    torch.cuda.synchronize(0)
    # The query itself, uncached, for each device's copy of the kernel after the other's launches.
    for plan, index in zip(plans, (0, 1)):
        with loader._context_of(index):
            assert driver.max_active_clusters(plan.kernel.func_ptr, 2, plan.threads, plan.smem) >= 1


@pytest.mark.parametrize("current", [0, 1], ids=["current0", "current1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_every_path_on_the_second_gpu(bits, dtype, current):
    dense = _dense(bits, dtype)
    ref_layer = kbit_linear.KbitLinear.from_linear(dense, bits=bits)  # CPU reference
    with _current(current):
        layer = kbit_linear.KbitLinear.from_linear(dense.to(SECOND), bits=bits)  # quantize + repack on cuda:1
        assert layer.weight.dtype == (torch.uint8 if fmt.has_pair_codes(bits) else torch.int32)  # pair codes on a GPU
        state = layer.state_dict()  # planes, as the CPU layer holds them
        for name in ("weight", "absmax", "codebook", "tensor_scale"):
            t = state[name]
            assert t.device == SECOND and torch.equal(t.cpu(), getattr(ref_layer, name)), name
        w = layer.dequantize()  # dequantize on cuda:1
        assert torch.equal(w.cpu(), ref_layer.dequantize())
        for path, m in PATHS:
            x = torch.randn(m, K, dtype=dtype, device=SECOND)
            out = _gemm(layer, x, path)
            assert not torch.isnan(out).any(), f"{path}: unwritten output elements"
            err = _rel_err(out, F.linear(x.float(), w, layer.bias.float()))
            assert err < REL_TOL[dtype], f"{path} M={m}: relative error {err:.2e}"
            y = layer(x)  # the module's own dispatch
            assert y.device == SECOND and _rel_err(y, out) < REL_TOL[dtype]
        assert torch.cuda.current_device() == current


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("current", [0, 1], ids=["current0", "current1"])
def test_cuda_graph_on_the_second_gpu(pdl, current):
    dtype = torch.bfloat16
    layer = kbit_linear.KbitLinear.from_linear(_dense(4, dtype).to(SECOND), bits=4)
    w = layer.dequantize()
    with _programmatic(pdl), _current(current):
        for path, m in PATHS:
            x = torch.randn(m, K, dtype=dtype, device=SECOND)
            out = torch.full((m, N), float("nan"), dtype=dtype, device=SECOND)
            args = (layer.weight, layer.absmax, layer.codebook, layer.tensor_scale, 4, N, layer.bias)
            with torch.cuda.device(1):  # a capture records on the current device's stream
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    kcuda.gemm_cuda(x, *args, path=path, out=out)  # compile and plan outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # our own capture stream: torch.cuda.graph's default one is made once per process, on
                # whichever device was current then (cuda:0 if an earlier test captured there)
                with torch.cuda.graph(graph, stream=stream):
                    kcuda.gemm_cuda(x, *args, path=path, out=out)
                for _ in range(2):
                    x.copy_(torch.randn_like(x))
                    out.fill_(float("nan"))
                    graph.replay()
                    torch.cuda.synchronize(1)
                    assert not torch.isnan(out).any(), f"{path}: unwritten output elements"
                    err = _rel_err(out, F.linear(x.float(), w, layer.bias.float()))
                    assert err < REL_TOL[dtype], f"{path} M={m} in a graph: relative error {err:.2e}"


@pytest.mark.parametrize("current", [0, 1], ids=["current0", "current1"])
def test_router_on_the_second_gpu(current):
    # The router kernel's counter is per device and stream: one on cuda:1 must not be cuda:0's.
    from kbit_linear import _router_ops
    g = torch.Generator().manual_seed(current)
    with _current(current):
        for e in (128, 8):
            x = torch.randn(3, 2048, generator=g).to(SECOND, torch.bfloat16)
            w = (torch.randn(e, 2048, generator=g) * 0.02).to(SECOND, torch.bfloat16)
            logits, scores, index = torch.ops.kbit_linear.router_top_k(x, w, 2, True, True)
            assert logits.device == SECOND and index.device == SECOND
            ref_l = F.linear(x.float(), w.float())
            assert float((logits.float() - ref_l).abs().max()) < 2e-2 * float(ref_l.abs().max())
            want = _router_ops.router_top_k_reference(logits.float(), torch.eye(e, device=SECOND), 2, True, True)
            assert torch.equal(index, want[2]) and torch.allclose(scores, want[1], rtol=1e-5, atol=1e-6)
        assert torch.cuda.current_device() == current


_FIRST_USE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch import nn
    import kbit_linear
    from kbit_linear.backends import cuda as kcuda
    torch.manual_seed(0)
    dense = nn.Linear(1000, 1000).half()
    for index in (1, 0):  # the second GPU first; the current device stays 0 throughout
        dev = torch.device("cuda", index)
        layer = kbit_linear.KbitLinear.from_linear(dense.to(dev), bits=4)
        w = layer.dequantize()
        for path, m in (("decode", 3), ("decode", 12), ("fused", 40), ("fused-splitk", 64), ("dequant+cublas", 300)):
            x = torch.randn(m, 1000, dtype=torch.float16, device=dev)
            out = kcuda.gemm_cuda(x, layer.weight, layer.absmax, layer.codebook, layer.tensor_scale, 4, 1000,
                                  layer.bias, path=path)
            ref = F.linear(x.float(), w, layer.bias.float())
            err = float((out.float() - ref).norm() / ref.norm())
            assert err < 5e-3, (index, path, err)
        assert torch.cuda.current_device() == 0
    print("ok")
    """
)


@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no-pdl"])
def test_first_use_on_the_second_gpu_in_a_fresh_process(pdl):
    env = dict(os.environ, KBIT_LINEAR_PDL=pdl,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _FIRST_USE_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_llama_split_over_two_gpus_generates_the_one_gpu_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)

    def load(device_map):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), quantization_config=kbit_linear.KbitConfig(bits=4), dtype=torch.bfloat16, device_map=device_map)

    one = load({"": 0})
    split = load("auto")
    devices = {str(d) for d in split.hf_device_map.values()}
    assert {"0", "1"} <= devices, f"not split over both GPUs: {split.hf_device_map}"
    assert {m.weight.device.index for m in split.modules() if isinstance(m, kbit_linear.KbitLinear)} == {0, 1}
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    for batch in (ids[:1], ids):  # batch 1 takes the decode kernel, both take the fused one in prefill
        a = one.generate(batch.to("cuda:0"), max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(batch).to("cuda:0"))
        b = split.generate(batch.to("cuda:0"), max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(batch).to("cuda:0"))
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("current", [0, 1], ids=["current0", "current1"])
def test_hadamard_rotation_and_kv_attention_on_the_second_gpu(current):
    from kbit_linear import hadamard as hd
    from kbit_linear.backends.cuda import hadamard as khd

    torch.manual_seed(5)
    x = torch.randn(9, 576, device=SECOND, dtype=torch.float16)
    signs = hd.random_signs(576, seed=3, device=SECOND)
    with _current(current):
        y = khd.hadamard_rotate_cuda(x, signs)
        layer = kbit_linear.KbitLinear.from_linear(nn.Linear(576, 100).to(SECOND), bits=3, hadamard=True).half()
        out = layer(x)
    assert y.device == SECOND and out.device == SECOND
    torch.testing.assert_close(y.double(), hd.rotate(x.double(), signs), atol=2e-2, rtol=2e-3)
    ref = F.linear(x.float(), layer.dequantize(), layer.bias.float())
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    # the KV-cache decode attention there too (an all-8-bit cache: no key ranges needed)
    from kbit_linear.backends.cuda import kv_attention as kkv
    from kbit_linear.kv_format import TIERS, KVBucket, bucket_attention, quantize_tokens

    batch, heads, d, length = 2, 2, 128, 300
    k, v = torch.randn(batch, length, heads, d), torch.randn(batch, length, heads, d)
    rows, pos = torch.nonzero(torch.ones(batch, length, dtype=torch.bool), as_tuple=True)
    buckets = [KVBucket.empty(t, batch, heads, d) for t in TIERS[:3]]
    buckets.append(quantize_tokens(k[rows, pos], v[rows, pos], 8, rows, pos, batch))
    q = torch.randn(batch, 8, 1, d)
    ref, ref_mass = bucket_attention(q, buckets, None, None, 64, length, None, d**-0.5)
    on_second = [KVBucket(bk.bits, **{n: t.to(SECOND) for n, t in bk.tensors().items()}) for bk in buckets]
    tier = torch.full((batch, length), 8, dtype=torch.int8, device=SECOND)
    with _current(current):
        got, mass = kkv.kv_decode_attention_cuda(q.to(SECOND), on_second, None, None, 64, length, tier, None, d**-0.5)
    assert got.device == SECOND
    assert float((got.cpu() - ref).abs().max() / ref.abs().max()) < 1e-2  # fp16 operands, as test_kv_attention_cuda
    torch.testing.assert_close(mass.cpu(), ref_mass, atol=2e-3 * 8, rtol=2e-2)


@pytest.mark.parametrize("current", [0, 1])
def test_calibrated_rounding_on_the_second_gpu(monkeypatch: pytest.MonkeyPatch, graph_replays: list[int],
                                              current: int) -> None:
    # The sweep replays CUDA graphs only on the current GPU (current 1 here); on another one it
    # runs eagerly. Either way the result equals the eager sweep on the same GPU.
    from kbit_linear import calibration

    g = torch.Generator(device=SECOND).manual_seed(current)
    k = 3 * calibration.LAZY_BLOCK + 40
    w = torch.randn(300, k, device=SECOND, generator=g)
    x = torch.randn(2 * k, k, device=SECOND, generator=g) * torch.rand(1, k, device=SECOND, generator=g)
    h = x.T @ x
    with _current(current):
        monkeypatch.setattr(calibration, "SWEEP_CUDA_GRAPHS", False)
        eager = calibration.gptq_quantize_blocks(w, h, 4, scale_search=True)
        monkeypatch.setattr(calibration, "SWEEP_CUDA_GRAPHS", True)
        graphed = calibration.gptq_quantize_blocks(w, h, 4, scale_search=True)
    assert len(graph_replays) == (3 if current == 1 else 0)
    for a, b in zip(eager, graphed):
        assert a.device == SECOND and torch.equal(a, b)
