"""The fused op with its custom VJP: forward kernel, backward kernels, and the
elementwise gate algebra between them.

With the gate g, out = o * sigmoid(g), where o is the attention output. The
backward needs the cotangent of o, `do = dout * sigmoid(g)`, rounded to the
input dtype for the matrix units, and `delta = sum_d do * o`;
`dgate = dout * o * sigmoid(g) * (1 - sigmoid(g))`. XLA fuses these
elementwise steps into one pass over the rows.

The forward saves o in float32. delta must be computed from the same `do`
the kernels multiply with v, and from an o that rounding has not moved away
from `p @ v`: `ds = p * (do.v - delta)` is a difference of nearly equal
numbers when a softmax row is close to one-hot, and a bf16-rounded o there
costs a gradient error of several percent.
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
    out, attention, row_max, row_log2_sum = attention_forward(
        q, k, v, bias, mask, gate,
        scale=scale, tiles=config.forward, interpret=interpret, save_stats=True,
    )
    return out, (q, k, v, bias, mask, gate, attention, row_max, row_log2_sum)


def _fused_attention_bwd(scale, config, interpret, residuals, dout):
    q, k, v, bias, mask, gate, attention, row_max, row_log2_sum = residuals
    dout32 = dout.astype(jnp.float32)
    if gate is None:
        do, dgate = dout.astype(q.dtype), None
    else:
        gate_sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
        do = (dout32 * gate_sigmoid).astype(q.dtype)
        dgate = dout32 * attention * gate_sigmoid * (1.0 - gate_sigmoid)
        dgate = dgate.astype(gate.dtype)
    # [B, S, N, H] -> [B, S, H, N], the layout of the row statistics.
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * attention, axis=-1), 2, 3)
    dq, dk, dv, dbias = attention_backward(
        q, k, v, bias, mask, do, row_max, row_log2_sum, delta,
        scale=scale, config=config, interpret=interpret,
    )
    return dq, dk, dv, dbias, None, dgate


fused_attention.defvjp(_fused_attention_fwd, _fused_attention_bwd)
