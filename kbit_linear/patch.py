"""``quantize_model``: replace the ``nn.Linear`` layers of any model by ``KbitLinear`` in place,
and the module-swap rules every swap in kbit_linear follows.

The swap rule (:func:`is_convertible`), one for ``quantize_model``, the transformers plug-in and
``serialization.load_into``: a module is swapped for a ``KbitLinear`` only when its type is
exactly ``nn.Linear``. Subclasses carry behaviour a ``KbitLinear`` would drop: the ``out_proj``
of ``nn.MultiheadAttention`` (``NonDynamicallyQuantizableLinear``) is never called, its owner
reads ``.weight`` directly; adapter or fused layers built on ``nn.Linear`` override ``forward``.
transformers' own bitsandbytes and fine-grained FP8 quantizers use the same exact-type rule.
(:meth:`KbitLinear.from_linear` converts any ``nn.Linear`` it is handed: that is the caller's
explicit choice, not a swap.)

Which layers :func:`convertible_layers` (and so ``quantize_model`` and the plug-in) converts:

* modules that pass :func:`is_convertible`;
* not matched by ``skip`` (rules in :func:`matches_skip`: whole dotted-name components, or a
  regular expression);
* not tied: a Linear whose weight Parameter (or its storage) also belongs to another module,
  like an ``lm_head`` tied to the input embeddings, is left alone;
* with a floating-point, 2-D, non-empty weight.

Every layer left alone gets a reason in the returned :class:`QuantizationSummary`. Layers are
quantized one at a time on the weight's own device (or ``device``), and each dense layer is
dropped from the model before the next is quantized, so peak memory stays near the model's
size plus one layer. :func:`replace_module` is the one way a layer is put into its parent.

Mixture-of-experts blocks keep their experts as 3-D weights in one module, not as ``nn.Linear``:
:func:`convertible_experts` finds them (:func:`kbit_linear.experts.looks_like_experts`) and
converts those whose layout :class:`~kbit_linear.experts.KbitExperts` implements
(:func:`kbit_linear.experts.experts_layout_problem`), under the same skip rules; the others stay
dense with the reason in the summary.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from . import allocation, codebooks
from . import format as fmt
from . import hadamard as hd
from .fusion import DEFAULT_GROUPS, FusionSummary, fuse_projections, is_cross_attention, unfuse_projections
from .router import RouterFusionSummary, fuse_routers, unfuse_routers
from .calibration import Calibration, calibrate_model, check_calibration_model
from .experts import PROJECTIONS, KbitExperts, experts_layout_problem, looks_like_experts
from .linear import KbitLinear
from .quantizer import GroupShared, check_hadamard_search, group_quantization

__all__ = [
    "QuantizationSummary",
    "quantize_model",
    "matches_skip",
    "check_skip_rules",
    "module_bytes",
    "is_convertible",
    "convertible_layers",
    "convertible_experts",
    "replace_module",
    "kbit_placeholder",
    "experts_placeholder",
    "sibling_groups",
    "shared_quantization",
]

SkipRule = str | re.Pattern[str]

_REGEX_PREFIX = "re:"


@dataclass
class QuantizationSummary:
    """What :func:`quantize_model` did.

    Attributes:
        bits: index width used (with ``target_bpw``: unused, see ``layer_bits``).
        converted: qualified names of the layers replaced by ``KbitLinear``.
        skipped: qualified name -> reason, for every ``nn.Linear`` (or subclass) left as is.
        bytes_before: bytes of all parameters and buffers of the model before (shared
            tensors counted once).
        bytes_after: the same after quantization.
        converted_bytes_before: bytes of the converted layers' dense weights and biases.
        converted_bytes_after: bytes of their quantized tensors (planes, scales, codebook,
            tensor scale, bias).
        experts: qualified names of the MoE experts modules replaced by ``KbitExperts`` (experts
            modules left dense are in ``skipped``).
        experts_bytes_before: bytes of their dense expert weights.
        experts_bytes_after: bytes of their quantized tensors.
        layer_bits: with ``target_bpw``: qualified name -> the width chosen for that layer or
            experts module (empty otherwise: every layer has ``bits``).
        mean_layer_bits: with ``target_bpw``: the mean width over the converted layers' and
            experts modules' weights (a module shared under several names counted once).
        fusion: with ``fuse=True``: the groups of projections fused into one GEMM, and those
            left apart with the reason (:class:`kbit_linear.fusion.FusionSummary`); else ``None``.
        routers: with ``fuse=True``: the MoE routers switched to one kernel, and the router-like
            modules left alone with the reason (:class:`kbit_linear.router.RouterFusionSummary`);
            else ``None``.
        unmatched_skip: the caller's skip rules that matched no module (a warning was given).
    """

    bits: int
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    converted_bytes_before: int = 0
    converted_bytes_after: int = 0
    experts: list[str] = field(default_factory=list)
    experts_bytes_before: int = 0
    experts_bytes_after: int = 0
    layer_bits: dict[str, int] = field(default_factory=dict)
    mean_layer_bits: float = 0.0
    fusion: FusionSummary | None = None
    routers: RouterFusionSummary | None = None
    unmatched_skip: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        width = f"{self.bits} bits"
        if self.layer_bits:
            counts = defaultdict(int)
            for b in self.layer_bits.values():
                counts[b] += 1
            width = "bits per layer: " + ", ".join(f"{b}: {counts[b]}" for b in sorted(counts)) + f"; mean {self.mean_layer_bits:.2f}"
        lines = [
            f"kbit quantization ({width}): {len(self.converted)} layers converted, {len(self.skipped)} skipped",
            f"  model bytes: {self.bytes_before:,} -> {self.bytes_after:,}",
            f"  converted layers: {self.converted_bytes_before:,} -> {self.converted_bytes_after:,} bytes",
        ]
        if self.experts:
            lines.append(
                f"  experts ({len(self.experts)} modules): {self.experts_bytes_before:,} -> {self.experts_bytes_after:,} bytes"
            )
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        if self.unmatched_skip:
            lines.append(f"  skip rules matching no module (nothing kept dense by them): {self.unmatched_skip}")
        if self.fusion is not None:
            lines += ["  " + line for line in str(self.fusion).splitlines()]
        if self.routers is not None and (self.routers.fused or self.routers.skipped):
            lines += ["  " + line for line in str(self.routers).splitlines()]
        return "\n".join(lines)


def matches_skip(name: str, rules: Iterable[SkipRule]) -> SkipRule | None:
    """The first rule of ``rules`` that matches the module name ``name``, or ``None``.

    Matching rules:

    * a plain string ``s`` matches when it is a run of whole components of the dotted name:
      ``name == s`` (exact), ``name`` starts with ``s + "."`` (an ancestor: ``"model.layers.0"``
      skips every layer inside it), ends with ``"." + s`` (a trailing path: ``"lm_head"``
      matches ``"model.lm_head"``, ``"self_attn.o_proj"`` every attention output projection),
      or contains ``"." + s + "."`` (``"mlp"`` skips every layer of every MLP block).
      Partial components never match: ``"layers.1"`` does not match ``"layers.11.mlp"``,
      ``"proj"`` does not match ``"o_proj"``.
    * a string starting with ``"re:"`` or a compiled ``re.Pattern`` is a regular expression
      tried with ``re.search`` on the full name (``"re:layers\\.(0|1)\\.mlp"``).

    Args:
        name: a qualified module name as in ``model.named_modules()``.
        rules: the skip rules.

    Returns:
        The matching rule, or ``None``.

    Raises:
        TypeError: ``name`` is not a str.
        TypeError / ValueError: bad rules (:func:`check_skip_rules`: one bare rule is taken as one
            rule, not iterated character by character).
    """
    if not isinstance(name, str):  # (None would match no rule and pass silently)
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for rule in check_skip_rules(rules, "rules"):
        if isinstance(rule, re.Pattern):
            if rule.search(name):
                return rule
        elif rule.startswith(_REGEX_PREFIX):
            if re.search(rule[len(_REGEX_PREFIX) :], name):
                return rule
        elif f".{rule}." in f".{name}.":
            return rule
    return None


def check_skip_rules(skip: Iterable[SkipRule] | str | None, name: str = "skip") -> tuple[SkipRule, ...]:
    """Validate skip rules (see :func:`matches_skip`) and return them as a tuple.

    Args:
        skip: ``None``, one rule, or an iterable of rules (non-empty strings, ``"re:"`` strings
            holding a valid regular expression, or compiled regexes).
        name: the argument name used in error messages.

    Raises:
        TypeError: not a rule or an iterable of rules, or an empty / non-string entry.
        ValueError: a ``"re:"`` entry that does not compile.
    """
    if skip is None:
        return ()
    if isinstance(skip, (str, re.Pattern)):
        skip = (skip,)
    try:
        rules = tuple(skip)
    except TypeError:
        raise TypeError(f"{name} must be a string, a compiled regex or an iterable of them, got {type(skip).__name__}") from None
    for rule in rules:
        if isinstance(rule, re.Pattern):
            continue
        if not isinstance(rule, str) or not rule:
            raise TypeError(f"{name} entries must be non-empty strings or compiled regexes, got {rule!r}")
        if rule.startswith(_REGEX_PREFIX):
            try:
                re.compile(rule[len(_REGEX_PREFIX) :])
            except re.error as e:
                raise ValueError(f"{name} entry {rule!r} is not a valid regular expression: {e}") from None
    return rules


def _storage_key(t: torch.Tensor) -> tuple | None:
    """Identity of a tensor's memory (``None`` on meta, where nothing is allocated)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr())


