"""Tests of msa_pallas.kernels.triton: options, and the compiled kernels on a GPU."""
