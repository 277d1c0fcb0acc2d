"""Perplexity and KL divergence on a fixed text that ships with every Python: the tools' yardstick.

The text is CPython's own documentation of its statements and topics
(``pydoc_data.topics.topics``, the pages ``help()`` shows): the entries in sorted-key order,
joined by one blank line. It is tokenized without special tokens and cut into fixed,
non-overlapping windows of 512 tokens; the first 16 windows are scored (16 x 511 predicted
tokens). Perplexity is ``exp`` of the mean next-token negative log-likelihood over all scored
tokens. The KL divergence is the mean over the same positions of
``KL(p_reference || p_model)`` of the full next-token distributions, in nats per token: it is
steadier than perplexity when two models are close.

The top-1 agreement is the fraction of those positions where the model's most likely next token
is the reference's.

Sentence encoders (all-MiniLM-L6-v2) are scored on sentences of the same text
(:func:`embedding_sentences`): the mean cosine similarity of each sentence's embedding (the mean
of the encoder's last hidden states over the sentence's tokens) with the reference model's.

The text changes a little between CPython releases, so numbers are comparable only on the same
Python minor version (the README's figures are for CPython 3.11).
"""

from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "WINDOW",
    "NUM_WINDOWS",
    "NUM_SENTENCES",
    "EvalResult",
    "perplexity_text",
    "token_windows",
    "evaluate",
    "reference_log_probs",
    "stored_bits_per_weight",
    "EmbeddingResult",
    "embedding_sentences",
    "sentence_embeddings",
    "evaluate_embeddings",
]

WINDOW = 512
"""Tokens per evaluation window."""
NUM_WINDOWS = 16
"""Windows scored by default."""


