"""Tests of msa_pallas.kernels: the Triton and Mosaic GPU kernels, each beside its own."""
