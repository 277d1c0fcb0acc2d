"""LoRA adapters (PEFT) on :class:`~kbit_linear.KbitLinear` layers: QLoRA with kbit weights.

PEFT wraps layer types it knows; a ``KbitLinear`` is added to a :class:`peft.LoraConfig` through
PEFT's custom-module mapping (``LoraConfig._register_custom_module``, PEFT's documented extension
point for layers it does not ship), after which the usual recipe runs unchanged::

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from kbit_linear.integrations.peft import register_lora_layers, load_adapter

    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    config = register_lora_layers(LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), model)
    model = get_peft_model(model, config)          # LoRA on every KbitLinear (and dense Linear)
    ...train...
    model.save_pretrained("adapter/")              # the adapter only, as PEFT saves it
    model = load_adapter(base_model, "adapter/")   # PeftModel.from_pretrained with the mapping

How the layer works (:class:`KbitLoraLinear`): it is PEFT's own LoRA ``Linear`` (so adapters,
dropout, scaling, rsLoRA, adapter switching and mixed batches behave as PEFT documents) around
the frozen ``KbitLinear``: ``y = kbit(x) + B(A(dropout(x))) * scaling``. Gradients reach the
adapter through the kbit op's backward (``kbit_linear::gemm`` differentiates with respect to x;
the quantized weight stays frozen and no dense copy of it outlives a call).

Merging (``merge_and_unload``, ``merge_adapter``): the quantized weight cannot absorb a
low-rank update, so merging replaces the layer's base by a dense ``nn.Linear`` holding the
dequantized weight plus the update (in the dtype of the kbit layer's bias; where there is none,
in the dtype of the inputs of the layer's last forward, else in the layer's ``compute_dtype``: the
dtype of the dense layer it was made from, or of the model's last cast).
``merge_and_unload`` therefore returns a dense model; quantize it again with
:func:`kbit_linear.quantize_model` to store it in kbit. ``unmerge`` puts the original kbit layer
back, bit for bit. What needs the dense base weight is refused with a ValueError: DoRA
(``use_dora``, in every forward), KaSA (``kasa_config``) and the initialisations that read or
rewrite the base weight (``init_lora_weights`` "pissa...", "corda...", "olora", "mica", "loftq",
"orthogonal"). ``fan_in_fan_out=True`` is set to False with a warning, as PEFT does for
``nn.Linear`` (a ``KbitLinear`` stores its weight as ``[out_features, in_features]``).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import torch
from torch import nn

try:
    import peft
    from peft.tuners.lora.layer import Linear as _PeftLoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
except ImportError as exc:  # pragma: no cover - exercised only without peft
    raise ImportError("kbit_linear.integrations.peft needs PEFT: pip install peft") from exc

from ..fusion import KbitLinearSlice
from ..linear import KbitLinear

__all__ = ["KbitLoraLinear", "register_lora_layers", "load_adapter"]


class KbitLoraLinear(_PeftLoraLinear):
    """PEFT's LoRA ``Linear`` around a frozen :class:`~kbit_linear.KbitLinear`.

    Built by PEFT (``get_peft_model``) for every targeted ``KbitLinear`` once the config carries
    the mapping (:func:`register_lora_layers`); takes the arguments PEFT passes its own LoRA
    layers, whatever the PEFT version.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config")
        fan_in_fan_out = getattr(config, "fan_in_fan_out", False) if config is not None else kwargs.get("fan_in_fan_out", False)
        if fan_in_fan_out:
            # as PEFT does for nn.Linear: a transposed delta would be merged into [out, in] otherwise
            warnings.warn("fan_in_fan_out is set to True but the target module is a KbitLinear (weight [out_features, "
                          "in_features], as nn.Linear). Setting fan_in_fan_out to False.")
            if config is not None:
                config.fan_in_fan_out = False
            else:  # pragma: no cover - PEFT versions that pass the options one by one
                kwargs["fan_in_fan_out"] = False
        base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
        if not isinstance(base, KbitLinear):
            raise TypeError(f"KbitLoraLinear wraps a KbitLinear, got {type(base).__name__}")
        super().__init__(base_layer, adapter_name, *args, **kwargs)
        self._quantized_base: KbitLinear | None = None  # the kbit layer while a dense merged copy replaces it
        self._input_dtype: torch.dtype | None = None  # of the last forward's input: the merged copy's dtype without a bias

    def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        # every adapter comes through here (the first from __init__, later ones from add_adapter / load_adapter)
        config = kwargs.get("config")

        def option(name: str, default: Any) -> Any:
            return getattr(config, name, default) if config is not None else kwargs.get(name, default)

        if option("use_dora", False):
            raise ValueError("DoRA is not supported on kbit layers (it needs the dense base weight in every forward); "
                             "use plain LoRA (use_dora=False)")
        if option("kasa_config", None) is not None:
            raise ValueError("KaSA (kasa_config) is not supported on kbit layers (it decomposes and truncates the dense "
                             "base weight); use plain LoRA (kasa_config=None)")
        init = option("init_lora_weights", True)
        if isinstance(init, str) and _reads_base_weight(init):
            raise ValueError(f"init_lora_weights={init!r} is not supported on kbit layers (it reads or rewrites the dense "
                             "base weight); use True, 'gaussian' or 'eva', or initialise on the dense model and "
                             "quantize afterwards")
        super().update_layer(adapter_name, *args, **kwargs)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            self._input_dtype = x.dtype
        return super().forward(x, *args, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        # PEFT asks its layer for the base's sizes (and warns about types it does not know).
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        return base.in_features, base.out_features

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge adapters into a dense copy of the base (see the module docstring); the kbit layer is kept for :meth:`unmerge`."""
        # only this layer's adapters: one that targets other layers only has nothing to merge here
        adapter_names = [name for name in check_adapters_to_merge(self, adapter_names) if name in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        if isinstance(base, KbitLinear):
            self._quantized_base = base
            self.base_layer = _dense_copy(base, self._input_dtype or base.compute_dtype)
        try:
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        except BaseException:
            if not self.merged and self._quantized_base is not None:  # nothing merged: the kbit layer back, as it was
                self.base_layer = self._quantized_base
                self._quantized_base = None
            raise

    def unmerge(self) -> None:
        """Take merged adapters out again; once none is merged, the original kbit layer is back."""
        super().unmerge()
        if not self.merged and self._quantized_base is not None:
            self.base_layer = self._quantized_base
            self._quantized_base = None


_BASE_WEIGHT_INITS = ("olora", "mica", "loftq", "orthogonal")  # init_lora_weights that need the dense base weight
_BASE_WEIGHT_INITS_PREFIX = ("pissa", "corda")  # and those with variants ("pissa_niter_4")


def _reads_base_weight(init: str) -> bool:
    """Whether the LoRA initialisation ``init_lora_weights=init`` reads or rewrites the dense base weight."""
    return init.lower().startswith(_BASE_WEIGHT_INITS_PREFIX) or init.lower() in _BASE_WEIGHT_INITS


def _dense_copy(layer: KbitLinear, fallback_dtype: torch.dtype) -> nn.Linear:
    """A dense ``nn.Linear`` with the kbit layer's dequantized weight and its bias."""
    dtype = layer.bias.dtype if layer.bias is not None else fallback_dtype
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=layer.weight.device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantize(dtype))
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    dense.requires_grad_(False)
    return dense


