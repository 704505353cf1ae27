"""Pallas (Triton lowering) kernels for MSA row attention.

- `common`: tile loads and the logits tile shared by every kernel.
- `forward`: the forward kernel.
- `backward`: the dk/dv, dq and bias-gradient kernels.
- `vjp`: `fused_attention`, the kernels wrapped in `jax.custom_vjp`.
"""