def module_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``model``, shared tensors counted once (meta included).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    fmt.check_module(model, "model")
    seen: set = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        key = _storage_key(t) or ("id", id(t))
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _tied_linears(model: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, str]:
    """name -> reason for every Linear whose weight is also held by another module."""
    holders: dict[object, set[str]] = defaultdict(set)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            owner = f"{mod_name}.{p_name}" if mod_name else p_name
            holders[("id", id(p))].add(owner)
            key = _storage_key(p)
            if key is not None:
                holders[key].add(owner)
    # a Linear module reused under several names holds its weight under each: not a tie
    names_of: dict[int, set[str]] = defaultdict(set)
    for name, linear in linears.items():
        names_of[id(linear)].add(f"{name}.weight")
    reasons = {}
    for name, linear in linears.items():
        w = linear.weight
        if w is None:
            continue
        others = set(holders[("id", id(w))])
        key = _storage_key(w)
        if key is not None:
            others |= holders[key]
        others -= names_of[id(linear)]
        if others:
            reasons[name] = f"weight is tied to {', '.join(sorted(others))}"
    return reasons


def is_convertible(module: nn.Module) -> bool:
    """The swap rule: ``True`` when ``module``'s type is exactly ``nn.Linear``.

    Subclasses (``NonDynamicallyQuantizableLinear``, adapter or fused layers) may read
    ``.weight`` directly or override ``forward``; swapping them would silently drop that
    behaviour, so no automatic swap takes them (see the module docstring).
    """
    return type(module) is nn.Linear