def perplexity_text() -> str:
    """The evaluation text: ``pydoc_data.topics.topics`` values in sorted-key order, joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def token_windows(tokenizer, window: int = WINDOW, num_windows: int = NUM_WINDOWS, text: str | None = None) -> torch.Tensor:
    """Tokenize the evaluation text and cut it into non-overlapping windows.

    Args:
        tokenizer: a Hugging Face tokenizer (called with ``add_special_tokens=False``).
        window: tokens per window, >= 2.
        num_windows: how many windows to return (the first ones), >= 1.
        text: the text (default: :func:`perplexity_text`).

    Returns:
        int64 ``[num_windows, window]`` token ids.

    Raises:
        ValueError: bad sizes, or the text is too short for ``num_windows`` windows.
    """
    for name, v, low in (("window", window, 2), ("num_windows", num_windows, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if text is None:
        text = perplexity_text()
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    need = window * num_windows
    if ids.numel() < need:
        raise ValueError(
            f"the text has {ids.numel()} tokens, fewer than num_windows * window = {need}; "
            "ask for fewer or shorter windows"
        )
    return ids[:need].reshape(num_windows, window)


@dataclass(frozen=True)
class EvalResult:
    """Scores of one model on a set of windows.

    Attributes:
        perplexity: ``exp(nll)``.
        nll: mean next-token negative log-likelihood, nats per token.
        kl: mean ``KL(reference || model)`` in nats per token, ``None`` without a reference.
        tokens: number of scored tokens.
        seconds: wall time of the evaluation (both models when a reference is given).
        top1: fraction of positions where the model's argmax token is the reference's,
            ``None`` without a reference.
    """

    perplexity: float
    nll: float
    kl: float | None
    tokens: int
    seconds: float
    top1: float | None = None


def _input_device(model: nn.Module) -> torch.device:
    """Where the input ids must go: the embedding's device (also right for multi-device maps)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[1, T-1, vocab]`` next-token log-probabilities for positions 0..T-2."""
    out = model(input_ids=ids.to(_input_device(model)), use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.log_softmax(logits[:, :-1].float(), dim=-1)


@torch.inference_mode()
def reference_log_probs(model: nn.Module, windows: torch.Tensor) -> list[torch.Tensor]:
    """The next-token log-probabilities of ``model`` on each window, for :func:`evaluate`'s ``reference``.

    Computing them once saves one forward pass per window for every model compared with the
    same reference (memory: ``windows x (T-1) x vocab`` float32 values, e.g. 0.5 GB per
    512-token window at Gemma's 262k vocabulary).

    Returns:
        One float32 ``[1, T-1, vocab]`` tensor per window, on the CPU.
    """
    return [_log_probs(model, windows[i : i + 1]).cpu() for i in range(windows.shape[0])]


@torch.inference_mode()
def evaluate(model: nn.Module, windows: torch.Tensor, reference: nn.Module | list[torch.Tensor] | None = None,
             progress: bool = False) -> EvalResult:
    """Perplexity of ``model`` (and KL divergence from ``reference``) on ``windows``.

    Windows are scored one at a time, so memory stays at one window's logits per model.

    Args:
        model: a causal LM returning ``logits`` ``[1, T, vocab]``.
        windows: int64 ``[num_windows, T]`` token ids (from :func:`token_windows`).
        reference: an optional second causal LM with the same vocabulary (e.g. the unquantized
            model), whose distributions are recomputed per window, or its
            :func:`reference_log_probs` on the same windows.
        progress: show a progress bar.

    Returns:
        An :class:`EvalResult`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if reference is not None and not isinstance(reference, (nn.Module, list)):
        raise TypeError(f"reference must be a torch.nn.Module, a list of log-probabilities or None, got {type(reference).__name__}")
    if not isinstance(windows, torch.Tensor) or windows.dtype != torch.int64 or windows.dim() != 2 or windows.shape[1] < 2 \
            or windows.shape[0] < 1:
        raise ValueError("windows must be an int64 tensor [num_windows >= 1, T] with T >= 2")
    if isinstance(reference, list) and len(reference) != windows.shape[0]:
        raise ValueError(f"reference holds log-probabilities of {len(reference)} windows, windows {windows.shape[0]}")
    rows = range(windows.shape[0])
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, desc="perplexity", unit="window", file=sys.stderr)
    start = time.perf_counter()
    nll_sum, kl_sum, agree, count = 0.0, 0.0, 0, 0
    for i in rows:
        ids = windows[i : i + 1]
        logp = _log_probs(model, ids)
        targets = ids[:, 1:].to(logp.device)
        nll_sum += float(-logp.gather(-1, targets.unsqueeze(-1)).sum())
        if reference is not None:
            ref = (reference[i] if isinstance(reference, list) else _log_probs(reference, ids)).to(logp.device)
            kl_sum += float(F.kl_div(logp, ref, log_target=True, reduction="sum"))
            agree += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        count += targets.numel()
    nll = nll_sum / count
    return EvalResult(
        perplexity=math.exp(nll),
        nll=nll,
        kl=None if reference is None else kl_sum / count,
        tokens=count,
        seconds=time.perf_counter() - start,
        top1=None if reference is None else agree / count,
    )


def stored_bits_per_weight(model: nn.Module) -> float | None:
    """Bits stored per weight over the model's quantized layers and experts, everything counted.

    Counts the planes, the E4M4 scales, the codebook, the tensor scale and the Hadamard signs
    (where present) of every :class:`~kbit_linear.KbitLinear` (padding to the 64 x 128 tiles
    included), and the same tensors of both projections of every
    :class:`~kbit_linear.experts.KbitExperts`, divided by the true weight count
    (``in_features * out_features`` per layer, ``E * 3 * H * I`` per experts module). Biases are
    not counted.

    Returns:
        The ratio, or ``None`` when the model has no quantized layer or experts module.
    """
    from ..experts import PROJECTIONS, TENSOR_SUFFIXES, KbitExperts
    from ..fusion import kbit_layers

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    stored, weights = 0, 0
    for _, module in kbit_layers(model):  # fused parts counted as the layers they are
        tensors = (module.weight, module.absmax, module.codebook, module.tensor_scale, module.hadamard_signs)
        stored += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        weights += module.in_features * module.out_features
    # On MoE models most weights are in the experts (modules() yields a shared one once).
    for module in model.modules():
        if isinstance(module, KbitExperts):
            for proj in PROJECTIONS:
                t_all = (getattr(module, proj + suffix) for suffix in TENSOR_SUFFIXES.values())
                stored += sum(t.numel() * t.element_size() for t in t_all)
                n, k = module.projection_shape(proj)
                weights += module.num_experts * n * k
    return 8 * stored / weights if weights else None


NUM_SENTENCES = 256
"""Sentences scored by default in :func:`evaluate_embeddings`."""


def embedding_sentences(num_sentences: int = NUM_SENTENCES, text: str | None = None,
                        min_words: int = 6, max_words: int = 60) -> list[str]:
    """Sentences of the evaluation text for sentence encoders, in text order.

    The text (default :func:`perplexity_text`) is split after ``.``, ``!`` or ``?`` followed by
    whitespace; whitespace runs become one space; sentences of ``min_words`` to ``max_words``
    words are kept (headings, code and tables mostly fall out), the first ``num_sentences`` of
    them returned.

    Raises:
        ValueError: a bad count, or the text has fewer such sentences.
    """
    for name, v in (("num_sentences", num_sentences), ("min_words", min_words), ("max_words", max_words)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if text is None:
        text = perplexity_text()
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    out = []
    for raw in re.split(r"(?<=[.!?])\s+", text):
        sentence = " ".join(raw.split())
        if min_words <= len(sentence.split()) <= max_words:
            out.append(sentence)
            if len(out) == num_sentences:
                return out
    raise ValueError(f"the text has {len(out)} sentences of {min_words}..{max_words} words, fewer than num_sentences={num_sentences}")


@torch.inference_mode()
def sentence_embeddings(model: nn.Module, tokenizer, sentences: list[str], batch_size: int = 32,
                        max_length: int = 256) -> torch.Tensor:
    """float32 ``[len(sentences), hidden]`` unit-norm sentence embeddings of an encoder.

    Each embedding is the mean of ``model(...).last_hidden_state`` over the sentence's tokens
    (padding masked out), divided by its norm: the all-MiniLM-L6-v2 recipe (mean pooling, then
    normalization).

    Args:
        model: an encoder returning ``last_hidden_state`` ``[B, T, hidden]`` (e.g. ``AutoModel``).
        tokenizer: its Hugging Face tokenizer (special tokens added, padded, truncated).
        sentences: the texts.
        batch_size: sentences per forward call.
        max_length: tokens kept per sentence.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(sentences, (list, tuple)) or not sentences or not all(isinstance(t, str) for t in sentences):
        raise ValueError("sentences must be a non-empty list of strings")
    for arg, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    device = _input_device(model)
    chunks = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(list(sentences[i : i + batch_size]), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items()}
        hidden = model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        chunks.append(F.normalize(pooled, dim=-1).cpu())
    return torch.cat(chunks)


@dataclass(frozen=True)
class EmbeddingResult:
    """Agreement of a sentence encoder with a reference encoder.

    Attributes:
        mean_cosine: mean over sentences of the cosine between the two embeddings.
        min_cosine: the smallest of those cosines.
        sentences: number of sentences.
        seconds: wall time (the model only; reference embeddings are passed in).
    """

    mean_cosine: float
    min_cosine: float
    sentences: int
    seconds: float


def evaluate_embeddings(model: nn.Module, tokenizer, sentences: list[str], reference: torch.Tensor) -> EmbeddingResult:
    """Cosine similarity of ``model``'s sentence embeddings with ``reference`` embeddings.

    Args:
        model: the encoder to score.
        tokenizer: its tokenizer.
        sentences: the texts (:func:`embedding_sentences`).
        reference: float ``[len(sentences), hidden]`` embeddings of the same sentences from the
            reference model (:func:`sentence_embeddings`).
    """
    if not isinstance(reference, torch.Tensor) or reference.dim() != 2 or reference.shape[0] != len(sentences):
        raise ValueError("reference must be a [len(sentences), hidden] tensor of embeddings")
    start = time.perf_counter()
    emb = sentence_embeddings(model, tokenizer, sentences)
    cos = F.cosine_similarity(emb, reference.to(emb), dim=-1)
    return EmbeddingResult(float(cos.mean()), float(cos.min()), len(sentences), time.perf_counter() - start)
