"""kbit_linear: 2- to 5-bit codebook weights for ``nn.Linear`` with fused CUDA kernels.

``import kbit_linear`` registers the ``torch.ops.kbit_linear`` ops (the pure-PyTorch reference for
every device, the CUDA kernels for CUDA tensors; CuPy is imported only at the first CUDA call) and
the transformers plug-in (``quant_method="kbit"``).
"""

from __future__ import annotations

from . import _ops  # noqa: F401  (op schemas + reference implementations)
from . import _gguf_ops  # noqa: F401  (GGUF block-format op schemas + references)
from .backends import cuda as _cuda_backend  # noqa: F401  (CUDA implementations; imports no CuPy)
from .backends import cpu as _cpu_backend  # noqa: F401
from .calibration import Calibration
from .experts import KbitExperts
from .fusion import fuse_projections, unfuse_projections
from .format import KbitWeight, create_normal_float_codebook, dequantize, matmul, quantize
from .gguf_linear import GGUFEmbedding, GGUFLinear
from .gguf_loader import load_gguf  # imports gguf and the transformers GGUF reader only when called
from .kv_cache import KbitKVCache  # also registers the "kbit_kv" attention with transformers
from .kv_graph import KbitDecodeGraph
from .linear import KbitLinear
from .parallel import shard_for_tensor_parallel
from .router import fuse_routers, unfuse_routers
from .patch import QuantizationSummary, dequantize_model, quantize_model
from .serialization import CheckpointError, load_into, load_quantized, save_quantized

__version__ = "0.1.0"

__all__ = [
    "Calibration",
    "CheckpointError",
    "GGUFEmbedding",
    "GGUFLinear",
    "KbitConfig",
    "KbitDecodeGraph",
    "KbitExperts",
    "KbitKVCache",
    "KbitLinear",
    "KbitWeight",
    "QuantizationSummary",
    "create_normal_float_codebook",
    "dequantize",
    "dequantize_model",
    "fuse_projections",
    "fuse_routers",
    "load_gguf",
    "load_into",
    "load_quantized",
    "matmul",
    "quantize",
    "quantize_model",
    "save_quantized",
    "shard_for_tensor_parallel",
    "unfuse_projections",
    "unfuse_routers",
]

try:
    from .integrations.transformers import KbitConfig
    from .integrations.transformers import register as _register_transformers
except ImportError as _err:  # transformers missing or too old: everything else still works
    _transformers_error = str(_err)

    class KbitConfig:  # type: ignore[no-redef]
        """Placeholder: the transformers plug-in could not be loaded."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise ImportError(f"KbitConfig needs the transformers plug-in, which failed to load: {_transformers_error}")

else:
    _register_transformers()
