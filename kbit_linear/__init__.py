"""kbit_linear: 2- to 5-bit codebook weights for nn.Linear with fused CUDA kernels."""
from . import _ops  # noqa: F401  (registers the torch.library ops)
from .format import KbitWeight, create_normal_float_codebook, dequantize, matmul, quantize
