"""Calibrated rounding: GPTQ-style error feedback into the kbit format, and the data it needs.

Round-to-nearest minimizes each weight's own error. GPTQ (Frantar et al., 2022) minimizes the
layer's output error ``||X W^T - X Q^T||^2`` over a calibration set instead: the in-features are
rounded one column at a time, and each column's rounding error is spread over the columns not yet
rounded, weighted by the inverse of the input Hessian ``H = X^T X``. Here every column is rounded
to the kbit format itself (the codebook entry nearest ``w / scale``, any codebook). Two sweep
orders:

* in-feature order (``act_order=False``): each 32-column block's E4M4 scale is chosen when the
  sweep reaches the block, from the weights as the earlier columns' errors left them;
* activation order (``act_order=True``, the default): the columns with the largest ``H[j, j]``
  (the most active inputs) first, so their errors are absorbed by the many columns still open;
  every block's scale is chosen before the sweep from the weights as given (GPTQ's "static
  groups": a block's columns are then reached at different times).

Either way the scale is the round-up absmax code, or the block scale search of
:func:`kbit_linear.format.search_block_codes`. The result is the same stored format as data-free
quantization: codebook indices, E4M4 block scale codes, tensor scale; nothing else.

Three levels, each usable alone:

* :func:`gptq_quantize_blocks`: one weight and its Hessian -> flat bit-planes and scale codes
  (the reference implementation, pure PyTorch, on the weight's device).
* :class:`HessianAccumulator` and :func:`calibrate_model`: run a model on calibration batches
  and hand each ``nn.Linear``'s Hessian to a callback that quantizes and swaps it. Transformer
  blocks (the layers of the model's largest ``nn.ModuleList``) are processed one at a time: the
  inputs of the first block are captured once, then each block is run on the current hidden
  states to collect its layers' Hessians, its layers are quantized, and the block is run again,
  now quantized, to give the next block's inputs. Only one block's Hessians exist at a time.
* :class:`Calibration`: the calibration data and settings for
  ``kbit_linear.quantize_model(..., calibration=...)``: token ids, or text and a tokenizer;
  by default :func:`default_calibration_text`, docstrings of Python's standard library, which is
  disjoint from the evaluation text of :mod:`kbit_linear.tools.evaluation`
  (``pydoc_data.topics``).

Layering: a quantizer; it uses :mod:`kbit_linear.format` only (no module, no patching): the
model-level driver swaps layers through the callback it is given.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from . import format as fmt

__all__ = [
    "DEFAULT_ACT_ORDER",
    "DEFAULT_DAMP",
    "LAZY_BLOCK",
    "SWEEP_CUDA_GRAPHS",
    "CALIBRATION_MODULES",
    "Calibration",
    "check_calibration_model",
    "check_damp",
    "check_lazy_block",
    "check_hessian",
    "default_calibration_text",
    "gptq_quantize_blocks",
    "damped_inverse_cholesky",
    "HessianAccumulator",
    "calibrate_model",
]

DEFAULT_DAMP = 0.01
"""Damping added to the Hessian's diagonal, as a fraction of its mean (GPTQ's ``percdamp``)."""
DEFAULT_ACT_ORDER = True
"""Sweep the columns by descending Hessian diagonal (GPTQ's ``act_order``): Gemma-3-270M K = 3, KL to
bf16 0.796 -> 0.578 (bench/results/accuracy.md, "Activation order")."""
LAZY_BLOCK = 128
"""Columns rounded between two updates of the remaining weights (GPTQ's lazy batch), a multiple of 32."""

SWEEP_CUDA_GRAPHS = True
"""On a GPU, replay each lazy block of an activation-order sweep as one CUDA graph. The sweep is
a dozen tiny ops per column, so eagerly it is bound by the host issuing them (~215 us per column
on an H200, whatever the row count); the graph issues them at the GPU's pace, same ops, same
result. False: eager everywhere."""

CALIBRATION_MODULES = (
    "argparse", "ast", "asyncio.events", "asyncio.tasks", "calendar", "collections", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "heapq", "http.client",
    "http.cookiejar", "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder", "locale",
    "logging", "mailbox", "multiprocessing.pool", "optparse", "pathlib", "pickle", "pdb",
    "pprint", "random", "re", "shutil", "smtplib", "socket", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tkinter", "typing",
    "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "zipfile",
)
"""Standard-library modules whose docstrings make the default calibration text, in this order."""


def default_calibration_text(modules: Sequence[str] = CALIBRATION_MODULES) -> str:
    """Docstrings of Python's standard library: the default calibration text.

    For each module of ``modules`` (found with ``importlib.util.find_spec`` and read from its
    source file), the module, class and function docstrings in source order, cleaned with
    ``inspect.cleandoc`` and joined by blank lines. A top-level module is not imported, but for a
    dotted name ``find_spec`` imports the parent package (``asyncio``, ``email``, ``http``,
    ``json``, ``multiprocessing``, ``unittest``, ``urllib``), which may import some of the listed
    modules with it. English prose about code, like the evaluation text, but none of it: the
    evaluation uses ``pydoc_data.topics`` (the language reference's topics), which none of these
    modules hold. Modules missing from an installation (``tkinter`` on some builds) are skipped,
    so the text depends on the Python build a little.

    Returns:
        The text (599,432 characters, about 0.6 MB, on CPython 3.11.7).

    Raises:
        TypeError: ``modules`` is a string (it would be read character by character) or holds
            a non-string.
    """
    if isinstance(modules, str):
        raise TypeError(f"modules must be a sequence of module names, not a str: use ({modules!r},)")
    modules = list(modules)
    for name in modules:
        if not isinstance(name, str):
            raise TypeError(f"modules must hold module names (str), got {type(name).__name__}")
    parts: list[str] = []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        if not origin or not origin.endswith(".py"):
            continue
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc.split()) >= 8:  # one-liners such as "Return self." say little
                    parts.append(doc)
    return "\n\n".join(parts)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_damp(damp: Any) -> float:
    """``damp`` as a float: the Hessian damping, a fraction of its mean diagonal, in (0, 1).

    Raises:
        TypeError / ValueError: naming ``damp``.
    """
    if isinstance(damp, bool) or not isinstance(damp, (int, float)):
        raise TypeError(f"damp must be a float, got {type(damp).__name__}")
    if not 0 < damp < 1:
        raise ValueError(f"damp must be in (0, 1), got {damp}")
    return float(damp)


def check_lazy_block(lazy_block: Any) -> int:
    """``lazy_block``: columns per lazy batch update of the GPTQ sweep, a positive multiple of 32.

    Raises:
        TypeError / ValueError: naming ``lazy_block``.
    """
    _check_int("lazy_block", lazy_block, fmt.BLOCK_SIZE)
    if lazy_block % fmt.BLOCK_SIZE:
        raise ValueError(f"lazy_block must be a multiple of {fmt.BLOCK_SIZE}, got {lazy_block}")
    return lazy_block


@dataclass
class Calibration:
    """Calibration data and settings for ``quantize_model(..., calibration=...)``.

    Give ``tokens``, or a ``tokenizer`` (with ``text``, or the default text).

    Attributes:
        tokens: int64 ``[num_sequences, seq_len]`` token ids (used as they are: ``num_sequences``
            and ``seq_len`` are then ignored), or ``None``.
        text: the calibration text (default :func:`default_calibration_text`); tokenized
            without special tokens and cut into ``num_sequences`` non-overlapping windows of
            ``seq_len`` tokens.
        tokenizer: a Hugging Face tokenizer, needed with ``text`` or the default text.
        num_sequences: windows taken from the text.
        seq_len: tokens per window.
        batch_size: sequences per forward call.
        damp: Hessian damping, a fraction of its mean diagonal, in (0, 1).
        lazy_block: columns per lazy batch update, a positive multiple of 32.
        act_order: sweep each weight's columns by descending Hessian diagonal, block scales
            chosen up front (:func:`gptq_quantize_blocks`).
    """

    tokens: torch.Tensor | None = None
    text: str | None = None
    tokenizer: Any = None
    num_sequences: int = 32
    seq_len: int = 512
    batch_size: int = 8
    damp: float = DEFAULT_DAMP
    lazy_block: int = LAZY_BLOCK
    act_order: bool = DEFAULT_ACT_ORDER

    def __post_init__(self) -> None:
        _check_int("num_sequences", self.num_sequences, 1)
        _check_int("seq_len", self.seq_len, 2)
        _check_int("batch_size", self.batch_size, 1)
        check_damp(self.damp)
        fmt.check_bool("act_order", self.act_order)
        check_lazy_block(self.lazy_block)
        if self.tokens is not None:
            t = self.tokens
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise TypeError(f"tokens must be an integer torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if t.dim() != 2 or t.shape[0] < 1 or t.shape[1] < 1:
                raise ValueError(f"tokens must be 2-D [num_sequences, seq_len], got shape {tuple(t.shape)}")
            if self.text is not None:
                raise ValueError("give tokens or text, not both")
        else:
            if self.text is not None and (not isinstance(self.text, str) or not self.text.strip()):
                raise ValueError("text must be a non-empty string")
            if self.tokenizer is None or not callable(self.tokenizer):
                raise ValueError("calibration needs tokens, or a tokenizer (with text or the default calibration text)")

    def token_ids(self) -> torch.Tensor:
        """int64 ``[num_sequences, seq_len]``: ``tokens``, or the tokenized text cut into windows.

        Raises:
            ValueError: the text is too short for ``num_sequences`` windows.
        """
        if self.tokens is not None:
            return self.tokens.to(torch.int64)
        text = default_calibration_text() if self.text is None else self.text
        ids = self.tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        need = self.num_sequences * self.seq_len
        if ids.numel() < need:
            raise ValueError(f"the calibration text has {ids.numel()} tokens, fewer than num_sequences * seq_len = {need}")
        return ids[:need].reshape(self.num_sequences, self.seq_len)

    def batches(self) -> list[torch.Tensor]:
        """The token ids split into batches of ``batch_size`` sequences (CPU tensors)."""
        return list(self.token_ids().split(self.batch_size))


# ---------------------------------------------------------------------------------------
# one weight
# ---------------------------------------------------------------------------------------


def damped_inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped ``H^-1`` (float32); damping grows 10x on failure."""
    h = hessian.clone()
    mean_diag = h.diagonal().mean()
    for attempt in range(4):
        damped = h.clone()
        damped.diagonal().add_(damp * (10**attempt) * mean_diag)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError(f"hessian is not positive definite even with damping {damp * 1000:g} x its mean diagonal")


def check_hessian(hessian: torch.Tensor, in_features: int) -> None:
    """A Hessian for a weight of ``in_features`` columns: a floating-point ``[in_features, in_features]``
    tensor of finite values.

    Raises:
        TypeError / ValueError: naming ``hessian``.
    """
    if not isinstance(hessian, torch.Tensor) or not hessian.is_floating_point():
        raise TypeError(f"hessian must be a floating-point torch.Tensor, got {getattr(hessian, 'dtype', type(hessian).__name__)}")
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"hessian must have shape [in_features, in_features] = [{in_features}, {in_features}], "
                         f"got {tuple(hessian.shape)}")
    if hessian.device.type != "meta" and not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian contains NaN or Inf values")


def gptq_quantize_blocks(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    codebook: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
    *,
    scale_search: bool = False,
    damp: float = DEFAULT_DAMP,
    lazy_block: int = LAZY_BLOCK,
    act_order: bool = DEFAULT_ACT_ORDER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Calibrated rounding of ``W[N, K]`` to flat kbit bit-planes and scale codes (reference).

    The GPTQ sweep over the in-features with the format's own rounding. The sweep order is the
    in-features' own, or with ``act_order`` descending ``H[j, j]`` (ties in in-feature order),
    ``H`` permuted to match. Block scale codes (round-up absmax, or
    :func:`kbit_linear.format.search_block_codes` with ``scale_search``): with ``act_order`` all
    chosen before the sweep from ``W``; otherwise each when the sweep reaches its block's first
    column, from the block's current (error-updated) weights. With ``U`` the upper Cholesky
    factor of the damped ``H^-1``, for each column ``j`` in sweep order: column ``j`` is rounded
    to the nearest codebook entry of ``w / scale`` (ties to the lower index, as everywhere in
    the format); its error divided by ``U[j, j]`` is subtracted from the later columns times
    ``U[j, j+1:]`` (within a lazy block of ``lazy_block`` columns at once, for the columns after
    it in one matrix product). Input features that were never active (``H[j, j] == 0``) are set
    to zero first, unless none was active (a zero Hessian: the layer saw no input): then every
    column is rounded to nearest, as with an identity Hessian, with a warning.

    With ``H`` a multiple of the identity there is no feedback (``U`` is diagonal) and the result
    is round-to-nearest with the same scale rule.

    Args:
        weight: finite floating-point ``[N, K]``; not modified.
        hessian: floating-point ``[K, K]``, symmetric positive semi-definite: ``X^T X`` (any
            positive multiple) of the layer's inputs ``X [tokens, K]``.
        bits: index width, 2..5.
        codebook: ``[2**bits]`` strictly increasing in [-1, 1] (default: normal-float).
        tensor_scale: float32 ``[1]`` power of two (default:
            :func:`kbit_linear.format.compute_tensor_scale` of ``weight``).
        scale_search: choose each block's scale for the least squared error of the block.
        damp: added to the diagonal, times its mean, in (0, 1).
        lazy_block: columns per lazy batch, a positive multiple of 32.
        act_order: sweep by descending Hessian diagonal, block scales chosen up front.

    Returns:
        ``(packed_flat, absmax_flat, tensor_scale)`` as :func:`kbit_linear.format.quantize_blockwise`
        returns them: int32 ``[N, ceil(K/32), bits]``, uint8 ``[N, ceil(K/32)]``, float32 ``[1]``,
        on ``weight``'s device.

    Raises:
        TypeError / ValueError: bad arguments, named; a Hessian that stays indefinite.
    """
    fmt.check_bits(bits)
    fmt.check_weight(weight)
    n, k = weight.shape
    check_hessian(hessian, k)
    fmt.check_bool("scale_search", scale_search)
    damp = check_damp(damp)
    fmt.check_bool("act_order", act_order)
    check_lazy_block(lazy_block)
    device = weight.device
    cb = fmt.resolve_codebook(codebook, bits, device)
    ts = fmt.compute_tensor_scale(weight) if tensor_scale is None else fmt.check_given_tensor_scale(tensor_scale, weight)
    candidates = fmt.SCALE_SEARCH_CANDIDATES if scale_search else 1  # 1: the round-up code alone

    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(device=device, dtype=torch.float32).clone()
    dead = h.diagonal() <= 0
    if bool(dead.all()):
        # No input at all: nothing tells the columns apart, and zeroing them all would erase the
        # layer; an identity Hessian rounds every column to nearest (no feedback).
        warnings.warn("the Hessian is zero (the layer saw no input signal on the calibration data): "
                      "its weight is rounded to nearest", UserWarning, stacklevel=2)
        h = torch.eye(k, device=device)
    else:
        h[dead, dead] = 1.0
        w[:, dead] = 0.0  # as GPTQ: an input that is always zero leaves its weights without effect
    order, codes = None, None
    if act_order:
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        h = h[order][:, order]
        codes = fmt.search_block_codes(w, cb, ts, candidates)  # every block's scale, before the sweep
        w = w[:, order]  # the sweep's order (the in-feature copy is freed)
    with _one_cpu_thread(device):
        u = damped_inverse_cholesky(h, damp)
        del h
        packed, codes = _sweep(w, u, bits, cb, ts, candidates, lazy_block, order, codes)
    return packed, codes, ts


class _one_cpu_thread:
    """On CPU, run the factorization and the column sweep on one thread: the sweep is thousands
    of tiny ops, and on a busy 2-core machine waking the thread pool cost up to 10 ms per op
    (a 576 x 576 layer: 4.2 s with 2 threads, under 1 s with one)."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = device.type == "cpu"

    def __enter__(self) -> None:
        if self.cpu:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.cpu:
            torch.set_num_threads(self.threads)


def _sweep(w: torch.Tensor, u: torch.Tensor, bits: int, cb: torch.Tensor, ts: torch.Tensor, candidates: int,
           lazy_block: int, order: torch.Tensor | None = None,
           codes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPTQ sweep of :func:`gptq_quantize_blocks` on checked arguments; ``w`` is updated in place.

    ``order``: None sweeps in in-feature order, choosing each block's code when the sweep reaches
    it. Otherwise ``w``'s columns and ``u`` (the factor of the permuted Hessian) are in the sweep's
    order, ``order[j]`` being the in-feature of swept column ``j``, and ``codes`` (uint8
    ``[N, blocks]``, in-feature blocks) were chosen before the sweep; where :func:`_graphs_apply`
    (on the current GPU, two lazy blocks or more) each full lazy block's column loop then replays
    one CUDA graph (:class:`_LazyBlockGraph`), with the same result.
    """
    n, k = w.shape
    device = w.device
    mids = fmt._midpoints(cb)
    q = torch.empty_like(w)  # the dequantized result, column by column (in sweep order)
    if order is None:
        codes = torch.empty((n, -(-k // fmt.BLOCK_SIZE)), dtype=torch.uint8, device=device)
        block_scales = None
    else:
        block_scales = fmt._block_scales(codes, ts)  # float32 [N, blocks], the fixed scales
    graph = None
    if order is not None and _graphs_apply(device, k, lazy_block):
        graph = _LazyBlockGraph(n, lazy_block, cb, mids, device)
    for i1 in range(0, k, lazy_block):
        i2 = min(i1 + lazy_block, k)
        if order is not None:
            scales = block_scales[:, order[i1:i2] // fmt.BLOCK_SIZE]  # [N, i2 - i1]
            if graph is not None and i2 - i1 == lazy_block:
                err1 = graph.run(w[:, i1:i2], scales, u[i1:i2, i1:i2], q[:, i1:i2])
            else:
                err1 = _fixed_scale_block(w[:, i1:i2].clone(), scales, u[i1:i2, i1:i2], cb, mids, q[:, i1:i2])
        else:
            err1 = _open_scale_block(w[:, i1:i2].clone(), u[i1:i2, i1:i2], cb, ts, candidates, mids, q[:, i1:i2],
                                     codes, i1)
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    if order is not None:
        q = torch.empty_like(q).index_copy_(1, order, q)  # back to in-feature order
    # The chosen values lie on the grid of their block's scale: packing them again with the
    # same codes gives back the chosen indices (and the format's padding of a partial block).
    return fmt.quantize_with_codes(q, bits, cb, ts, codes), codes


def _graphs_apply(device: torch.device, k: int, lazy_block: int) -> bool:
    """Whether a sweep of ``k`` columns on ``device`` replays CUDA graphs: switched on, at least two
    full lazy blocks to share the capture's cost, not inside another capture, and on the current
    GPU (a graph captures and replays on the current device's streams; a weight on another GPU
    sweeps eagerly)."""
    return (SWEEP_CUDA_GRAPHS and device.type == "cuda" and k >= 2 * lazy_block
            and device.index in (None, torch.cuda.current_device())
            and not torch.cuda.is_current_stream_capturing())


def _round_column(wc: torch.Tensor, scale: torch.Tensor, positive: torch.Tensor, safe: torch.Tensor,
                  cb: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """``cb[nearest(wc / scale)] * scale`` for one column ``[N, 1]``: the value of
    :func:`kbit_linear.format._nearest_indices`, with ``positive = scale > 0`` and ``safe`` (the
    scale, 1 where it is 0) computed once per lazy block (fixed scales) or per 32-column block
    (in-feature order), and the codebook's midpoints once per sweep, instead of per column."""
    return cb[fmt._nearest_of(torch.where(positive, wc / safe, 0.0), mids)] * scale


def _feed_back(w1: torch.Tensor, u1: torch.Tensor, q1: torch.Tensor, err1: torch.Tensor, i: int,
               qc: torch.Tensor) -> None:
    """Column ``i`` of a lazy block rounded to ``qc``: store it in ``q1``, and spread its error,
    scaled by ``U[i, i]``, over the block's later columns of ``w1`` (kept in ``err1`` for the
    columns after the block)."""
    e = (w1[:, i : i + 1] - qc) / u1[i, i]
    q1[:, i : i + 1] = qc
    w1[:, i:] -= e * u1[i : i + 1, i:]
    err1[:, i : i + 1] = e


def _fixed_scale_block(w1: torch.Tensor, scales: torch.Tensor, u1: torch.Tensor, cb: torch.Tensor, mids: torch.Tensor,
                       q1: torch.Tensor) -> torch.Tensor:
    """One lazy block of the sweep with every column's scale known (``scales`` ``[N, L]``): rounds
    the columns of ``w1`` (updated in place) into ``q1`` and returns the scaled errors ``[N, L]``."""
    positive = scales > 0
    safe = torch.where(positive, scales, 1.0)
    err1 = torch.empty_like(w1)
    for i in range(w1.shape[1]):
        qc = _round_column(w1[:, i : i + 1], scales[:, i : i + 1], positive[:, i : i + 1], safe[:, i : i + 1], cb, mids)
        _feed_back(w1, u1, q1, err1, i, qc)
    return err1


def _open_scale_block(w1: torch.Tensor, u1: torch.Tensor, cb: torch.Tensor, ts: torch.Tensor, candidates: int,
                      mids: torch.Tensor, q1: torch.Tensor, codes: torch.Tensor, first: int) -> torch.Tensor:
    """One lazy block of the in-feature-order sweep (columns ``first ..`` of the weight): each
    32-column block's scale code is chosen, into ``codes``, when the sweep reaches the block,
    from its columns as updated so far. Otherwise as :func:`_fixed_scale_block`."""
    assert first % fmt.BLOCK_SIZE == 0, "a lazy block starts on a 32-column block"  # lazy_block is checked to be a multiple
    err1 = torch.empty_like(w1)
    for i in range(w1.shape[1]):
        col = first + i
        if col % fmt.BLOCK_SIZE == 0:  # a block starts: its scale from the updated weights
            block_codes = fmt.search_block_codes(w1[:, i : i + fmt.BLOCK_SIZE], cb, ts, candidates)
            codes[:, col // fmt.BLOCK_SIZE] = block_codes[:, 0]
            scale = fmt._block_scales(block_codes, ts)  # [N, 1]
            positive = scale > 0
            safe = torch.where(positive, scale, 1.0)
        _feed_back(w1, u1, q1, err1, i, _round_column(w1[:, i : i + 1], scale, positive, safe, cb, mids))
    return err1


class _LazyBlockGraph:
    """:func:`_fixed_scale_block` on ``[N, L]`` captured once as a CUDA graph over static
    buffers, replayed for every full lazy block of one sweep."""

    def __init__(self, n: int, lazy: int, cb: torch.Tensor, mids: torch.Tensor, device: torch.device) -> None:
        self.w1 = torch.zeros((n, lazy), dtype=torch.float32, device=device)
        self.scales = torch.ones_like(self.w1)
        self.u1 = torch.eye(lazy, dtype=torch.float32, device=device)
        self.q1 = torch.empty_like(self.w1)
        self.cb, self.mids = cb.clone(), mids.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture (the caching allocator's first use)
            _fixed_scale_block(self.w1.clone(), self.scales, self.u1, self.cb, self.mids, self.q1.clone())
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # captured on a stream of the weight's device, which _graphs_apply requires to be current
        with torch.cuda.graph(self.graph, stream=side):
            self.err1 = _fixed_scale_block(self.w1, self.scales, self.u1, self.cb, self.mids, self.q1)

    def run(self, w1: torch.Tensor, scales: torch.Tensor, u1: torch.Tensor, q1: torch.Tensor) -> torch.Tensor:
        """The block's rounded values into ``q1``; returns its scaled errors (valid until the next run)."""
        self.w1.copy_(w1)
        self.scales.copy_(scales)
        self.u1.copy_(u1)
        self.graph.replay()
        q1.copy_(self.q1)
        return self.err1


# ---------------------------------------------------------------------------------------
# Hessians from a running model
# ---------------------------------------------------------------------------------------


class HessianAccumulator:
    """Collects ``H = sum X^T X / count`` of the inputs of some ``nn.Linear`` layers by forward hooks.

    Layers fed the same input tensor in a forward pass (q/k/v projections, gate/up) share one
    Hessian, computed once per batch: the sharing is found on the first batch, from the input
    tensors' identities.

    Use as a context manager; :meth:`hessian` gives a layer's float32 ``[in, in]`` matrix.
    """

    def __init__(self, layers: dict[str, nn.Linear]) -> None:
        self._layers = layers
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._leader: dict[str, str] = {}  # layer -> the layer whose Hessian it shares
        # id(input) -> (first layer fed it, the input): holding the input keeps its id from
        # being reused by a later tensor of the same pass
        self._seen: dict[int, tuple[str, torch.Tensor]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "HessianAccumulator":
        for name, layer in self._layers.items():
            self._handles.append(layer.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def new_pass(self) -> None:
        """Call before each forward pass (input identities are only compared within one)."""
        self._seen.clear()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            first = self._seen.setdefault(id(x), (name, x))[0]
            leader = self._leader.setdefault(name, first)
            if leader != name:
                return
            x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            s = self._sums.get(name)
            if s is None:
                s = self._sums[name] = torch.zeros(x.shape[-1], x.shape[-1], device=x.device)
            s.addmm_(x.T, x)
            self._counts[name] = self._counts.get(name, 0) + x.shape[0]

        return hook

    def hessian(self, name: str) -> torch.Tensor:
        """float32 ``[in_features, in_features]``: the mean ``x x^T`` of the layer's inputs.

        Raises:
            ValueError: the layer was never called.
        """
        leader = self._leader.get(name)
        if leader is None or leader not in self._sums:
            raise ValueError(f"layer {name!r} was not called on the calibration data: no Hessian")
        return self._sums[leader] / self._counts[leader]


class _Stop(Exception):
    """Raised by a hook to end a forward pass early, once the wanted inputs are captured."""


def _blocks(model: nn.Module, names: Sequence[str]) -> tuple[str, list[list[str]]]:
    """The ``nn.ModuleList`` holding most of ``names`` in separate children, and the names per child."""
    best, best_groups = "", []
    for list_name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        prefix = f"{list_name}." if list_name else ""
        groups: list[list[str]] = [[] for _ in module]
        for name in names:
            if name.startswith(prefix):
                head = name[len(prefix) :].split(".", 1)[0]
                if head.isdigit() and int(head) < len(module):
                    groups[int(head)].append(name)
        if sum(1 for g in groups if g) >= 2 and sum(map(len, groups)) > sum(map(len, best_groups)):
            best, best_groups = list_name, groups
    return best, best_groups


def _call(model: nn.Module, batch: torch.Tensor, device: torch.device) -> Any:
    """One forward pass on token ids, without a KV cache when the model takes ``use_cache``."""
    kwargs = {}
    try:
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs["use_cache"] = False
    except (TypeError, ValueError):
        pass
    return model(batch.to(device), **kwargs)


def _hidden_of(output: Any) -> torch.Tensor:
    """A block's output hidden states (blocks return a tensor or a tuple starting with it)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class _CallCounter:
    """Forward hooks recording which of ``names`` ran (a set add per call: no tensor is touched)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.called: set[str] = set()
        self._handles = [model.get_submodule(n).register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.called.add(name)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _check_names(model: nn.Module, names: Any) -> list[str]:
    """``names`` as a list without repeats, each the name of an ``nn.Linear`` of ``model``."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(f"names must be a sequence of layer names (e.g. a list), got {type(names).__name__}")
    names = list(dict.fromkeys(names))
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"names must hold str layer names, got {type(name).__name__}")
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"names: the model has no module {name!r}") from None
        if not isinstance(module, nn.Linear):
            raise TypeError(f"names: {name!r} is a {type(module).__name__}, not an nn.Linear")
    return names


def _check_batches(batches: Any) -> list[torch.Tensor]:
    """``batches`` as a non-empty list of 2-D integer tensors."""
    if isinstance(batches, torch.Tensor):  # iterating it would give 1-D rows, which fail deep in the model
        raise TypeError("batches must be a list of [batch, seq] token-id tensors, got a single tensor: pass "
                        "list(tokens.split(batch_size)) (or [tokens])")
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(f"batches must be a list of [batch, seq] token-id tensors, got {type(batches).__name__}")
    batches = list(batches)
    if not batches:
        raise ValueError("calibration needs at least one batch of token ids (batches is empty)")
    for i, b in enumerate(batches):
        if not isinstance(b, torch.Tensor) or b.is_floating_point() or b.is_complex() or b.dtype == torch.bool:
            raise TypeError(f"batches[{i}] must be an integer tensor of token ids, got {getattr(b, 'dtype', type(b).__name__)}")
        if b.dim() != 2 or b.numel() == 0:
            raise ValueError(f"batches[{i}] must be a non-empty 2-D [batch, seq] tensor, got shape {tuple(b.shape)}")
    return batches


def _never_called(uncalled: list[str], names: list[str]) -> ValueError:
    """The error for layers that no calibration pass runs, with the skip rules that would leave them dense."""
    missing = set(uncalled)
    called = [n for n in names if n not in missing]
    rules: list[str] = []  # per layer, its outermost ancestor holding no layer that ran
    for name in uncalled:
        parts = name.split(".")
        for j in range(1, len(parts) + 1):
            rule = ".".join(parts[:j])
            if not any(c == rule or c.startswith(rule + ".") for c in called):
                break
        if rule not in rules:
            rules.append(rule)
    shown = ", ".join(map(repr, uncalled[:5])) + (f" (+{len(uncalled) - 5} more)" if len(uncalled) > 5 else "")
    return ValueError(
        f"{len(uncalled)} layer(s) never run by the model on the calibration batches, so they have no Hessian "
        f"(nothing was quantized): {shown}. Leave them dense with quantize_model's skip option, e.g. "
        f"skip={rules + ['lm_head']!r} (skip replaces the default ('lm_head',)), or calibrate with inputs that run them")


def check_calibration_model(model: Any) -> None:
    """Refuse, up front, a model that calibration cannot run: not an ``nn.Module``, or an
    encoder-decoder model (``config.is_encoder_decoder``, e.g. T5, BART), whose forward needs
    decoder inputs besides ``input_ids`` (it would fail inside transformers during the capture
    pass).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is an encoder-decoder model.
    """
    fmt.check_module(model, "model")
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is True:
        data_free = "data-free quantization (quantize_model without calibration) works for them"
        raise ValueError(
            f"model: calibration does not support encoder-decoder models ({type(model).__name__} has "
            f"config.is_encoder_decoder=True and needs decoder inputs besides input_ids); it supports "
            f"decoder-only and encoder-only models that run on input_ids alone. Nothing was changed; "
            f"{data_free}")


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    names: Sequence[str],
    batches: Iterable[torch.Tensor],
    quantize_layer: Callable[[str, torch.Tensor], None],
    progress: bool = True,
    desc: str = "kbit calibrate",
) -> None:
    """Run ``model`` on ``batches`` and call ``quantize_layer(name, hessian)`` for every layer of ``names``.

    ``quantize_layer`` quantizes the layer and puts the result in its place in ``model``;
    later layers then see the quantized model's activations. Blocks (the children of the
    ``nn.ModuleList`` that holds the most of ``names``, e.g. ``model.layers``) are run one at a
    time on stored hidden states: one pass to collect the block's Hessians, one with the block
    quantized to make the next block's inputs. The arguments every block receives besides the
    hidden states (attention masks, position embeddings, ...) are captured in one forward pass
    of the unquantized model at the start. That pass also checks, before any ``quantize_layer``
    call, that every layer of ``names`` runs: each batch goes through the last block, and past
    it while a layer outside the blocks has not run yet (usually the first batch only).
    Layers outside the blocks are calibrated last, in one full forward pass. A model without
    such a list gets one full pass for all its layers.

    The model runs in eval mode (dropout off, so that the Hessians do not depend on the random
    state); every module's ``training`` flag is restored afterwards, by name (a layer swapped
    in by ``quantize_layer`` gets the flag of the one it replaced), also on an error.

    Args:
        model: the model, on one device.
        names: qualified names of the ``nn.Linear`` layers to quantize.
        batches: a list of integer token-id tensors ``[batch, seq]``, each a valid ``model(ids)``
            input (not one tensor: split it, e.g. ``list(tokens.split(8))``).
        quantize_layer: called once per name with the layer's float32 Hessian ``[in, in]``.
        progress: show a progress bar (one step per layer).
        desc: the progress bar's title.

    Raises:
        TypeError: ``model`` not an ``nn.Module``; ``batches`` one tensor, or an item not an
            integer tensor; ``names`` a str, or naming a module that is not an ``nn.Linear``;
            ``quantize_layer`` not callable.
        ValueError: an encoder-decoder ``model`` (``config.is_encoder_decoder``: it needs decoder
            inputs; :func:`check_calibration_model`), no batches, an item not 2-D, a name of no module, or layers that never run
            on the batches (e.g. a vision tower run on token ids; raised before any
            ``quantize_layer`` call, naming the skip rules that would leave them dense).
    """
    check_calibration_model(model)
    names = _check_names(model, names)
    batches = _check_batches(batches)
    if not callable(quantize_layer):
        raise TypeError(f"quantize_layer must be callable (name, hessian), got {type(quantize_layer).__name__}")
    training = {name: m.training for name, m in model.named_modules()}
    bar = tqdm(total=len(names), desc=desc, unit="layer", disable=not progress)
    try:
        model.eval()
        _calibrate(model, names, batches, quantize_layer, bar)
    finally:
        bar.close()
        for name, m in model.named_modules():
            if name in training:
                m.training = training[name]


def _calibrate(model: nn.Module, names: list[str], batches: list[torch.Tensor],
               quantize_layer: Callable[[str, torch.Tensor], None], bar: Any) -> None:
    """:func:`calibrate_model` on checked arguments, the model in eval mode."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    list_name, groups = _blocks(model, names)
    in_blocks = {n for g in groups for n in g}
    rest = [n for n in names if n not in in_blocks]

    def quantize_all(layer_names: list[str], acc: HessianAccumulator) -> None:
        for name in layer_names:
            h = acc.hessian(name)
            quantize_layer(name, h)
            del h
            bar.update(1)

    if groups:
        blocks = model.get_submodule(list_name)
        first = next(i for i, g in enumerate(groups) if g)
        last = max(i for i, g in enumerate(groups) if g)
        # inputs[b][i]: (args, kwargs) of block i on batch b; hidden states kept for the first only
        inputs: list[dict[int, tuple[tuple, dict]]] = []
        hidden: list[torch.Tensor] = []

        def capture(i: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                # no cache goes into the replays (transformers 5.24 renamed past_key_values to cache)
                kwargs = {k: (None if k in ("past_key_values", "past_key_value", "cache") else v) for k, v in kwargs.items()}
                if i == first:
                    hidden.append(args[0] if args else kwargs["hidden_states"])
                inputs[-1][i] = (args[1:] if args else (), {k: v for k, v in kwargs.items() if k != "hidden_states"})

            return hook

        rest_set = set(rest)

        def stop(module: nn.Module, args: tuple, output: Any) -> None:
            # After the last block (run, so that its layers count as called on every batch): the
            # rest of the model only while a layer outside the blocks has not run yet (the first
            # batch runs whole where the output head is one; all batches where a layer never runs).
            if rest_set <= counter.called:
                raise _Stop

        counter = _CallCounter(model, names)
        handles = [blocks[i].register_forward_pre_hook(capture(i), with_kwargs=True) for i in range(first, last + 1)]
        handles.append(blocks[last].register_forward_hook(stop))
        try:
            for batch in batches:
                inputs.append({})
                try:
                    _call(model, batch, device)
                except _Stop:
                    pass
        finally:
            counter.remove()
            for handle in handles:
                handle.remove()
        uncalled = [n for n in names if n not in counter.called]
        if uncalled:  # before any layer is swapped: a half-quantized model is worse than none
            raise _never_called(uncalled, names)

        for i in range(first, last + 1):
            block = blocks[i]

            def run(b: int) -> torch.Tensor:
                args, kwargs = inputs[b][i]
                return _hidden_of(block(hidden[b], *args, **kwargs))

            if groups[i]:
                with HessianAccumulator({n: model.get_submodule(n) for n in groups[i]}) as acc:
                    for b in range(len(batches)):
                        acc.new_pass()
                        run(b)
                quantize_all(groups[i], acc)
                del acc
            if i < last:  # the next block's inputs, from this block as quantized
                hidden = [run(b) for b in range(len(batches))]
        del inputs, hidden

    if rest:
        counter = _CallCounter(model, [] if groups else rest)  # with blocks, checked by the capture pass
        try:
            with HessianAccumulator({n: model.get_submodule(n) for n in rest}) as acc:
                for batch in batches:
                    acc.new_pass()
                    _call(model, batch, device)
        finally:
            counter.remove()
        uncalled = [n for n in rest if n not in counter.called] if not groups else []
        if uncalled:  # all checked before the first quantize_layer call: nothing is swapped yet
            raise _never_called(uncalled, names)
        quantize_all(rest, acc)
