"""msa_pallas: fused MSA row attention with pair bias for JAX.

    out = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate)

Modules:
  attention    the public op, and `explain`, which shows what a call runs
  dispatch     which kernels run a call, with which tiles, and why
  reference    the plain-jnp path (also the test reference)
  kernels      the Pallas forward and backward kernels and their custom VJP
  block_sizes  tile choice
  autotune     optional tile timing on the user's GPU, cached on disk
  timing       the batched timing loop of the autotuner and the benchmarks
  validation   trace-time argument checks
  layer_core   the maths the linen, NNX and Haiku layers share (no Flax)
  layers       the flax.linen layer MSARowAttentionWithPairBias
  nnx_layers   the same layer in flax.nnx
  haiku        AlphaFold2's Haiku module on the fused op (optional dm-haiku)
  triangle     triangle attention (starting / ending node), linen and NNX
  haiku_triangle  AlphaFold2's Haiku TriangleAttention on the fused op
  alphafold2   the patch that puts the Haiku drop-ins into AlphaFold2's model
  dot_product_attention  tokamax's / AlphaFold3's attention call on the op
  convert      weight converters (PyTorch reference, OpenFold, AlphaFold2;
               the triangle modules' in convert_triangle)
  weight_checks  reading the converters' weight dictionaries
  sharding, exporting  several devices; jax.export for a GPU target
"""

from msa_pallas.attention import explain, msa_row_attention, resolve_implementation
from msa_pallas.block_sizes import BlockConfig, KernelTiles, default_block_config
from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles
from msa_pallas.layers import MSARowAttentionWithPairBias
from msa_pallas.nnx_layers import MSARowAttentionWithPairBiasNNX
from msa_pallas.triangle import TriangleAttention, TriangleAttentionNNX
from msa_pallas.dot_product_attention import dot_product_attention
from msa_pallas import autotune, convert, dispatch
from msa_pallas.dispatch import CallPlan
from msa_pallas.kernels.key_tiles import skipping_padding

__all__ = [
    "msa_row_attention",
    "explain",
    "CallPlan",
    "skipping_padding",
    "resolve_implementation",
    "BlockConfig",
    "KernelTiles",
    "MosaicTiles",
    "MosaicBackwardTiles",
    "default_block_config",
    "MSARowAttentionWithPairBias",
    "MSARowAttentionWithPairBiasNNX",
    "TriangleAttention",
    "TriangleAttentionNNX",
    "dot_product_attention",
    "autotune",
    "convert",
    "dispatch",
]
__version__ = "0.1.0"
