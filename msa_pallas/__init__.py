"""msa_pallas: fused MSA row attention with pair bias for JAX.

    out = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate)

Modules:
  attention    the public op and its dispatch
  reference    the plain-jnp path (also the test reference)
  kernels      the Pallas forward and backward kernels and their custom VJP
  block_sizes  tile choice
  validation   trace-time argument checks
"""

from msa_pallas.attention import msa_row_attention
from msa_pallas.block_sizes import BlockConfig, KernelTiles, default_block_config

__all__ = ["msa_row_attention", "BlockConfig", "KernelTiles", "default_block_config"]
__version__ = "0.1.0"
