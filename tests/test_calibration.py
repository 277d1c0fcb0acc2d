"""Calibrated (GPTQ-style) rounding: the reference quantizer, the Hessian collection, quantize_model(calibration=...).

Everything runs on the CPU in a few seconds: small random layers with correlated inputs and a
tiny random Llama.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import kbit_linear
from kbit_linear import format as fmt
from kbit_linear.calibration import (
    Calibration,
    HessianAccumulator,
    calibrate_model,
    default_calibration_text,
    gptq_quantize_blocks,
)
from kbit_linear.tools.evaluation import perplexity_text


def _correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated features of unequal size, as activations are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 2 * torch.randn(k, k, generator=g) / k**0.5
    return (torch.randn(tokens, k, generator=g) @ mix) * torch.linspace(0.2, 3.0, k)


def _dequantized(packed: torch.Tensor, codes: torch.Tensor, ts: torch.Tensor, bits: int, k: int, codebook=None) -> torch.Tensor:
    cb = fmt.create_normal_float_codebook(bits) if codebook is None else codebook
    return fmt.dequantize_blockwise(packed, codes, cb, ts, bits, k)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("shape", [(48, 96), (40, 200)], ids=["aligned", "ragged-k"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_output_is_a_valid_format_that_the_reference_dequantizes(bits, shape, act_order):
    n, k = shape
    torch.manual_seed(bits)
    w = torch.randn(n, k) * 0.1
    x = _correlated_inputs(512, k)
    packed, codes, ts = gptq_quantize_blocks(w, x.T @ x, bits, scale_search=True, act_order=act_order)
    nblk = -(-k // 32)
    assert packed.shape == (n, nblk, bits) and packed.dtype == torch.int32
    assert codes.shape == (n, nblk) and codes.dtype == torch.uint8
    idx = fmt.unpack_bitplanes(packed, bits)
    assert int(idx.max()) < 1 << bits
    # the tiled form passes the format's checks and round-trips
    tiled = fmt.tile_blocks(packed, codes, bits)
    qw = fmt.KbitWeight(*tiled, fmt.create_normal_float_codebook(bits), ts, bits, n, k)
    w_hat = fmt.dequantize(qw)
    assert w_hat.shape == (n, k) and bool(torch.isfinite(w_hat).all())
    torch.testing.assert_close(w_hat, _dequantized(packed, codes, ts, bits, k))
    # every scale is a real code at or below the tensor's range, and zero-padding stays at the nearest-zero index
    assert bool((fmt.decode_e4m4(codes) <= fmt.E4M4_MAX).all())
    if k % 32:
        pad = idx.reshape(n, -1)[:, k:]
        assert bool((pad == pad[0, 0]).all())


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("scale_search", [False, True], ids=["absmax", "scale-search"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_output_error_is_lower_than_round_to_nearest(bits, scale_search, act_order):
    torch.manual_seed(0)
    n, k = 96, 256
    w = torch.randn(n, k) * 0.05
    x = _correlated_inputs(2048, k)
    cb = fmt.create_normal_float_codebook(bits)
    ts = fmt.compute_tensor_scale(w)
    packed, codes, _ = gptq_quantize_blocks(w, x.T @ x, bits, scale_search=scale_search, act_order=act_order)
    rtn_codes = fmt.search_block_codes(w, cb, ts, fmt.SCALE_SEARCH_CANDIDATES if scale_search else 1)
    rtn = _dequantized(fmt.quantize_with_codes(w, bits, cb, ts, rtn_codes), rtn_codes, ts, bits, k)
    gptq = _dequantized(packed, codes, ts, bits, k)
    err = lambda q: float((x @ (w - q).T).norm())  # noqa: E731
    assert err(gptq) < 0.93 * err(rtn)


@pytest.mark.parametrize("scale", [1.0, 37.5], ids=["identity", "scaled-identity"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_identity_hessian_gives_round_to_nearest(scale, act_order):
    torch.manual_seed(1)
    w = torch.randn(64, 160)
    for bits in (2, 3, 4, 5):
        packed, codes, ts = gptq_quantize_blocks(w, scale * torch.eye(160), bits, act_order=act_order)
        ref_packed, ref_codes, ref_ts = fmt.quantize_blockwise(w, bits)
        assert torch.equal(codes, ref_codes) and torch.equal(packed, ref_packed) and torch.equal(ts, ref_ts)


def test_a_diagonal_hessian_in_activation_order_gives_round_to_nearest():
    # no correlation, no error feedback, whatever the order: the sweep order must not leak into the result
    torch.manual_seed(4)
    w = torch.randn(48, 200)
    diag = torch.rand(200) * 10 + 0.1
    for bits in (3, 4):
        packed, codes, _ = gptq_quantize_blocks(w, torch.diag(diag), bits, act_order=True)
        ref_packed, ref_codes, _ = fmt.quantize_blockwise(w, bits)
        assert torch.equal(codes, ref_codes) and torch.equal(packed, ref_packed)


def _act_order_reference(w: torch.Tensor, h: torch.Tensor, bits: int, damp: float) -> torch.Tensor:
    """GPTQ in activation order, written plainly (float64, one column at a time, no lazy batches):
    block scales from ``w`` first, columns by descending ``H[j, j]``, each error spread over the
    columns after it in that order. Returns the dequantized weight in in-feature order."""
    n, k = w.shape
    cb, ts = fmt.create_normal_float_codebook(bits), fmt.compute_tensor_scale(w)
    scales = fmt.decode_e4m4(fmt.search_block_codes(w, cb, ts, 1)).double() * float(ts)
    order = torch.argsort(h.diagonal(), descending=True, stable=True)
    hp = h[order][:, order].double()
    hp += damp * hp.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(hp), upper=True)
    wp = w[:, order].double().clone()
    q = torch.zeros_like(wp)
    for j in range(k):
        s = scales[:, int(order[j]) // 32]
        qj = cb.double()[(wp[:, j:j + 1] / s[:, None] - cb.double()).abs().argmin(1)] * s
        e = (wp[:, j] - qj) / u[j, j]
        wp[:, j:] -= e[:, None] * u[j, j:]
        q[:, j] = qj
    out = torch.empty_like(q)
    out[:, order] = q
    return out


def test_activation_order_matches_a_plain_column_by_column_sweep():
    torch.manual_seed(5)
    n, k = 40, 160
    w = torch.randn(n, k) * 0.05
    x = _correlated_inputs(1024, k, seed=3)
    h = x.T @ x
    packed, codes, ts = gptq_quantize_blocks(w, h, 4, act_order=True, lazy_block=64)
    got = _dequantized(packed, codes, ts, 4, k)
    ref = _act_order_reference(w, h, 4, 0.01)
    same = float((torch.isclose(got.double(), ref, rtol=1e-4, atol=1e-7)).float().mean())
    assert same > 0.98, same  # float32 against float64: a few ties may round the other way
    err = lambda q: float((x.double() @ (w.double() - q.double()).T).norm())  # noqa: E731
    assert err(got) < 1.02 * err(ref)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_any_codebook_and_dead_inputs(act_order):
    torch.manual_seed(2)
    cb = torch.tensor([-1.0, -0.4, -0.1, 0.0, 0.1, 0.3, 0.6, 1.0])
    w = torch.randn(32, 64)
    x = _correlated_inputs(256, 64)
    x[:, 5] = 0.0  # an input that is never active
    packed, codes, ts = gptq_quantize_blocks(w, x.T @ x, 3, cb, act_order=act_order)
    w_hat = _dequantized(packed, codes, ts, 3, 64, cb)
    assert bool((w_hat[:, 5] == 0).all())  # the dead column went to zero, which this codebook has
    levels = (w_hat / fmt.decode_e4m4(codes).repeat_interleave(32, 1)[:, :64] / ts).unique()
    assert all(bool(torch.isclose(cb, v, atol=1e-5).any()) for v in levels)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(hessian=torch.eye(10)), ValueError, "hessian must have shape"),
        (dict(hessian=torch.eye(64, dtype=torch.int64)), TypeError, "hessian"),
        (dict(hessian=torch.full((64, 64), float("nan"))), ValueError, "hessian contains NaN"),
        (dict(bits=6), ValueError, "bits"),
        (dict(damp=0.0), ValueError, "damp"),
        (dict(damp="x"), TypeError, "damp"),
        (dict(lazy_block=48), ValueError, "lazy_block"),
        (dict(scale_search=1), TypeError, "scale_search"),
        (dict(act_order=1), TypeError, "act_order"),
        (dict(hessian=50 * torch.ones(64, 64) - 49 * torch.eye(64)), ValueError, "positive definite"),
    ],
    ids=["hessian-shape", "hessian-dtype", "hessian-nan", "bits", "damp-zero", "damp-type", "lazy-block", "scale-search",
         "act-order", "indefinite"],
)
def test_bad_arguments_are_named(kwargs, error, match):
    args = dict(weight=torch.randn(8, 64), hessian=torch.eye(64), bits=3) | kwargs
    with pytest.raises(error, match=match):
        gptq_quantize_blocks(**args)


# ---------------------------------------------------------------------------------------
# calibration data
# ---------------------------------------------------------------------------------------


def test_default_text_is_disjoint_from_the_evaluation_text():
    text = default_calibration_text()
    assert len(text) > 200_000
    evaluation = perplexity_text()
    paragraphs = [p for p in text.split("\n\n") if len(p) > 200]
    assert len(paragraphs) > 100
    assert not [p for p in paragraphs if p in evaluation]


def test_calibration_checks_its_arguments():
    with pytest.raises(ValueError, match="tokenizer"):
        Calibration()
    with pytest.raises(TypeError, match="tokens"):
        Calibration(tokens=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="tokens must be 2-D"):
        Calibration(tokens=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="not both"):
        Calibration(tokens=torch.zeros(2, 8, dtype=torch.int64), text="x")
    with pytest.raises(ValueError, match="num_sequences"):
        Calibration(tokens=torch.zeros(2, 8, dtype=torch.int64), num_sequences=0)
    with pytest.raises(ValueError, match="lazy_block"):
        Calibration(tokens=torch.zeros(2, 8, dtype=torch.int64), lazy_block=100)
    with pytest.raises(TypeError, match="act_order"):
        Calibration(tokens=torch.zeros(2, 8, dtype=torch.int64), act_order="yes")
    batches = Calibration(tokens=torch.arange(40).reshape(5, 8), batch_size=2).batches()
    assert [b.shape[0] for b in batches] == [2, 2, 1]


def test_text_is_tokenized_into_windows():
    tok = lambda text, **kw: {"input_ids": [ord(c) % 50 for c in text]}  # noqa: E731
    ids = Calibration(tokenizer=tok, text="abc " * 100, num_sequences=3, seq_len=16).token_ids()
    assert ids.shape == (3, 16) and ids.dtype == torch.int64
    with pytest.raises(ValueError, match="fewer than"):
        Calibration(tokenizer=tok, text="short", num_sequences=3, seq_len=16).token_ids()
    assert Calibration(tokenizer=tok, num_sequences=2, seq_len=32).token_ids().shape == (2, 32)  # default text


# ---------------------------------------------------------------------------------------
# the model-level driver
# ---------------------------------------------------------------------------------------


def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_block_by_block_run_sees_what_the_full_model_sees():
    model = _llama()
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    batches = list(torch.randint(0, 128, (4, 12)).split(2))
    with HessianAccumulator({n: model.get_submodule(n) for n in names}) as full:
        for b in batches:
            full.new_pass()
            with torch.no_grad():
                model(b, use_cache=False)
    seen = {}
    calibrate_model(model, names, batches, lambda name, h: seen.__setitem__(name, h), progress=False)
    assert list(seen) == names  # blocks in order, lm_head (outside the blocks) last
    for name in names:
        torch.testing.assert_close(seen[name], full.hessian(name), rtol=1e-4, atol=1e-5)
    # q/k/v share their input: one Hessian
    assert torch.equal(seen["model.layers.0.self_attn.q_proj"], seen["model.layers.0.self_attn.k_proj"])


def test_calibration_tokens_outside_the_vocabulary_are_refused_before_any_layer_changes():
    model = _llama()
    tokens = torch.randint(0, 128, (4, 16)) + 1000
    with pytest.raises(ValueError, match=r"calibration tokens must be ids in \[0, 128\) .* got values from 10"):
        kbit_linear.quantize_model(model, bits=3, calibration=Calibration(tokens=tokens), progress=False)
    assert not any(isinstance(m, kbit_linear.KbitLinear) for m in model.modules())


def test_quantize_model_with_calibration_converts_every_layer_and_lowers_layer_error():
    model = _llama()
    dense = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (8, 16))
    summary = kbit_linear.quantize_model(model, bits=3, calibration=Calibration(tokens=tokens, batch_size=4), progress=False)
    assert len(summary.converted) == 21 and "lm_head" in summary.skipped
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, kbit_linear.KbitLinear)
    with torch.no_grad():
        out = model(tokens[:2]).logits
    assert bool(torch.isfinite(out).all())
    # the first block's inputs are the same for both: its layers' output error must not grow
    rtn = copy.deepcopy(dense)
    kbit_linear.quantize_model(rtn, bits=3, progress=False)
    x = []
    handle = dense.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: x.append(a[0]))
    with torch.no_grad():
        dense(tokens, use_cache=False)
    handle.remove()
    x = x[0].reshape(-1, 64)
    w = dense.model.layers[0].self_attn.q_proj.weight
    err = lambda m: float((x @ (w - m.model.layers[0].self_attn.q_proj.dequantize(torch.float32)).T).norm())  # noqa: E731
    assert err(model) < err(rtn)


def test_the_sweep_order_reaches_the_quantizer_from_every_entry_point():
    # quantize_weight, KbitLinear.from_linear and quantize_model(calibration=...) pass act_order
    # through (activation order by default); the two orders give different codes here
    from kbit_linear.calibration import DEFAULT_ACT_ORDER
    from kbit_linear.quantizer import quantize_weight

    assert DEFAULT_ACT_ORDER is True and Calibration(tokens=torch.zeros(1, 4, dtype=torch.int64)).act_order is True
    torch.manual_seed(6)
    w = torch.randn(64, 128) * 0.05
    x = _correlated_inputs(512, 128, seed=6)
    h = x.T @ x
    direct = {o: gptq_quantize_blocks(w, h, 3, act_order=o) for o in (False, True)}
    assert not torch.equal(direct[False][0], direct[True][0])
    for o in (False, True):
        tiled = fmt.tile_blocks(direct[o][0], direct[o][1], 3)
        q = quantize_weight(w, 3, None, hessian=h, act_order=o)
        assert torch.equal(q.packed, tiled[0]) and torch.equal(q.absmax, tiled[1])
        linear = nn.Linear(128, 64, bias=False)
        linear.weight.data.copy_(w)
        layer = kbit_linear.KbitLinear.from_linear(linear, 3, hessian=h, act_order=o)
        assert torch.equal(layer.weight, q.packed) and torch.equal(layer.absmax, q.absmax)
    assert torch.equal(quantize_weight(w, 3, None, hessian=h).packed, fmt.tile_blocks(*direct[True][:2], 3)[0])
    with pytest.raises(TypeError, match="act_order"):
        quantize_weight(w, 3, None, act_order="yes")
    # quantize_model: the Calibration's order decides
    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    models = {}
    for o in (False, True):
        models[o] = _llama()
        kbit_linear.quantize_model(models[o], bits=3, calibration=Calibration(tokens=tokens, batch_size=4, act_order=o),
                                   progress=False)
    a = models[False].model.layers[0].mlp.down_proj.weight
    b = models[True].model.layers[0].mlp.down_proj.weight
    assert not torch.equal(a, b)


def test_quantize_model_refuses_bad_calibration():
    model = _llama()
    with pytest.raises(TypeError, match="calibration"):
        kbit_linear.quantize_model(model, bits=3, calibration="some text")
    with pytest.raises(ValueError, match="device"):
        kbit_linear.quantize_model(model, bits=3, calibration=torch.zeros(2, 8, dtype=torch.int64), device="cpu")
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(model.config)
    with pytest.raises(ValueError, match="meta"):
        kbit_linear.quantize_model(meta, bits=3, calibration=torch.zeros(2, 8, dtype=torch.int64))
    assert all(type(m) is not kbit_linear.KbitLinear for m in model.modules())  # nothing was touched


def test_a_model_without_blocks_is_calibrated_in_one_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    summary = kbit_linear.quantize_model(model, bits=4, skip=(), calibration=torch.randint(0, 50, (4, 8)), progress=False)
    assert summary.converted == ["1", "3"]


def test_a_zero_hessian_rounds_to_nearest_with_a_warning():
    # no input signal at all: the columns are not told apart, but the weight must not be erased
    torch.manual_seed(7)
    w = torch.randn(16, 64)
    for act_order in (False, True):
        with pytest.warns(UserWarning, match="no input signal"):
            zero = gptq_quantize_blocks(w, torch.zeros(64, 64), 4, act_order=act_order)
        rtn = gptq_quantize_blocks(w, torch.eye(64), 4, act_order=act_order)
        assert all(torch.equal(a, b) for a, b in zip(zero, rtn))
        assert float(_dequantized(*zero, 4, 64).abs().max()) > 0


# ---------------------------------------------------------------------------------------
# the driver's contract: eval mode, checked arguments, every layer run before any changes
# ---------------------------------------------------------------------------------------


def test_calibration_runs_in_eval_mode_and_restores_the_training_flags():
    # a model built from a config is in train mode: dropout made the Hessians random
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    weights = []
    for seed in (1, 2):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3)
        model = transformers.LlamaForCausalLM(cfg)
        model.model.norm.eval()  # one module already in eval mode: it stays so
        torch.manual_seed(seed)
        kbit_linear.quantize_model(model, bits=3, calibration=Calibration(tokens=tokens, batch_size=2), progress=False)
        layer = model.model.layers[1].mlp.down_proj
        assert isinstance(layer, kbit_linear.KbitLinear) and layer.training  # the swapped-in layer: the old one's flag
        assert not model.model.norm.training
        assert all(m.training for n, m in model.named_modules() if n != "model.norm")
        weights.append(layer.weight.clone())
    assert torch.equal(weights[0], weights[1])


def test_training_flags_are_restored_when_calibration_fails():
    model = _llama().train()
    with pytest.raises(RuntimeError, match="boom"):
        calibrate_model(model, ["model.layers.0.mlp.up_proj"], [torch.randint(0, 128, (2, 8))],
                        lambda n, h: (_ for _ in ()).throw(RuntimeError("boom")), progress=False)
    assert all(m.training for m in model.modules())


class _Net(nn.Module):
    """Two blocks and a head; ``extra`` layers (in block 1 and outside the blocks) run only on a
    batch whose first token is 0 (as a routed expert), and ``unused`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(32, 32), "extra": nn.Linear(32, 32)}) for _ in range(2))
        self.head = nn.Linear(32, 50)
        self.head_extra = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)
        for i, block in enumerate(self.layers):
            block.forward = self._block(block, i)

    @staticmethod
    def _block(block: nn.ModuleDict, i: int):
        def forward(x: torch.Tensor, extra: bool = False) -> torch.Tensor:
            x = x + torch.relu(block["fc"](x))
            return x + block["extra"](x) if extra and i == 1 else x

        return forward

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        extra = bool(ids[0, 0] == 0)
        x = self.embed(ids)
        for block in self.layers:
            x = block(x, extra=extra)
        return self.head(self.head_extra(x) if extra else x)


def test_layers_that_run_on_some_batch_only_are_calibrated():
    torch.manual_seed(0)
    model = _Net().eval()
    names = ["layers.0.fc", "layers.1.fc", "layers.1.extra", "head_extra", "head"]
    first = torch.randint(1, 50, (2, 8))
    second = torch.randint(1, 50, (2, 8))
    second[0, 0] = 0  # the extra layers run on this batch only
    seen = []
    calibrate_model(model, names, [first, second], lambda n, h: seen.append(n), progress=False)
    assert sorted(seen) == sorted(names)


def test_layers_that_never_run_are_named_before_any_layer_changes():
    # e.g. a vision tower under token ids: it used to fail after the blocks were quantized
    torch.manual_seed(0)
    model = _Net().eval()
    seen = []
    with pytest.raises(ValueError, match=r"1 layer\(s\) never run .*'unused'.*skip=\['unused', 'lm_head'\]"):
        calibrate_model(model, ["layers.0.fc", "layers.1.fc", "head", "unused"], [torch.randint(1, 50, (2, 8))],
                        lambda n, h: seen.append(n), progress=False)
    assert seen == []
    # a layer inside a block, and a model without blocks (one pass over all layers)
    with pytest.raises(ValueError, match=r"'layers.1.extra'.*skip=\['layers.1.extra', 'lm_head'\]"):
        calibrate_model(model, ["layers.0.fc", "layers.1.fc", "layers.1.extra"], [torch.randint(1, 50, (2, 8))],
                        lambda n, h: seen.append(n), progress=False)
    with pytest.raises(ValueError, match="'unused'"):
        calibrate_model(model, ["head", "unused"], [torch.randint(1, 50, (2, 8))], lambda n, h: seen.append(n),
                        progress=False)
    assert seen == []
    # through quantize_model: the model is left as it was, and the suggested skip rule works
    llama = _llama()
    llama.model.vision = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))  # never called by forward
    tokens = torch.randint(0, 128, (4, 16))
    with pytest.raises(ValueError, match=r"2 layer\(s\) never run .*'model.vision.0', 'model.vision.2'.*"
                                         r"skip=\['model.vision', 'lm_head'\]"):
        kbit_linear.quantize_model(llama, bits=3, calibration=Calibration(tokens=tokens, batch_size=2), progress=False)
    assert not any(isinstance(m, kbit_linear.KbitLinear) for m in llama.modules())
    summary = kbit_linear.quantize_model(llama, bits=3, skip=["model.vision", "lm_head"],
                                         calibration=Calibration(tokens=tokens, batch_size=2), progress=False)
    assert len(summary.converted) == 21


@pytest.mark.parametrize(
    "names, batches, error, match",
    [
        (["model.layers.0.mlp.up_proj"], torch.randint(0, 128, (4, 12)), TypeError,
         r"batches must be a list of \[batch, seq\] token-id tensors, got a single tensor"),
        (["model.layers.0.mlp.up_proj"], [torch.randint(0, 128, (4, 12)).float()], TypeError, r"batches\[0\] must be an integer"),
        (["model.layers.0.mlp.up_proj"], [torch.randint(0, 128, (12,))], ValueError, r"batches\[0\] must be a non-empty 2-D"),
        (["model.layers.0.mlp.up_proj"], [], ValueError, "at least one batch"),
        ("lm_head", None, TypeError, "names must be a sequence of layer names"),
        (["model.layers.0.nope"], None, ValueError, "names: the model has no module 'model.layers.0.nope'"),
        (["model.layers.0.mlp"], None, TypeError, "names: 'model.layers.0.mlp' is a LlamaMLP, not an nn.Linear"),
        ([3], None, TypeError, "names must hold str"),
    ],
    ids=["one-tensor", "float", "1-d", "empty", "names-str", "missing", "not-linear", "not-str"],
)
def test_calibrate_model_refuses_bad_arguments_by_name(names, batches, error, match):
    model = _llama()
    batches = [torch.randint(0, 128, (2, 8))] if batches is None else batches
    seen = []
    with pytest.raises(error, match=match):
        calibrate_model(model, names, batches, lambda n, h: seen.append(n), progress=False)
    assert seen == []


def test_default_text_refuses_a_single_module_name():
    with pytest.raises(TypeError, match="modules must be a sequence of module names, not a str"):
        default_calibration_text("json")  # read as the modules "j", "s", "o", "n": an empty text
    with pytest.raises(TypeError, match="modules must hold"):
        default_calibration_text([b"json"])
    assert default_calibration_text(["json.decoder"])


def test_lazy_block_reaches_the_quantizer(monkeypatch):
    from kbit_linear import calibration
    from kbit_linear.quantizer import quantize_weight

    seen = []
    original = calibration.gptq_quantize_blocks

    def spy(*args, **kwargs):
        seen.append(kwargs.get("lazy_block"))
        return original(*args, **kwargs)

    monkeypatch.setattr(calibration, "gptq_quantize_blocks", spy)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for lazy in (32, 128):
        seen.clear()
        kbit_linear.quantize_model(_llama(), bits=3, calibration=Calibration(tokens=tokens, batch_size=2, lazy_block=lazy),
                                   progress=False)
        assert set(seen) == {lazy} and len(seen) == 21
    torch.manual_seed(6)
    w, x = torch.randn(16, 128), _correlated_inputs(256, 128, seed=6)
    seen.clear()
    linear = nn.Linear(128, 16, bias=False)
    kbit_linear.KbitLinear.from_linear(linear, 3, hessian=x.T @ x, lazy_block=64)
    quantize_weight(w, 3, hessian=x.T @ x, lazy_block=96)
    assert seen == [64, 96]
    with pytest.raises(ValueError, match="lazy_block must be a multiple of 32"):
        kbit_linear.KbitLinear.from_linear(linear, 3, hessian=x.T @ x, lazy_block=48)


def _tiny_t5(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("via", ["quantize_model", "calibrate_model"])
def test_calibration_refuses_encoder_decoder_models_up_front(via):
    # (it used to fail inside transformers' T5 forward, "You must specify exactly one of input_ids or inputs_embeds")
    model = _tiny_t5()
    seen = []
    with pytest.raises(ValueError, match=r"model: calibration does not support encoder-decoder models.*decoder-only "
                                         r"and encoder-only.*data-free quantization"):
        if via == "quantize_model":
            kbit_linear.quantize_model(model, calibration=torch.randint(0, 96, (2, 16)), progress=False)
        else:
            calibrate_model(model, ["encoder.block.0.layer.0.SelfAttention.q"], [torch.randint(0, 96, (2, 8))],
                            lambda n, h: seen.append(n), progress=False)
    assert seen == [] and all(type(m) is not kbit_linear.KbitLinear for m in model.modules())  # nothing was touched


def test_encoder_decoder_model_quantizes_data_free_as_the_message_says():
    model = _tiny_t5()
    ids = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=ids).logits
    summary = kbit_linear.quantize_model(model, progress=False)  # (T5's _keep_in_fp32_modules stay dense)
    assert summary.converted
    with torch.no_grad():
        out = model(input_ids=ids, decoder_input_ids=ids).logits
    assert float((out - ref).norm() / ref.norm()) < 0.5


@pytest.mark.parametrize(
    "model, quantize_layer, error, match",
    [(None, "ok", TypeError, "model must be an nn.Module, got NoneType"),
     ("llama", None, TypeError, "quantize_layer must be callable")],
    ids=["model-none", "quantize-layer-none"],
)
def test_calibrate_model_refuses_a_bad_model_or_callback_by_name(model, quantize_layer, error, match):
    model = _llama() if model == "llama" else model
    callback = (lambda n, h: None) if quantize_layer == "ok" else quantize_layer
    with pytest.raises(error, match=match):
        calibrate_model(model, ["model.layers.0.mlp.up_proj"], [torch.randint(0, 128, (2, 8))], callback, progress=False)