def _unsupported_reason(linear: nn.Module) -> str | None:
    """Why this Linear cannot be quantized, or ``None``."""
    if not is_convertible(linear):
        return f"{type(linear).__name__} is a subclass of nn.Linear (its users may read .weight directly)"
    w = linear.weight
    if w is None:
        return "has no weight"
    if not w.is_floating_point():
        return f"weight dtype {w.dtype} is not floating point (already quantized?)"
    if w.dim() != 2 or w.numel() == 0:
        return f"weight shape {tuple(w.shape)} is not a non-empty [out, in] matrix"
    return None


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``name`` inside ``root``, in place of what is there.

    Args:
        root: the model.
        name: a qualified module name as in ``root.named_modules()`` (not ``""``: the root
            itself cannot be replaced in place).
        new: the module to put there.

    Raises:
        TypeError: ``root`` or ``new`` is not an ``nn.Module``.
        ValueError: ``name`` is empty or names no existing submodule (a misspelled name would
            otherwise add a new attribute and leave the intended module in place).
    """
    fmt.check_module(root, "root")
    fmt.check_module(new, "new")
    if not isinstance(name, str) or not name:
        raise ValueError(f"cannot replace the root module in place; give the name of a submodule, got {name!r}")
    parent_name, _, child = name.rpartition(".")
    try:
        parent = root.get_submodule(parent_name) if parent_name else root
    except AttributeError as e:
        raise ValueError(f"replace_module: {name!r} is not a submodule of this {type(root).__name__} ({e})") from None
    if child not in parent._modules:
        raise ValueError(f"replace_module: {name!r} is not a submodule of this {type(root).__name__} "
                         f"({type(parent).__name__} has no submodule {child!r})")
    setattr(parent, child, new)


def kbit_placeholder(
    linear: nn.Linear, bits: int, *, bias: bool | None = None, device: torch.device | str | None = None,
    hadamard: bool = False,
) -> KbitLinear:
    """An unfilled :class:`KbitLinear` standing in for ``linear``, to be filled by a state dict.

    Same shape and training mode as ``linear``, the bias in ``linear``'s dtype; zero blocks
    and the default codebook until loaded (on ``"meta"`` nothing is allocated).

    Args:
        linear: the dense layer it replaces (only its shape, dtype and mode are read).
        bits: index width, 2..5.
        bias: whether it has a bias (default: as ``linear``).
        device: where its tensors live (default: ``linear.weight``'s device).
        hadamard: whether it holds a Hadamard-rotated weight (a ``hadamard_signs`` buffer).

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``.
    """
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    device = fmt.check_device(device)
    ref = linear.bias if linear.bias is not None else linear.weight
    layer = KbitLinear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None if bias is None else bias,
        bits=bits,
        device=linear.weight.device if device is None else device,
        dtype=ref.dtype,
        hadamard=hadamard,
    )
    layer.train(linear.training)
    return layer


def experts_placeholder(module: nn.Module, bits: int, *, device: torch.device | str | None = None) -> KbitExperts:
    """An unfilled :class:`KbitExperts` standing in for the experts module ``module``, to be filled by a state dict.

    Same shapes, activation and training mode as ``module`` (which must pass
    :func:`kbit_linear.experts.experts_layout_problem`); zero weights and the default codebooks
    until loaded.

    Args:
        module: the dense experts module it replaces (only its shapes, ``act_fn`` and mode are read).
        bits: index width, 2..5.
        device: where its tensors live (default: ``module.gate_up_proj``'s device).
    """
    problem = experts_layout_problem(module)
    if problem is not None:
        raise ValueError(f"module cannot be replaced by kbit experts: {problem}")
    device = fmt.check_device(device)
    e, two_i, h = module.gate_up_proj.shape
    new = KbitExperts(e, h, two_i // 2, bits=bits, act_fn=module.act_fn,
                      device=module.gate_up_proj.device if device is None else device)
    new.train(module.training)
    new.keep_dense_outline(module)
    return new


def convertible_experts(model: nn.Module, skip: Iterable[SkipRule] | str | None = ()) -> tuple[list[str], dict[str, str]]:
    """Which MoE experts modules of ``model`` a swap converts to :class:`KbitExperts`, and why the others stay.

    Args:
        model: any module.
        skip: rules of :func:`matches_skip`, applied to the experts module's name.

    Returns:
        ``(names, skipped)``: qualified names to convert, in ``named_modules`` order (a module
        reused under several names appears under each), and name -> reason for every module
        that holds experts as 3-D weights (:func:`kbit_linear.experts.looks_like_experts`) and
        is left dense (skip rule, or a layout ``KbitExperts`` does not implement).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or bad skip rules.
    """
    fmt.check_module(model, "model")
    rules = check_skip_rules(skip)
    names: list[str] = []
    skipped: dict[str, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, KbitExperts) or not looks_like_experts(module):
            continue
        rule = matches_skip(name, rules)
        if rule is not None:
            skipped[name] = f"matches skip rule {rule.pattern if isinstance(rule, re.Pattern) else rule!r}"
        elif (reason := experts_layout_problem(module)) is not None:
            skipped[name] = f"experts stay dense: {reason}"
        else:
            names.append(name)
    return names, skipped


def unmatched_skip_rules(model: nn.Module, rules: Iterable[SkipRule]) -> list[SkipRule]:
    """The rules of ``rules`` that match no module name of ``model`` (:func:`matches_skip`): a
    misspelled name (``"o_prj"``) keeps nothing dense, so callers warn about these."""
    names = [name for name, _ in model.named_modules() if name]
    return [rule for rule in rules if not any(matches_skip(name, (rule,)) for name in names)]


def warn_unmatched_skip_rules(model: nn.Module, rules: Iterable[SkipRule], argument: str) -> list[str]:
    """Warn (``UserWarning``, naming ``argument``) about the rules that match no module of
    ``model``, and return them as written (a compiled regex as its pattern)."""
    shown = [rule.pattern if isinstance(rule, re.Pattern) else rule for rule in unmatched_skip_rules(model, rules)]
    if shown:
        warnings.warn(f"{argument} entries {shown} match no module of this {type(model).__name__}: they keep nothing "
                      "dense (a misspelled name?)", UserWarning, stacklevel=3)
    return shown


def convertible_layers(model: nn.Module, skip: Iterable[SkipRule] | str | None = ()) -> tuple[list[str], dict[str, str]]:
    """Which ``nn.Linear`` layers of ``model`` a swap converts, and why the others stay.

    Args:
        model: any module.
        skip: rules of :func:`matches_skip` (names or regexes to keep dense).

    Returns:
        ``(names, skipped)``: the qualified names to convert, in ``named_modules`` order (a
        module reused under several names appears under each), and name -> reason for every
        ``nn.Linear`` or subclass left alone (skip rule, tied weight, :func:`is_convertible`,
        unsupported weight).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or bad skip rules.
    """
    fmt.check_module(model, "model")
    rules = check_skip_rules(skip)
    linears = {name: m for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.Linear)}
    tied = _tied_linears(model, linears)
    names: list[str] = []
    skipped: dict[str, str] = {}
    for name, linear in linears.items():
        rule = matches_skip(name, rules)
        if rule is not None:
            skipped[name] = f"matches skip rule {rule.pattern if isinstance(rule, re.Pattern) else rule!r}"
        elif name in tied:
            skipped[name] = tied[name]
        elif (reason := _unsupported_reason(linear)) is not None:
            skipped[name] = reason
        else:
            names.append(name)
    return names, skipped


DEFAULT_SKIP: tuple[str, ...] = ("lm_head",)
"""``quantize_model``'s default skip rules (the output head stays dense, as bitsandbytes and torchao keep it)."""


def quantize_model(
    model: nn.Module,
    bits: int = 4,
    skip: Iterable[SkipRule] | str | None = DEFAULT_SKIP,
    codebook: torch.Tensor | str | None = codebooks.DEFAULT,
    progress: bool = True,
    scale_search: bool = False,
    device: torch.device | str | None = None,
    calibration: Calibration | torch.Tensor | None = None,
    hadamard: bool = False,
    target_bpw: float | None = None,
    hadamard_search: int = 1,
    fuse: bool = False,
) -> QuantizationSummary:
    """Replace the ``nn.Linear`` layers of ``model`` by :class:`KbitLinear`, in place, and
    the experts modules of mixture-of-experts blocks by :class:`KbitExperts`.

    Each layer is quantized with :meth:`KbitLinear.from_linear` on its weight's device (or
    ``device``), then swapped into its parent; the dense layer is released before the next
    one is quantized. Experts modules that :func:`convertible_experts` accepts follow, one at a
    time, through :meth:`KbitExperts.from_experts`. Works on models on CPU, CUDA or the meta
    device (meta layers become meta ``KbitLinear`` of the right shapes, to be filled by
    ``load_state_dict``).

    Args:
        model: any ``nn.Module``; a bare ``nn.Linear`` cannot be replaced in place (wrap it
            or use ``KbitLinear.from_linear``).
        bits: index width, 2..5.
        skip: module names to leave dense, matched by :func:`matches_skip` (a run of whole
            dotted-name components such as ``"lm_head"``, ``"model.layers.0"``, ``"mlp"``, or
            a ``"re:"``-prefixed string / compiled regex searched in the name). Default
            ``("lm_head",)``; the given rules replace the default. ``None`` or ``()``
            converts every convertible layer. The model's ``_keep_in_fp32_modules`` (T5's
            ``wo``) always stay dense, as transformers' quantizers keep them.
        codebook: float ``[2**bits]`` shared by every layer (each layer stores its own
            copy); ``None``: the normal-float codebook; ``"fitted"``: levels fitted to each
            weight (:mod:`kbit_linear.codebooks`; an experts projection: one set for all its
            experts); ``"nf-zero"`` / ``"fitted-zero"``: levels with a zero
            (:mod:`kbit_linear.codebooks`). Default ``"default"``: by each layer's width
            (:data:`kbit_linear.codebooks.DEFAULT_BY_WIDTH`: a zero level at K = 3 and 4), the
            fitted levels with ``calibration``, normal-float ones with ``hadamard``
            (:func:`kbit_linear.codebooks.default_codebook` has the measurements).
        progress: show a tqdm progress bar.
        scale_search: choose each block's scale for the least error instead of rounding its
            absmax up (:func:`kbit_linear.quantizer.quantize_weight`): better at 2 and 3 bits,
            slower to quantize.
        device: where to quantize and keep the new layers (default: each weight's device).
        calibration: calibrated (GPTQ-style) rounding of the ``nn.Linear`` layers: a
            :class:`kbit_linear.calibration.Calibration` (token ids, or a tokenizer with a text
            or the default calibration text) or an int64 ``[sequences, tokens]`` tensor of token
            ids. The model is run on the data block by block
            (:func:`kbit_linear.calibration.calibrate_model`), each layer rounded with its
            inputs' Hessian; same stored format, works with ``codebook`` and ``scale_search``.
            Needs a model on one real device and no ``device``. Experts modules stay data-free.
        hadamard: quantize each ``nn.Linear`` weight rotated by a randomized Hadamard transform
            along in_features (:mod:`kbit_linear.hadamard`; the layer rotates its inputs to
            match: one more kernel per call on CUDA). Much better at K = 2 and 3 on real
            weights; works with ``calibration``. Each layer's signs are seeded by its name
            (:func:`kbit_linear.hadamard.layer_seed`). Experts modules are not rotated.
        target_bpw: choose each ``nn.Linear``'s width from 2..5 so that the mean index width
            over their weights is at most this (e.g. ``3.5``), by each layer's measured error at
            every width (:mod:`kbit_linear.allocation`, data-free; with ``calibration`` the
            widths are chosen the same way, then the layers are rounded with it). Quantizes
            every weight once per width first (about 4x the data-free quantization time).
            Experts modules take part with one width per module (measured where they are;
            :mod:`kbit_linear.allocation` says how their error counts); ``bits`` is then unused.
            The choice is in ``summary.layer_bits``. Not with a codebook tensor (it has one width); with
            ``codebook="fitted"`` each width's error is measured with its fitted levels.
        hadamard_search: with ``hadamard``, try this many sign vectors per layer and keep the
            one whose rotated weight quantizes with the least error (data-free, also before
            calibrated rounding; :func:`kbit_linear.quantizer.hadamard_signs_for`); 1 = the
            layer's seeded vector. Costs that many quantizations per layer more. With
            ``target_bpw`` the widths are chosen with each layer's seeded vector (the search
            runs once, at the chosen width).
        fuse: quantize each group of sibling projections that read one input
            (:data:`kbit_linear.fusion.DEFAULT_GROUPS`: q/k/v, gate/up, DeepSeek's
            q_a_proj/kv_a_proj_with_mqa; not in cross-attention) with one set of levels
            (fitted to the group's weights together where ``codebook`` fits levels per weight),
            one tensor scale (the largest of theirs) and one Hadamard rotation (the group's first
            layer's seed), then run each group as
            one GEMM (:func:`kbit_linear.fusion.fuse_projections`): fewer, larger GEMM calls, the
            same memory and state dict. Groups whose layers get different widths (``target_bpw``)
            stay apart. Not with ``hadamard_search`` > 1. The top-k routers of MoE blocks then
            run as one kernel each (:func:`kbit_linear.router.fuse_routers`; their weights stay
            as they are).

    Returns:
        A :class:`QuantizationSummary`: converted names, skipped names with reasons, bytes
        (the experts modules' bytes apart).

    Raises:
        TypeError / ValueError: bad arguments.
        ValueError: a layer that should be converted cannot be quantized (e.g. NaN/Inf
            weights); the message names the layer. Layers converted before it stay converted,
            and ``save_pretrained`` refuses the half-converted model as it does a quantized one.
    """
    fmt.check_module(model, "model")
    if isinstance(model, nn.Linear):
        raise TypeError("model is a bare nn.Linear, which cannot be replaced in place; use KbitLinear.from_linear(model, bits)")
    fmt.check_bits(bits)
    fmt.check_bool("hadamard", hadamard)
    fmt.check_bool("fuse", fuse)
    codebook = codebooks.resolve_default(codebook, hadamard, calibrated=calibration is not None)
    hadamard_search = check_hadamard_search(hadamard_search, hadamard=hadamard, fuse=fuse)
    rules = check_skip_rules(skip)
    # rules the caller wrote: a misspelled one would quantize what it meant to keep
    unmatched = warn_unmatched_skip_rules(model, rules, "skip") if skip is not DEFAULT_SKIP else []
    if target_bpw is not None:
        target_bpw = allocation.check_target_bpw(target_bpw)
        allocation.check_codebook_for_widths(codebook)
    # fail before the first layer is touched, not halfway through the model
    codebook = codebooks.check_codebook_option(codebook, bits)
    target = fmt.check_device(device)
    if isinstance(calibration, torch.Tensor):
        calibration = Calibration(tokens=calibration)
    if calibration is not None:
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration, a tensor of token ids or None, got {type(calibration).__name__}")
        if target is not None:
            raise ValueError("calibration runs the model where it is: move the model first instead of passing device")
        check_calibration_model(model)  # an encoder-decoder model would fail inside transformers
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("calibration needs a model with real weights, not on the meta device")
        batches = calibration.batches()  # tokenize before the first layer is touched
        embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
        vocab = getattr(embeddings, "num_embeddings", None)
        if isinstance(vocab, int) and batches:
            lo, hi = min(int(b.min()) for b in batches), max(int(b.max()) for b in batches)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"calibration tokens must be ids in [0, {vocab}) (the model's vocabulary), got values "
                                 f"from {lo} to {hi}")

    summary = QuantizationSummary(bits=bits, bytes_before=module_bytes(model))
    summary.unmatched_skip = unmatched
    # The modules the model keeps in float32 stay dense, as transformers' quantizers and this
    # package's plug-in keep them (T5 casts ``wo``'s input to that layer's weight dtype).
    keep = [m for m in (getattr(model, "_keep_in_fp32_modules", None) or ()) if isinstance(m, str) and m]
    # Names, not modules: a dense layer must be unreferenced once swapped out.
    to_convert, summary.skipped = convertible_layers(model, (*rules, *keep))
    experts_to_convert, experts_skipped = convertible_experts(model, (*rules, *keep))
    summary.skipped.update(experts_skipped)
    for name in summary.skipped:
        if keep and matches_skip(name, rules) is None and matches_skip(name, keep) is not None:
            summary.skipped[name] = "kept in float32 by the model (_keep_in_fp32_modules)"

    converted: dict[int, KbitLinear] = {}  # a Linear reused under several names -> one KbitLinear
    layer_bits: dict[str, int] = {}
    if target_bpw is not None:
        if any(model.get_submodule(n).weight.device.type == "meta" for n in to_convert) or any(
                getattr(model.get_submodule(n), p).device.type == "meta" for n in experts_to_convert for p in PROJECTIONS):
            raise ValueError("target_bpw measures each layer's weight: it needs real weights, not the meta device")
        first = {}  # a Linear reused under several names is measured (and counted) once
        for name in to_convert:
            first.setdefault(id(model.get_submodule(name)), name)
        # layers measured where they will be quantized (``device``); experts where they are
        for name in experts_to_convert:
            first.setdefault(id(model.get_submodule(name)), name)
        firsts = set(first.values())
        experts_at = ((n, {p: getattr(model.get_submodule(n), p) for p in PROJECTIONS}) for n in experts_to_convert if n in firsts)
        weights_at = ((n, model.get_submodule(n).weight if target is None else model.get_submodule(n).weight.to(target))
                      for n in to_convert if n in firsts)
        chosen = allocation.plan_layer_bits(weights_at, target_bpw, codebook=codebook, scale_search=scale_search,
                                            hadamard=hadamard, progress=progress, experts=experts_at)
        layer_bits = {n: chosen[first[id(model.get_submodule(n))]] for n in (*to_convert, *experts_to_convert)}
        experts_set = set(experts_to_convert)
        weights = {n: sum(getattr(model.get_submodule(n), p).numel() for p in PROJECTIONS) if n in experts_set
                   else model.get_submodule(n).weight.numel() for n in firsts}
        summary.layer_bits = layer_bits
        summary.mean_layer_bits = sum(chosen[n] * k for n, k in weights.items()) / max(1, sum(weights.values()))

    group_of = sibling_groups(to_convert, layer_bits, bits, model) if fuse else {}
    group_shared: dict[tuple[str, ...], GroupShared | None] = {}  # each group's levels and scale, found at its first layer

    def convert(name: str, hessian: torch.Tensor | None = None) -> None:
        linear = model.get_submodule(name)
        if id(linear) in converted:
            replace_module(model, name, converted[id(linear)])
            summary.converted.append(name)
            return
        before = sum(t.numel() * t.element_size() for t in linear.parameters(recurse=False))
        src = linear
        if target is not None and linear.weight.device != target:
            src = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
            src.weight = nn.Parameter(linear.weight.detach().to(target), requires_grad=False)
            if linear.bias is not None:
                src.bias = nn.Parameter(linear.bias.detach().to(target), requires_grad=linear.bias.requires_grad)
        try:
            group = group_of.get(name)
            rotation = {"hadamard": hadamard, "hadamard_seed": hd.layer_seed(group[0] if group else name),
                        "hadamard_search": hadamard_search}
            width = layer_bits.get(name, bits)
            levels, shared_scale = codebook, None
            if group is not None:
                if group not in group_shared:
                    group_shared[group] = shared_quantization(model, group, codebook, width, scale_search, hadamard,
                                                              rotation["hadamard_seed"], src.weight.device)
                if group_shared[group] is not None:
                    levels, shared_scale = group_shared[group]
            if hessian is None:
                new = KbitLinear.from_linear(src, bits=width, codebook=levels, scale_search=scale_search,
                                             tensor_scale=shared_scale, **rotation)
            else:
                new = KbitLinear.from_linear(src, bits=width, codebook=levels, scale_search=scale_search, tensor_scale=shared_scale,
                                             hessian=hessian, damp=calibration.damp, lazy_block=calibration.lazy_block,
                                             act_order=calibration.act_order, **rotation)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot quantize layer {name!r} ({linear.out_features}x{linear.in_features}): {e}") from e
        new.train(linear.training)
        replace_module(model, name, new)
        converted[id(linear)] = new
        summary.converted.append(name)
        summary.converted_bytes_before += before
        summary.converted_bytes_after += sum(t.numel() * t.element_size() for t in (*new.parameters(), *new.buffers()))

    width = f"{summary.mean_layer_bits:.2f} bits mean" if layer_bits else f"{bits} bits"
    try:
        if calibration is None:
            for name in tqdm(to_convert, desc=f"kbit quantize ({width})", unit="layer", disable=not progress):
                convert(name)
        else:
            calibrate_model(model, to_convert, batches, convert, progress=progress, desc=f"kbit calibrate ({width})")

        converted_experts: dict[int, KbitExperts] = {}
        for name in tqdm(experts_to_convert, desc=f"kbit quantize experts ({width})", unit="module",
                         disable=not progress or not experts_to_convert):
            module = model.get_submodule(name)
            if id(module) not in converted_experts:
                try:
                    new = KbitExperts.from_experts(module, bits=layer_bits.get(name, bits), codebook=codebook,
                                                   scale_search=scale_search, device=target)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"cannot quantize experts {name!r}: {e}") from e
                converted_experts[id(module)] = new
                summary.experts_bytes_before += sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
                summary.experts_bytes_after += sum(t.numel() * t.element_size() for t in (*new.parameters(), *new.buffers()))
                del new
            replace_module(model, name, converted_experts[id(module)])
            summary.experts.append(name)
            del module

        if fuse:
            summary.fusion = fuse_projections(model)
            summary.routers = fuse_routers(model)
    finally:
        # Also when a layer fails midway: the layers before it are swapped already, and a
        # checkpoint saved by transformers would not load back.
        if summary.converted or summary.experts:
            _guard_save_pretrained(model)
    summary.bytes_after = module_bytes(model)
    return summary


