"""The kernels of MSA row attention, one folder per Pallas backend.

- `triton/`: the Triton kernels (any CUDA GPU; float32 with 3xTF32 products):
  forward, backward (dk/dv, dq, bias gradient) and their tile helpers.
- `mosaic/`: the Mosaic GPU kernels (Hopper, 16-bit; float32 in the backward
  as bf16 pieces): the forward and the dk/dv, dq and dbias kernels.
- `constants`: what every backend shares (base-2 logits, the masked logit).
- `vjp`: `fused_attention`, the kernels wrapped in `jax.custom_vjp`; either
  backend's forward saves the same residuals, so the backward follows either.
- `partitioning`: SPMD partitioning of every kernel call.
"""
