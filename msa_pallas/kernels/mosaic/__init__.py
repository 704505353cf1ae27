"""Pallas Mosaic GPU kernels: Hopper (sm90), 16-bit inputs (float32 in the
backward, as bf16 pieces).

The kernels, each in a file of its own:

- `forward`: the forward kernel (TMA, wgmma, warp-specialised, MSA rows
  sharing each bias tile); `forward_operands`: its operands as made in XLA.
- `backward/`: the dk/dv, dq and dbias kernels (`dkdv`, `dq`, `dbias`;
  `operands`: what they share; the bias gradient summed over S inside the
  dbias kernel).

The mechanisms they share, each once:

- `support`: which inputs the kernels take (`supports`) and the XLA-side
  padding of the head dim, the bias and the mask.
- `plan`: one plan per kernel: its shared-memory specs, the copies each
  barrier awaits, its grid and its shared-memory bytes.
- `tiles`: the kernels' configurations (`MosaicTiles`, `MosaicBackwardTiles`)
  and their default choice.
- `smem`: shared-memory tiles, row views for N no multiple of 8.
- `pipeline`: the producer's copy ring between runtime bounds, the
  consumers' ping-pong, register budgets, the launch.
- `matmul`: the `wgmma` products and float32 operands as bf16 pieces.
- `logits`: the bias as the products start from it, the masked logit.
- `heads`: two heads per tile for d = 8.
- `dropout_words`: attention dropout in the kernels (`msa_pallas.dropout`'s
  words of every query and key, computed in XLA; a tile's vectors of them
  loaded from GMEM, and its keep mask).
"""