def register_lora_layers(config: "peft.LoraConfig", model: nn.Module | None = None) -> "peft.LoraConfig":
    """Let PEFT put LoRA on :class:`~kbit_linear.KbitLinear` layers; returns ``config`` (changed in place).

    PEFT's ``target_modules="all-linear"`` shorthand finds ``nn.Linear`` layers only, so with it
    pass ``model``: the shorthand is then spelled out as every ``nn.Linear`` and ``KbitLinear``
    except the output embedding, as PEFT does for dense models.

    Raises:
        TypeError: ``config`` is not a :class:`peft.LoraConfig`.
        ValueError: ``config`` says "all-linear" and no ``model`` was given (the kbit layers would
            be left out without a word).
    """
    if not isinstance(config, peft.LoraConfig):
        raise TypeError(f"config must be a peft.LoraConfig, got {type(config).__name__}")
    if model is not None:
        _refuse_fused(model)
    targets = config.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":
        if model is None:
            raise ValueError('target_modules="all-linear" matches nn.Linear only: call register_lora_layers(config, model) '
                             "so that the KbitLinear layers are spelled out too")
        config.target_modules = _all_linear_names(model)
    config._register_custom_module({KbitLinear: KbitLoraLinear, KbitLinearSlice: _FusedPartRefused})
    return config


