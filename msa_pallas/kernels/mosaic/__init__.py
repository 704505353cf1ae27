"""Pallas Mosaic GPU kernels: Hopper (sm90), 16-bit inputs.

- `forward`: the forward kernel (TMA, wgmma, warp-specialised, MSA rows
  sharing each bias tile).
"""
