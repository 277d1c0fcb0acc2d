"""The CUDA backend: kernels in ``kernels/`` compiled at run time through CuPy, and the ops on them.

Importing this package registers the ``torch.library`` CUDA implementations of the
``kbit_linear`` ops (:mod:`.ops`); it needs neither CuPy nor a GPU to import. Its modules, each
with one job:

* :mod:`.ops`: the op implementations and the GEMM dispatcher (which path a problem takes, the
  fused kernel's launch plan);
* :mod:`.decode`: the small-M decode kernel's launch plans and schedules (also its grouped form
  for mixture-of-experts layers);
* :mod:`.routing`: the routing kernel of mixture-of-experts layers;
* :mod:`.router`: their router (logits, softmax, top-k) in one launch;
* :mod:`.experts`: the element-wise kernels around their grouped GEMMs (SwiGLU, the weighted combine);
* :mod:`.experts_token`: one token through the experts in two launches (a decode step of batch 1);
* :mod:`.gguf`: the GGUF block-format kernels (dequantize, small-M GEMM) and their ops;
* :mod:`.kv_attention`: the fused decode attention over the quantized KV cache;
* :mod:`.kv_append`: a decode step's new tokens into the KV cache's 8-bit bucket;
* :mod:`.hadamard`: the Hadamard rotation of a rotated layer's input;
* :mod:`.hopper`: the Hopper wgmma kernel's instances, shared-memory size and which GPUs run it;
* :mod:`.grouped`: the Hopper wgmma kernel's grouped form (mixture-of-experts layers): plans, launch;
* :mod:`.tuning`: every dispatch threshold and launch-shape table, with its provenance;
* :mod:`.loader`: finding, compiling (NVRTC through CuPy) and launching kernels, per device;
* :mod:`.driver`: the few CUDA driver calls that neither torch nor CuPy expose;
* :mod:`.workspace`: the persistent split-K scratch buffers.
"""

from __future__ import annotations

from . import gguf as _gguf  # noqa: F401  (registers the GGUF ops' CUDA implementations)
from . import kv_attention as _kv_attention  # noqa: F401  (registers the KV-cache decode attention)
from . import kv_append as _kv_append  # noqa: F401  (registers the KV cache's 8-bit append)
from . import hadamard as _hadamard  # noqa: F401  (registers the Hadamard rotation's CUDA implementation)
from . import router as _router  # noqa: F401  (registers the one-launch MoE router)
from .ops import (
    GEMM_PATHS,
    dequantize_cuda,
    format_instances,
    gemm_cuda,
    gemm_instances,
    gemm_path,
    quantize_cuda,
    repack_cuda,
)

__all__ = [
    "GEMM_PATHS",
    "dequantize_cuda",
    "format_instances",
    "gemm_cuda",
    "gemm_instances",
    "gemm_path",
    "quantize_cuda",
    "repack_cuda",
]
