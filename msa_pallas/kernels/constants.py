"""Constants every backend's kernels share: the logits are in base 2."""

import math

from msa_pallas.reference import MASKED_LOGIT

LOG2E = math.log2(math.e)
# AlphaFold's replaced logit for a masked key (-1e9), in base-2 units.
MASKED_LOGIT_LOG2 = MASKED_LOGIT * LOG2E
# bfloat16 pieces of a float32 operand of a 16-bit matrix product: their
# pairwise products (6 of them) give float32 accuracy.
FLOAT32_PIECES = 3
