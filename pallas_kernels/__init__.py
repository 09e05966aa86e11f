"""Pallas Mosaic GPU kernels of UniEP-JAX."""

from pallas_kernels import device
from pallas_kernels.grouped_gemm import (
    gmm,
    gmm_dgrad,
    gmm_wgrad,
    grouped_matmul,
    grouped_swiglu_ffn,
    reference_gmm,
    reference_gmm_dgrad,
    reference_gmm_wgrad,
    reference_swiglu_ffn,
    smem_bytes,
)

__all__ = [
    "device",
    "gmm",
    "gmm_dgrad",
    "gmm_wgrad",
    "grouped_matmul",
    "grouped_swiglu_ffn",
    "reference_gmm",
    "reference_gmm_dgrad",
    "reference_gmm_wgrad",
    "reference_swiglu_ffn",
    "smem_bytes",
]
