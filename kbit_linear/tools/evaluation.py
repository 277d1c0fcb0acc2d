"""Perplexity and KL divergence on a fixed text that ships with every Python: the tools' yardstick.

The text is CPython's own documentation of its statements and topics
(``pydoc_data.topics.topics``, the pages ``help()`` shows): the entries in sorted-key order,
joined by one blank line. It is tokenized without special tokens and cut into fixed,
non-overlapping windows of 512 tokens; the first 16 windows are scored (16 x 511 predicted
tokens). Perplexity is ``exp`` of the mean next-token negative log-likelihood over all scored
tokens. The KL divergence is the mean over the same positions of
``KL(p_reference || p_model)`` of the full next-token distributions, in nats per token: it is
steadier than perplexity when two models are close.

The text changes a little between CPython releases, so numbers are comparable only on the same
Python minor version (the README's figures are for CPython 3.11).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "WINDOW",
    "NUM_WINDOWS",
    "EvalResult",
    "perplexity_text",
    "token_windows",
    "evaluate",
    "stored_bits_per_weight",
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
    """

    perplexity: float
    nll: float
    kl: float | None
    tokens: int
    seconds: float


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
def evaluate(model: nn.Module, windows: torch.Tensor, reference: nn.Module | None = None, progress: bool = False) -> EvalResult:
    """Perplexity of ``model`` (and KL divergence from ``reference``) on ``windows``.

    Windows are scored one at a time, so memory stays at one window's logits per model.

    Args:
        model: a causal LM returning ``logits`` ``[1, T, vocab]``.
        windows: int64 ``[num_windows, T]`` token ids (from :func:`token_windows`).
        reference: an optional second causal LM with the same vocabulary (e.g. the unquantized
            model); its distributions are recomputed per window.
        progress: show a progress bar.

    Returns:
        An :class:`EvalResult`.
    """
    import time

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if reference is not None and not isinstance(reference, nn.Module):
        raise TypeError(f"reference must be a torch.nn.Module or None, got {type(reference).__name__}")
    if not isinstance(windows, torch.Tensor) or windows.dtype != torch.int64 or windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError("windows must be an int64 tensor [num_windows, T] with T >= 2")
    rows = range(windows.shape[0])
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, desc="perplexity", unit="window", file=sys.stderr)
    start = time.perf_counter()
    nll_sum, kl_sum, count = 0.0, 0.0, 0
    for i in rows:
        ids = windows[i : i + 1]
        logp = _log_probs(model, ids)
        targets = ids[:, 1:].to(logp.device)
        nll_sum += float(-logp.gather(-1, targets.unsqueeze(-1)).sum())
        if reference is not None:
            ref = _log_probs(reference, ids).to(logp.device)
            kl_sum += float(F.kl_div(logp, ref, log_target=True, reduction="sum"))
        count += targets.numel()
    nll = nll_sum / count
    return EvalResult(
        perplexity=math.exp(nll),
        nll=nll,
        kl=None if reference is None else kl_sum / count,
        tokens=count,
        seconds=time.perf_counter() - start,
    )


def stored_bits_per_weight(model: nn.Module) -> float | None:
    """Bits stored per weight over the model's quantized layers, everything counted.

    Counts the planes, the E4M4 scales, the codebook and the tensor scale of every
    :class:`~kbit_linear.KbitLinear` (padding to the 64 x 128 tiles included), divided by the
    layers' true ``in_features * out_features``. Biases are not counted.

    Returns:
        The ratio, or ``None`` when the model has no quantized layer.
    """
    from ..linear import KbitLinear

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    stored, weights = 0, 0
    for module in model.modules():
        if isinstance(module, KbitLinear):
            stored += sum(t.numel() * t.element_size() for t in (module.weight, module.absmax, module.codebook, module.tensor_scale))
            weights += module.in_features * module.out_features
    return 8 * stored / weights if weights else None
