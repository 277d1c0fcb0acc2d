"""The randomized Hadamard rotation (``kbit_linear/hadamard.py``) and the layers, checkpoints and
model conversion that use it (CPU)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from torch import nn

import kbit_linear
from kbit_linear import hadamard as hd
from kbit_linear import serialization as ser
from kbit_linear.quantizer import quantize_weight
from kbit_linear.serialization import CheckpointError, load_into, load_quantized, save_quantized


def _rotation(signs: torch.Tensor) -> torch.Tensor:
    """R = diag(signs) blockdiag(H, H, ...) in float64, built the slow way."""
    k = signs.numel()
    b = hd.hadamard_block(k)
    h = hd.hadamard_matrix(b, torch.float64)
    return torch.diag(signs.double()) @ torch.block_diag(*[h] * (k // b))


def test_block_is_the_largest_power_of_two_dividing_in_features_up_to_256():
    assert [hd.hadamard_block(k) for k in (1, 97, 100, 192, 576, 640, 1536, 4096, 14336)] == [1, 1, 4, 64, 64, 128, 256, 256, 256]
    for bad in (0, -64, 2.0, True):
        with pytest.raises(ValueError, match="in_features"):
            hd.hadamard_block(bad)


@pytest.mark.parametrize("k", [1, 96, 100, 576, 1024])
def test_rotate_is_multiplication_by_the_orthogonal_block_rotation(k):
    g = torch.Generator().manual_seed(k)
    signs = hd.random_signs(k, seed=k)
    r = _rotation(signs)
    torch.testing.assert_close(r @ r.T, torch.eye(k, dtype=torch.float64))
    x = torch.randn(3, 5, k, generator=g, dtype=torch.float64)
    torch.testing.assert_close(hd.rotate(x, signs), x @ r)
    torch.testing.assert_close(hd.unrotate(hd.rotate(x, signs), signs), x)
    a = x.reshape(-1, k).T @ x.reshape(-1, k)
    torch.testing.assert_close(hd.rotate_hessian(a, signs), r.T @ a @ r)


def test_signs_are_deterministic_and_checked():
    a, b = hd.random_signs(300, seed=5), hd.random_signs(300, seed=5)
    assert torch.equal(a, b) and a.dtype == torch.int8 and set(a.tolist()) == {-1, 1}
    assert not torch.equal(a, hd.random_signs(300, seed=6))
    with pytest.raises(TypeError, match="seed"):
        hd.random_signs(300, seed=1.5)
    with pytest.raises(TypeError, match="hadamard_signs"):
        hd.check_signs(a.float(), 300)
    with pytest.raises(ValueError, match=r"hadamard_signs must have shape \(64,\)"):
        hd.check_signs(a, 64)
    with pytest.raises(ValueError, match="only"):
        hd.check_signs(torch.zeros(300, dtype=torch.int8), 300)
    with pytest.raises(ValueError, match="power of two"):
        hd.hadamard_matrix(48)


def _outlier_linear(k: int = 512, n: int = 96, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.normal_()
        linear.weight[:, 7] *= 25  # an outlier input channel, as real layers have
    return linear


def test_rotated_layer_computes_x_times_its_dequantized_weight_and_rounds_better_with_outliers():
    linear = _outlier_linear()
    rotated = kbit_linear.KbitLinear.from_linear(linear, bits=3, hadamard=True, scale_search=True)
    plain = kbit_linear.KbitLinear.from_linear(linear, bits=3, scale_search=True)
    assert rotated.hadamard_signs is not None and "hadamard=True" in repr(rotated)
    x = torch.randn(4, 7, 512)
    torch.testing.assert_close(rotated(x), x @ rotated.dequantize().T + linear.bias, atol=1e-4, rtol=1e-4)
    err = [float((q.dequantize() - linear.weight).norm() / linear.weight.norm()) for q in (rotated, plain)]
    assert err[0] < 0.8 * err[1], err
    # the stored weight is W R: read as a plain layer and rotated back, it is dequantize()
    stored = kbit_linear.KbitLinear(512, 96, bits=3)
    stored.load_state_dict({k: v for k, v in rotated.state_dict().items() if k != "hadamard_signs"})
    torch.testing.assert_close(hd.unrotate(stored.dequantize(), rotated.hadamard_signs), rotated.dequantize())
    assert (stored.dequantize() - rotated.dequantize()).abs().max() > 0.1


def test_quantize_weight_checks_the_signs_and_rotates_the_hessian():
    w = torch.randn(40, 64)
    with pytest.raises(ValueError, match="hadamard_signs"):
        quantize_weight(w, 3, hadamard_signs=torch.ones(32, dtype=torch.int8))
    with pytest.raises(TypeError, match="hadamard_signs"):
        quantize_weight(w, 3, hadamard_signs=torch.ones(64))
    signs = hd.random_signs(64, seed=2)
    x = torch.randn(256, 64)
    x[:, 3] *= 10
    # calibrated rounding of the rotated weight with the rotated inputs' Hessian beats it without data
    h = x.T @ x
    data_free = quantize_weight(w, 3, hadamard_signs=signs)
    calibrated = quantize_weight(w, 3, hadamard_signs=signs, hessian=h)

    def out_err(q):
        layer = kbit_linear.KbitLinear(64, 40, bias=False, bits=3, hadamard=True)
        layer.load_state_dict({"weight": q.packed, "absmax": q.absmax, "codebook": q.codebook, "tensor_scale": q.tensor_scale,
                               "hadamard_signs": signs})
        return float((layer(x) - x @ w.T).norm())

    assert out_err(calibrated) < out_err(data_free)


def test_state_dicts_of_rotated_and_plain_layers_do_not_mix():
    rotated = kbit_linear.KbitLinear.from_linear(_outlier_linear(), bits=4, hadamard=True)
    sd = rotated.state_dict()
    assert sd["hadamard_signs"].dtype == torch.int8
    fresh = kbit_linear.KbitLinear(512, 96, bits=4, hadamard=True)
    fresh.load_state_dict(sd)
    x = torch.randn(2, 512)
    assert torch.equal(fresh(x), rotated(x))
    with pytest.raises(RuntimeError, match="hadamard_signs"):
        kbit_linear.KbitLinear(512, 96, bits=4).load_state_dict(sd)
    with pytest.raises(RuntimeError, match="hadamard_signs"):
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "hadamard_signs"})
    with pytest.raises(RuntimeError, match="hadamard_signs"):
        fresh.load_state_dict({**sd, "hadamard_signs": sd["hadamard_signs"].float()})


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(192, 100), nn.GELU(), nn.Linear(100, 64))


def test_quantize_model_save_and_load_into_a_fresh_model(tmp_path):
    model = _model()
    summary = kbit_linear.quantize_model(model, bits=3, skip=None, hadamard=True, progress=False)
    assert len(summary.converted) == 2 and all(m.hadamard_signs is not None for m in model if isinstance(m, kbit_linear.KbitLinear))
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    with safetensors.safe_open(str(path), "pt") as f:
        header = dict(f.metadata())
    assert header[ser._KEY_VERSION] == ser.HADAMARD_FORMAT_VERSION
    assert all(meta["hadamard"] is True for meta in json.loads(header[ser._KEY_LAYERS]).values())
    fresh = _model()
    load_into(fresh, path)
    x = torch.randn(5, 192)
    assert torch.equal(fresh(x), model(x))
    # a plain model's checkpoint keeps version 1
    plain = _model()
    kbit_linear.quantize_model(plain, bits=3, skip=None, progress=False)
    save_quantized(plain, tmp_path / "p.safetensors")
    with safetensors.safe_open(str(tmp_path / "p.safetensors"), "pt") as f:
        assert f.metadata()[ser._KEY_VERSION] == ser.FORMAT_VERSION
    with pytest.raises(TypeError, match="hadamard"):
        kbit_linear.quantize_model(_model(), bits=3, hadamard="yes", progress=False)


def _forge(path, edit) -> None:
    with safetensors.safe_open(str(path), "pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    edit(tensors, header)
    header[ser._KEY_SHA256] = json.dumps({k: ser._sha256(t) for k, t in tensors.items()})
    header[ser._KEY_HEADER_SHA256] = ser._header_digest(header)
    safetensors.torch.save_file(tensors, str(path), metadata=header)


def _zero_sign(tensors, header):
    tensors["0.hadamard_signs"] = tensors["0.hadamard_signs"].clone()
    tensors["0.hadamard_signs"][3] = 0


def _drop_flag(tensors, header):
    layers = json.loads(header[ser._KEY_LAYERS])
    del layers["0"]["hadamard"]
    header[ser._KEY_LAYERS] = json.dumps(layers)


def _drop_signs(tensors, header):
    del tensors["2.hadamard_signs"]


def _version_one(tensors, header):
    header[ser._KEY_VERSION] = ser.FORMAT_VERSION


@pytest.mark.parametrize("edit,match", [
    (_zero_sign, r"layer '0': 'hadamard_signs' must hold only \+1 and -1"),
    (_drop_flag, r"layer '0': has a 'hadamard_signs' tensor but the metadata does not say"),
    (_drop_signs, r"layer '2': tensor 'hadamard_signs' is missing"),
    (_version_one, r"version '1' file cannot hold Hadamard-rotated layers"),
], ids=["zero-sign", "flag-dropped", "signs-dropped", "version-1"])
def test_corrupted_rotated_checkpoints_fail_loudly(tmp_path, edit, match):
    model = _model()
    kbit_linear.quantize_model(model, bits=3, skip=None, hadamard=True, progress=False)
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    _forge(path, edit)
    with pytest.raises(CheckpointError, match=match):
        load_quantized(path)


def test_load_into_refuses_a_rotated_checkpoint_for_a_plain_layer(tmp_path):
    model = _model()
    kbit_linear.quantize_model(model, bits=3, skip=None, hadamard=True, progress=False)
    save_quantized(model, tmp_path / "m.safetensors")
    plain = _model()
    kbit_linear.quantize_model(plain, bits=3, skip=None, progress=False)
    with pytest.raises(CheckpointError, match=r"\(bits, in, out, bias, hadamard\)=\(3, 192, 100, True, True\) in the checkpoint"):
        load_into(plain, tmp_path / "m.safetensors")


def test_each_layer_gets_its_own_signs_and_the_same_ones_every_time():
    def convert() -> nn.Module:
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        kbit_linear.quantize_model(model, bits=3, skip=None, hadamard=True, progress=False)
        return model

    a, b = convert(), convert()
    assert not torch.equal(a[0].hadamard_signs, a[1].hadamard_signs)
    assert all(torch.equal(x.hadamard_signs, y.hadamard_signs) for x, y in zip(a, b))
    assert torch.equal(a[1].hadamard_signs, hd.random_signs(64, hd.layer_seed("1")))


def _rotated_error(w: torch.Tensor, signs: torch.Tensor, bits: int) -> float:
    rotated = hd.rotate(w, signs)
    q = quantize_weight(rotated, bits)
    qw = kbit_linear.format.KbitWeight(q.packed, q.absmax, q.codebook, q.tensor_scale, bits, *w.shape)
    return float((kbit_linear.format.dequantize(qw, torch.float32) - rotated).square().sum())


def test_sign_search_keeps_the_candidate_with_the_least_error():
    from kbit_linear.quantizer import hadamard_signs_for

    torch.manual_seed(0)
    w = torch.randn(96, 256)
    w[:, :3] *= 30.0  # outlier columns: the draws differ
    errors = [_rotated_error(w, hd.random_signs(256, 7 + i), 3) for i in range(6)]
    chosen = hadamard_signs_for(w, 3, seed=7, candidates=6)
    assert torch.equal(chosen, hd.random_signs(256, 7 + min(range(6), key=errors.__getitem__)))
    assert torch.equal(hadamard_signs_for(w, 3, seed=7), hd.random_signs(256, 7))  # one candidate: no search
    layer = kbit_linear.KbitLinear.from_linear(nn.Linear(256, 96), bits=3, hadamard=True, hadamard_seed=7, hadamard_search=6)
    assert layer.hadamard_signs.shape == (256,)
    with pytest.raises(ValueError, match="2-D"):
        hadamard_signs_for(w[0], 3)
    with pytest.raises(ValueError, match="bits"):
        hadamard_signs_for(w, 9)
    for bad, err in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="hadamard_search"):
            hadamard_signs_for(w, 3, candidates=bad)
        with pytest.raises(err, match="hadamard_search"):
            kbit_linear.quantize_model(nn.Sequential(nn.Linear(64, 64)), hadamard=True, hadamard_search=bad, skip=None,
                                       progress=False)
    # a search without the rotation does nothing: said at every entry point, not refused (saved configs load)
    with pytest.warns(UserWarning, match="hadamard_search=4 has no effect without hadamard=True"):
        kbit_linear.KbitLinear.from_linear(nn.Linear(64, 32), bits=3, hadamard_search=4)
    with pytest.warns(UserWarning, match="hadamard_search=4 has no effect"):
        kbit_linear.quantize_model(nn.Sequential(nn.Linear(64, 64)), hadamard_search=4, skip=None, progress=False)
    with pytest.warns(UserWarning, match="hadamard_search=4 has no effect"):
        kbit_linear.KbitConfig(bits=3, hadamard_search=4)


def test_quantize_model_sign_search_lowers_each_layers_error():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))
    with torch.no_grad():
        net[0].weight[:, :2] *= 25.0
    dense = [net[0].weight.detach().clone(), net[2].weight.detach().clone()]
    plain, searched = (kbit_linear.quantize_model(copy_net, bits=3, hadamard=True, hadamard_search=n, skip=None, progress=False)
                       and copy_net for copy_net, n in ((_copy(net), 1), (_copy(net), 8)))
    for i, w in zip((0, 2), dense):
        err = [float((m[i].dequantize(torch.float32) - w).square().sum()) for m in (plain, searched)]
        assert err[1] <= err[0] * (1 + 1e-6)
    x = torch.randn(4, 256)
    assert torch.isfinite(searched(x)).all()


def _copy(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net)


def test_bad_operands_are_named() -> None:
    signs = hd.random_signs(64)
    with pytest.raises(ValueError, match="signs must have shape"):
        hd.rotate(torch.randn(2, 64), torch.ones(1, dtype=torch.int8))  # one sign would broadcast
    with pytest.raises(TypeError, match="signs must be an int8"):
        hd.unrotate(torch.randn(2, 64), signs.float())
    with pytest.raises(TypeError, match="t must be a floating-point"):
        hd.rotate(torch.arange(64).reshape(1, 64), signs)  # integer rows would round to zeros
    with pytest.raises(TypeError, match="dtype"):
        hd.hadamard_matrix(4, torch.int32)
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        hd.random_signs(64, 2**64)
    with pytest.raises(ValueError, match="hessian must be a square 2-D"):
        hd.rotate_hessian(torch.randn(64), signs)  # failed with an IndexError
    with pytest.raises(ValueError, match="hessian must be a square 2-D"):
        hd.rotate_hessian(torch.randn(32, 64), signs)
    with pytest.raises(ValueError, match="hessian must be a square 2-D"):
        hd.rotate_hessian(torch.randn(2, 64, 64), signs)
    with pytest.raises(TypeError, match="hessian must be a floating-point"):
        hd.rotate_hessian(torch.eye(64, dtype=torch.int64), signs)


def test_a_matrix_first_built_in_inference_mode_serves_autograd_later(monkeypatch) -> None:
    monkeypatch.setattr(hd, "_MATRICES", {})  # the first use of (64, float32, cpu) is the one below
    signs = hd.random_signs(64, 3)
    with torch.inference_mode():
        hd.rotate(torch.randn(2, 64), signs)  # e.g. an evaluation or generate run first
    assert not hd.cached_matrix(64, torch.float32, torch.device("cpu")).is_inference()
    x = torch.randn(2, 64, requires_grad=True)
    hd.unrotate(hd.rotate(x, signs), signs).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2, 64))  # R R^T = I
