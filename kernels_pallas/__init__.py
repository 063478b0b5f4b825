"""Low-precision formats (MXFP8, NVFP4) and Pallas grouped-matmul kernels for MoE layers; see README.md."""
from kernels_pallas.formats import MXFP8Array, NVFP4Array, dequantize, quantize, quantize_mxfp8, quantize_nvfp4
from kernels_pallas.grouped_matmul import BlockSizes, grouped_matmul, grouped_matmul_reference
from kernels_pallas.moe_matmul import MoeMatmulConfig, moe_matmul
from kernels_pallas.transposed_grouped_matmul import (
  transposed_grouped_matmul,
  transposed_grouped_matmul_reference,
)

__all__ = ["BlockSizes", "MXFP8Array", "MoeMatmulConfig", "NVFP4Array", "dequantize", "grouped_matmul",
           "grouped_matmul_reference", "moe_matmul", "quantize", "quantize_mxfp8", "quantize_nvfp4",
           "transposed_grouped_matmul", "transposed_grouped_matmul_reference"]
