"""Pallas Mosaic GPU kernels: Hopper (sm90), 16-bit inputs.

- `forward`: the forward kernel (TMA, wgmma, warp-specialised, MSA rows
  sharing each bias tile).
- `backward`: the dk/dv, dq and dbias kernels (the same machinery; the bias
  gradient summed over S inside the dbias kernel).
- `common`: what they share: which inputs they take, shared-memory tiles, the
  producer's copy ring, the wgmma products, the consumers' ping-pong.
"""
