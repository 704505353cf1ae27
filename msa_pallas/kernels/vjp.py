"""The fused op with its custom VJP: forward kernel, backward kernels, and the
elementwise gate algebra between them.

With the gate g, out = o * sigmoid(g), where o is the attention output. The
backward needs the cotangent of o, `do = dout * sigmoid(g)`, and
`delta = sum_d do * o = sum_d dout * out` (no ungated output is stored);
`dgate = dout * out * (1 - sigmoid(g))`. XLA fuses these elementwise steps
into one pass over the rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from msa_pallas.block_sizes import BlockConfig
from msa_pallas.kernels.backward import attention_backward
from msa_pallas.kernels.forward import attention_forward


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def fused_attention(q, k, v, bias, mask, gate, scale: float, config: BlockConfig, interpret: bool):
    """Pallas MSA row attention on `[B, S, N, H, d]` inputs (see `attention_forward`).

    Differentiable in q, k, v, bias and gate; mask (`[B, S, N]` int8) is not.
    """
    return attention_forward(
        q, k, v, bias, mask, gate,
        scale=scale, tiles=config.forward, interpret=interpret, save_stats=False,
    )


def _fused_attention_fwd(q, k, v, bias, mask, gate, scale, config, interpret):
    out, row_max, row_log2_sum = attention_forward(
        q, k, v, bias, mask, gate,
        scale=scale, tiles=config.forward, interpret=interpret, save_stats=True,
    )
    return out, (q, k, v, bias, mask, gate, out, row_max, row_log2_sum)


def _fused_attention_bwd(scale, config, interpret, residuals, dout):
    q, k, v, bias, mask, gate, out, row_max, row_log2_sum = residuals
    dout32 = dout.astype(jnp.float32)
    out32 = out.astype(jnp.float32)
    # [B, S, N, H] -> [B, S, H, N], the layout of the row statistics.
    delta = jnp.swapaxes(jnp.sum(dout32 * out32, axis=-1), 2, 3)
    if gate is None:
        do, dgate = dout.astype(q.dtype), None
    else:
        gate_sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
        do = (dout32 * gate_sigmoid).astype(q.dtype)
        dgate = (dout32 * out32 * (1.0 - gate_sigmoid)).astype(gate.dtype)
    dq, dk, dv, dbias = attention_backward(
        q, k, v, bias, mask, do, row_max, row_log2_sum, delta,
        scale=scale, config=config, interpret=interpret,
    )
    return dq, dk, dv, dbias, None, dgate


fused_attention.defvjp(_fused_attention_fwd, _fused_attention_bwd)
