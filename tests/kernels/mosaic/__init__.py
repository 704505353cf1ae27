"""Tests of msa_pallas.kernels.mosaic: the forward and backward kernels in the Mosaic GPU
interpreter, their plans and CUDA lowering, and the compiled kernels on a Hopper GPU."""
