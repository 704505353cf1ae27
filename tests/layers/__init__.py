"""Tests of the layers: Flax (linen, NNX), Haiku, triangle attention, the converters and
the AlphaFold2 patch."""
