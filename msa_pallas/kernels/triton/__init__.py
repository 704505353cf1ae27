"""Pallas Triton kernels: any CUDA GPU, 16-bit and float32 inputs.

- `common`: tile loads, the logits tile and the dropout mask's words, shared by
  every Triton kernel.
- `forward`: the forward kernel.
- `backward`: the dk/dv, dq and bias-gradient kernels.
- `backward_launch`: their grids, specs and the sum of the row chunks' partial
  bias gradients.
"""