class _FusedPartRefused(nn.Module):
    """What PEFT would build for a targeted fused part (:class:`~kbit_linear.fusion.KbitLinearSlice`,
    when :func:`register_lora_layers` got no model to check): a clear error instead."""

    def __init__(self, base_layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise ValueError(f"a fused projection ({base_layer!r}) cannot take an adapter: call "
                         "kbit_linear.unfuse_projections(model) before adding adapters")


def _refuse_fused(model: nn.Module) -> None:
    """Refuse a model with fused projections (:mod:`kbit_linear.fusion`): PEFT wraps single
    layers, and a fused part is a slice of a shared GEMM that no adapter could be added to."""
    fused = [n for n, m in model.named_modules() if isinstance(m, KbitLinearSlice)]
    if fused:
        raise ValueError(f"the model runs fused projections ({', '.join(fused[:3])}{' ...' if len(fused) > 3 else ''}): "
                         "call kbit_linear.unfuse_projections(model) before adding adapters")


def _all_linear_names(model: nn.Module) -> set[str]:
    """Full names of the ``nn.Linear`` and ``KbitLinear`` layers of ``model``, less its output embedding.

    A model that already has adapters (a ``PeftModel``, or the model inside one): the names are
    those of its underlying model, where PEFT looks for them, and a layer that already carries an
    adapter is named as the layer, not by its parts (``base_layer``, ``lora_A.<name>``, ...)."""
    if isinstance(model, peft.PeftModel):
        model = model.get_base_model()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(output, BaseTunerLayer):
        output = output.get_base_layer()
    parts = {id(p) for m in model.modules() if isinstance(m, BaseTunerLayer) for p in m.modules() if p is not m}
    names = set()
    for n, m in model.named_modules():
        base = m.get_base_layer() if isinstance(m, BaseTunerLayer) else m
        if id(m) not in parts and isinstance(base, (nn.Linear, KbitLinear)) and base is not output:
            names.add(n)
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear or KbitLinear layer to put LoRA on")
    return names


def load_adapter(model: nn.Module, adapter: str | os.PathLike[str], adapter_name: str = "default", **kwargs: Any) -> "peft.PeftModel":
    """``PeftModel.from_pretrained`` for a model with kbit layers: the saved LoRA config gets the
    mapping of :func:`register_lora_layers` first (a config read from disk does not carry it).

    Args:
        model: the base model (kbit layers in place).
        adapter: a folder (or Hub id) that ``save_pretrained`` of a PEFT model wrote.
        adapter_name: name of the loaded adapter.
        **kwargs: passed on to ``PeftModel.from_pretrained`` (``is_trainable``, ``subfolder``,
            ``revision``, ...; the config is read from the same ``subfolder`` and ``revision``).
    """
    # where PeftModel.from_pretrained reads the config: the same subfolder / revision as the weights
    hub = {k: kwargs[k] for k in ("subfolder", "revision", "cache_dir", "token") if kwargs.get(k) is not None}
    config = peft.PeftConfig.from_pretrained(adapter, **hub)
    if not isinstance(config, peft.LoraConfig):
        raise ValueError(f"{adapter} holds a {type(config).__name__}; kbit layers take LoRA adapters")
    init = config.init_lora_weights
    if isinstance(init, str) and _reads_base_weight(init):
        # PEFT would run the initialisation again on the base weights before loading the saved
        # adapter over it; its own examples set the saved config to True first
        raise ValueError(f"{adapter}: the adapter's config has init_lora_weights={init!r}, which would run that "
                         "initialisation again on the (kbit) base weights; save it with init_lora_weights=True "
                         "(set in its adapter_config.json, on a base that already holds the residual weights) or "
                         "converted to plain LoRA (save_pretrained(..., path_initial_model_for_weight_conversion=...))")
    params = inspect.signature(peft.PeftModel.from_pretrained).parameters
    if "config" not in params:  # pragma: no cover - every PEFT this supports has it
        raise RuntimeError("this PEFT version's PeftModel.from_pretrained takes no config")
    return peft.PeftModel.from_pretrained(model, adapter, adapter_name=adapter_name, config=register_lora_layers(config, model), **kwargs)
