"""Pallas Triton kernels: any CUDA GPU, 16-bit and float32 inputs.

- `common`: tile loads and the logits tile shared by every Triton kernel.
- `forward`: the forward kernel.
- `backward`: the dk/dv, dq and bias-gradient kernels.
"""