def _guard_save_pretrained(model: nn.Module) -> None:
    """Make a transformers model's ``save_pretrained`` refuse (by name) a model holding kbit
    modules that was not loaded through the plug-in: it would write a config without
    quantization_config, whose checkpoint neither from_pretrained nor load_into can read back."""
    if callable(getattr(model, "save_pretrained", None)) and getattr(model, "hf_quantizer", None) is None:
        model.save_pretrained = _refuse_save_pretrained


def _refuse_save_pretrained(*args: object, **kwargs: object) -> None:
    raise ValueError(
        "a model quantized with quantize_model cannot be saved with save_pretrained: its config.json has no "
        "quantization_config, so from_pretrained would find kbit tensors it cannot read. Save it with "
        "kbit_linear.save_quantized(model, 'model.safetensors') and load it into a model of the same config with "
        "kbit_linear.load_into(model, 'model.safetensors'), or quantize at load with from_pretrained(..., "
        "quantization_config=kbit_linear.KbitConfig(...)), whose save_pretrained writes a checkpoint that reloads")


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Give every kbit layer of ``model`` a dense ``nn.Linear`` back, in place: the inverse of
    :func:`quantize_model` up to the quantization error (the weight is the layer's dequantized one).

    Fused projections and routers are unfused first. The dense weights are trainable parameters,
    as a freshly built ``nn.Linear``'s; each bias is kept as it is. :class:`KbitExperts` become
    the dense experts modules they replaced (:meth:`KbitExperts.to_dense`).

    Args:
        model: the model.
        dtype: the dense weights' dtype (default: each layer's ``compute_dtype``, the dtype of the
            dense layer it stands for).

    Returns:
        The number of layers and experts modules restored.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``dtype`` not a floating-point dtype.
        NotImplementedError: a :class:`KbitExperts` that does not know its dense class (built
            directly), before anything is changed.
    """
    fmt.check_module(model, "model")
    if dtype is not None:
        fmt.check_float_dtype(dtype)
    experts = [name for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, KbitExperts)]
    unknown = [name for name in experts if model.get_submodule(name).__dict__.get("_dense_outline") is None]
    if unknown:
        raise NotImplementedError(f"dequantize_model: KbitExperts modules ({unknown[0]}, ...) built directly do not know the "
                                  "dense experts class they stand for; nothing was changed")
    unfuse_routers(model)
    unfuse_projections(model)
    dense: dict[int, nn.Linear] = {}  # a layer reused under several names -> one nn.Linear
    names = [name for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, KbitLinear)]
    for name in names:
        layer = model.get_submodule(name)
        if id(layer) not in dense:
            to = dtype or layer.compute_dtype
            linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(layer.dequantize(to))
            bias = layer.bias
            if bias is not None and bias.dtype != to:  # (a dtype asked for: weight and bias agree)
                bias = nn.Parameter(bias.detach().to(to), requires_grad=bias.requires_grad)
            linear.bias = bias
            linear.train(layer.training)
            dense[id(layer)] = linear
        replace_module(model, name, dense[id(layer)])
    for name in experts:
        module = model.get_submodule(name)
        if id(module) not in dense:
            dense[id(module)] = module.to_dense(dtype)
        replace_module(model, name, dense[id(module)])
    if model.__dict__.get("save_pretrained") is _refuse_save_pretrained:  # dense again: transformers' own saves it
        del model.__dict__["save_pretrained"]
    return len(names) + len(experts)


def sibling_groups(names: Iterable[str], layer_bits: dict[str, int], bits: int,
                   model: nn.Module | None = None) -> dict[str, tuple[str, ...]]:
    """layer name -> its group of sibling projections (:data:`kbit_linear.fusion.DEFAULT_GROUPS`,
    full names), for the groups whose layers are all in ``names`` and have one width
    (``layer_bits``, else ``bits``), and, given ``model``, whose parent is not cross-attention
    (:func:`kbit_linear.fusion.is_cross_attention`: never fused, so never quantized together).

    Raises:
        TypeError: ``names`` not an iterable of str (one str is refused, not taken character by
            character), ``layer_bits`` not a dict, ``model`` neither an ``nn.Module`` nor ``None``.
        TypeError / ValueError: ``bits`` not an int in 2..5.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(f"names must be an iterable of layer names (str), got {type(names).__name__}")
    todo = set(names)
    bad = next((n for n in todo if not isinstance(n, str)), None)
    if bad is not None:
        raise TypeError(f"names must hold str layer names, got {type(bad).__name__}")
    if not isinstance(layer_bits, dict):
        raise TypeError(f"layer_bits must be a dict of layer name -> bits, got {type(layer_bits).__name__}")
    fmt.check_bits(bits)
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
    out: dict[str, tuple[str, ...]] = {}
    for name in todo:
        parent, _, child = name.rpartition(".")
        if model is not None and is_cross_attention(parent, model.get_submodule(parent)):
            continue
        for group in DEFAULT_GROUPS:
            if child != group[0]:
                continue
            full = tuple(f"{parent}.{n}" if parent else n for n in group)
            if all(n in todo for n in full) and len({layer_bits.get(n, bits) for n in full}) == 1:
                out.update({n: full for n in full})
    return out


def shared_quantization(model: nn.Module, group: tuple[str, ...], codebook: torch.Tensor | str | None, bits: int,
                        scale_search: bool, hadamard: bool, seed: int, device: torch.device) -> GroupShared | None:
    """The levels and tensor scale a group of sibling projections shares
    (:func:`kbit_linear.quantizer.group_quantization` on their weights, rotated by the group's
    signs with ``hadamard``), on ``device``; ``None`` where a layer of the group was converted
    already (shared with another group: each layer keeps its own, and fuse_projections leaves
    the group apart if they differ)."""
    layers = [model.get_submodule(n) for n in group]
    if not all(isinstance(m, nn.Linear) for m in layers):
        return None
    signs = hd.random_signs(layers[0].in_features, seed, device) if hadamard else None
    return group_quantization([m.weight for m in layers], bits, codebook, scale_search=scale_search, hadamard_signs=signs,
                              device=device)
