"""Constants every backend's kernels share: the logits are in base 2."""

import math

from msa_pallas.reference import MASKED_LOGIT

LOG2E = math.log2(math.e)
# AlphaFold's replaced logit for a masked key (-1e9), in base-2 units.
MASKED_LOGIT_LOG2 = MASKED_LOGIT * LOG2E
# A masked query's row max (base 2) in the statistics the backward kernels read,
# where the mask masks queries too (the op's `mask_queries`): above any logit, so
# that its weights exp2(logit - max - log2 sum) are exactly 0 whatever its logits
# (the forward may have skipped the query and left no statistics of its own; its
# output gradient is 0, and so its logits' gradient).
MASKED_QUERY_ROW_MAX_LOG2 = 2.0**100
# bfloat16 pieces of a float32 operand of a 16-bit matrix product: their
# pairwise products (6 of them) give float32 accuracy.
FLOAT32_PIECES = 3
