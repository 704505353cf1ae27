"""The fused op with its custom VJP: forward kernel, backward kernels, and the
elementwise gate algebra between them.

With the gate g, out = o * sigmoid(g), where o is the attention output. The
backward needs the cotangent of o, `do = dout * sigmoid(g)`, rounded to the
input dtype for the matrix units, and `delta = sum_d do * o`;
`dgate = dout * o * sigmoid(g) * (1 - sigmoid(g))`. XLA fuses these
elementwise steps into one pass over the rows.

Which kernels run, with which tiles, is the `dispatch.CallPlan` the op
passes in; this file branches on it alone. Either backend's forward (Triton
or Mosaic GPU) saves the same residuals, and either backend's backward
follows either forward.

With attention dropout (`plan.dropout_rate`, `msa_pallas.dropout`) every
kernel regenerates the mask from the row seeds: the forward drops weights
of the undropped softmax and scales o by 1 / (1 - rate); here `do` is
scaled by the same factor before the backward kernels see it, so that
they only zero the dropped weights (`ds = p * (keep * do.v - delta)`,
`dv = (p * keep)^T do`), and delta, `sum_j p keep do.v`, is
`(1 - rate) * sum_d do * o`.

The forward saves o in float32. delta must be computed from the same `do`
the kernels multiply with v, and from an o that rounding has not moved away
from `p @ v`: `ds = p * (do.v - delta)` is a difference of nearly equal
numbers when a softmax row is close to one-hot, and a bf16-rounded o there
costs a gradient error of several percent.

Where the plan asks for it (`plan.prologue_kernel`: the Mosaic kernels, no
dropout), `do`, the gate's gradient and the stacked statistics come from one
Pallas kernel (`triton.backward_prologue`) in place of these XLA passes.
Skipping padding, the forward then saves its residuals as its kernel left
them, with the dead rows' means of v: the prologue reads a dead row's mean
where XLA's select read its float32 row, and gives the dead rows' dv.

Where the mask masks queries too and the kernels say so
(`plan.kernels_mask_queries`: the op's `mask_queries`, skipping on the
Mosaic kernels), the forward zeroes the masked queries' output and takes no
dead rows' means; the prologue takes `dout` as 0 there and reads nothing of
a dead row, and the backward kernels skip the query tiles that hold no kept
residue (their `do` is 0). Elsewhere the op zeroes them after this function
(`attention.run_plan`), and the gradients follow.

Each kernel call (forward, dk/dv, dq, dbias, the prologue) goes through
`partitioning.partitioned_call`: under `jax.jit` with inputs sharded over the
batch, MSA-row or head axes, every device runs the kernel on its own shard
(the bias gradient's partial sums over S are psum-ed), and on one device the
call is the plain kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from msa_pallas.kernels.key_tiles import span_operands
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.support import pad_head_dim
from msa_pallas.kernels.triton import forward as triton_forward
from msa_pallas.kernels.triton.backward_prologue import backward_prologue
from msa_pallas.kernels.triton.backward import (
    backward_dbias, backward_dkdv, backward_dq, backward_dq_dbias,
)
from msa_pallas.validation import check_mosaic_interpreter
from msa_pallas.kernels.partitioning import (
    BIAS, KEY_ROWS, MASK, QUERY_ROWS, ROW_VECTORS, SEEDS, STACKED_STATS, STATS,
    partitioned_call,
)

# Operand layouts of the kernels (partitioning.py): B, S and H may be sharded.
_FORWARD_IN = (QUERY_ROWS, KEY_ROWS, KEY_ROWS, BIAS, MASK, QUERY_ROWS)
_BACKWARD_IN = (QUERY_ROWS, KEY_ROWS, KEY_ROWS, BIAS, MASK, QUERY_ROWS, STATS, STATS, STATS)
_MOSAIC_BACKWARD_IN = (QUERY_ROWS, KEY_ROWS, KEY_ROWS, BIAS, MASK, QUERY_ROWS, STACKED_STATS)

# The Triton backward kernels by the names a plan gives them (looked up when
# called, so that a patched module attribute is the one that runs), and
# their outputs' layouts.
_TRITON_BACKWARD = {
    "dkdv": (lambda: backward_dkdv, (KEY_ROWS, KEY_ROWS)),
    "dq": (lambda: backward_dq, (QUERY_ROWS,)),
    "dbias": (lambda: backward_dbias, (BIAS,)),
    "dq_dbias": (lambda: backward_dq_dbias, (QUERY_ROWS, BIAS)),
}
# The gradients each backward kernel (either backend) returns.
_OUTPUTS = {"dkdv": ("dk", "dv"), "dq": ("dq",), "dbias": ("dbias",), "dq_dbias": ("dq", "dbias")}


def _mosaic_call(kernel, args, in_layouts, out_layouts, *, interpret: bool) -> tuple:
    """`partitioned_call` for a Mosaic GPU kernel. The Mosaic GPU
    interpreter's ordered callbacks cannot sit inside a custom_partitioning
    op, so interpreted kernels are called as they are (never sharded)."""
    if interpret:
        check_mosaic_interpreter()
        return tuple(jax.tree.leaves(kernel(*args)))
    return partitioned_call(kernel, args, in_layouts, out_layouts)


def _with_dropout(args, layouts, plan, seeds):
    """The kernels' operands and their layouts, the row seeds appended, and
    the keywords that turn dropout on; without dropout the kernels are
    called exactly as they are without it."""
    if not plan.dropout_rate:
        return args, layouts, {}
    return (*args, seeds), (*layouts, SEEDS), {"dropout_rate": plan.dropout_rate}


def _forward(q, k, v, bias, mask, gate, seeds, *, scale, plan, save_stats):
    mosaic = plan.forward == "mosaic"
    forward = mosaic_forward.attention_forward if mosaic else triton_forward.attention_forward
    skip = {"skip_masked" if mosaic else "skip_padding": plan.skips_padding}
    if plan.kernels_mask_queries:
        # Dead rows are rows of zeros: no means of v.
        skip["mask_queries"] = True
    dead_row_means = (save_stats and plan.prologue_kernel and plan.skips_padding
                      and not plan.kernels_mask_queries)
    if dead_row_means:
        # The residuals of dead rows unselected, and their means of v, for
        # `backward_prologue`.
        skip["dead_row_means"] = True
    args, in_layouts, dropout = _with_dropout(
        (q, k, v, bias, mask, gate), _FORWARD_IN, plan, seeds
    )
    kernel = functools.partial(
        forward, scale=scale, tiles=plan.forward_tiles, interpret=plan.interpret,
        save_stats=save_stats, **skip, **dropout,
    )
    outs = (QUERY_ROWS, QUERY_ROWS, STATS, STATS) if save_stats else (QUERY_ROWS,)
    if dead_row_means:
        outs += (ROW_VECTORS,)
    if mosaic:
        return _mosaic_call(kernel, args, in_layouts, outs, interpret=plan.interpret)
    return partitioned_call(kernel, args, in_layouts, outs)


def _backward(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, seeds, *, scale, plan):
    """dq, dk, dv `[B, S, N, H, d]` in q's dtype and dbias `[B, H, N, N]`
    float32 (summed over S), from the plan's backward kernels.

    The bias gradient leaves the kernels in float32 whatever the bias dtype,
    so that the sum over the devices that shard S (a psum) is a float32 sum,
    rounded once by the caller.
    """
    if plan.backward == "mosaic":
        # The three row statistics stacked into one `[B, S, H, 3, N]` array:
        # one TMA copy per tile instead of three.
        stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)
        return _mosaic_backward(q, k, v, bias, mask, do, stats, seeds, scale=scale, plan=plan)
    operands, in_layouts, dropout = _with_dropout(
        (q, k, v, bias, mask, do, row_max, row_log2_sum, delta), _BACKWARD_IN, plan, seeds
    )
    grads = {}
    for name, tiles in plan.backward_tiles:
        kernel, out_layouts = _TRITON_BACKWARD[name]
        extra = {"dbias_dtype": jnp.float32} if "dbias" in name else {}
        bound = functools.partial(
            kernel(), scale=scale, tiles=tiles, interpret=plan.interpret,
            skip_padding=plan.skips_padding, **extra, **dropout,
        )
        outs = partitioned_call(bound, operands, in_layouts, out_layouts)
        grads.update(zip(_OUTPUTS[name], outs))
    return grads["dq"], grads["dk"], grads["dv"], grads["dbias"]


def _mosaic_backward(q, k, v, bias, mask, do, stats, seeds, *, scale, plan, dead_dv=None):
    """`_backward` on the Mosaic GPU kernels (`kernels/mosaic/backward/`),
    the row statistics stacked (`[B, S, H, 3, N]`): q, k, v and `do`
    zero-padded to the plan's `backward_head_dim` where it is wider than d
    (for the Mosaic forward the op has padded them already; the Triton
    forward that a float32 Mosaic backward follows takes d = 8 as it is).
    `dead_dv`: the dead rows' dv for the dk/dv kernel where the caller has
    it (`backward_prologue`), else None."""
    head_dim = q.shape[-1]  # wider than the call's where the op padded it
    if plan.backward_head_dim > head_dim:
        q, k, v, do = (pad_head_dim(x) for x in (q, k, v, do))
    operands, in_layouts, dropout = _with_dropout(
        (q, k, v, bias, mask, do, stats), _MOSAIC_BACKWARD_IN, plan, seeds,
    )
    queries = {"mask_queries": True} if plan.kernels_mask_queries else {}
    turns = {"ping_pong": plan.ping_pong} | queries
    kernels = {
        "dkdv": (mosaic_backward.backward_dkdv, (KEY_ROWS, KEY_ROWS), turns),
        "dq": (mosaic_backward.backward_dq, (QUERY_ROWS,), turns),
        "dbias": (mosaic_backward.backward_dbias, (BIAS,), queries),
    }
    grads = {}
    for name, tiles in plan.backward_tiles:
        kernel, out_layouts, extra = kernels[name]
        args, layouts = operands, in_layouts
        if name == "dkdv" and dead_dv is not None:
            kernel = _dead_dv_last(kernel)
            args, layouts = (*operands, dead_dv), (*in_layouts, ROW_VECTORS)
        bound = functools.partial(
            kernel, scale=scale, tiles=tiles, interpret=plan.interpret,
            skip_masked=plan.skips_padding, **extra, **dropout,
        )
        outs = _mosaic_call(bound, args, layouts, out_layouts, interpret=plan.interpret)
        grads.update(zip(_OUTPUTS[name], outs))
    return (grads["dq"][..., :head_dim], grads["dk"][..., :head_dim],
            grads["dv"][..., :head_dim], grads["dbias"])


def _dead_dv_last(backward_dkdv):
    """The dk/dv kernel taking the dead rows' dv as its last operand, not a
    keyword: so `partitioned_call` shards it with the others."""
    return lambda *operands, **options: backward_dkdv(
        *operands[:-1], dead_dv=operands[-1], **options
    )


def kernel_bias(bias, dtype):
    """The bias as the kernels read it: rounded to `dtype` (None: as it is).

    Rounding to float16 saturates at float16's largest value first, so a
    large bias (a -1e9 mask folded into it, say) stays finite.
    """
    if dtype is None or bias.dtype == jnp.dtype(dtype):
        return bias
    if jnp.dtype(dtype) == jnp.float16:
        largest = float(jnp.finfo(jnp.float16).max)
        bias = jnp.clip(bias, -largest, largest)
    return bias.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def fused_attention(q, k, v, bias, mask, gate, seeds, scale: float, plan):
    """Pallas MSA row attention on `[B, S, N, H, d]` inputs (see `attention_forward`),
    on the kernels and tiles of `plan` (a `dispatch.CallPlan`; q, k, v and
    the gate already zero-padded to its `forward_head_dim`).

    Differentiable in q, k, v, bias and gate; mask (`[B, S, N]` int8) and
    the dropout row seeds (`[B, S, H]` uint32, None without dropout) are not.
    The kernels read the bias in `plan.bias_dtype` (`kernel_bias`); the bias
    gradient is summed in float32 and returned in the bias's own dtype.
    """
    (out,) = _forward(
        q, k, v, kernel_bias(bias, plan.bias_dtype), mask, gate, seeds,
        scale=scale, plan=plan, save_stats=False,
    )
    return out


def _fused_attention_fwd(q, k, v, bias, mask, gate, seeds, scale, plan):
    rounded_bias = kernel_bias(bias, plan.bias_dtype)
    # With the prologue kernel, a fifth result: the dead rows' means of v.
    out, *row_residuals = _forward(
        q, k, v, rounded_bias, mask, gate, seeds, scale=scale, plan=plan, save_stats=True,
    )
    # The bias's own dtype travels as a zero-size array: residuals are arrays.
    bias_dtype_token = jnp.zeros((0,), bias.dtype)
    residuals = (q, k, v, rounded_bias, bias_dtype_token, mask, gate, seeds, *row_residuals)
    return out, residuals


def _round_to(x32, dtype):
    """float32 values rounded to `dtype`'s precision, kept in float32.

    `x.astype(bf16).astype(f32)` is not enough: XLA on GPU may drop such a
    convert pair (excess precision is allowed by default); reduce_precision
    is the op it must keep.
    """
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return x32
    return jax.lax.reduce_precision(x32, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def partitioned_prologue(dout, gate, attention, means, row_max, row_log2_sum, mask, *,
                         do_dtype, interpret: bool, row_group_tiles=(),
                         mask_queries: bool = False):
    """`backward_prologue` as one SPMD-partitioned op (B, S and H may be
    sharded, as for the kernels): `(do, dgate, stats, dead_dv)`; without a
    gate `do` is dout itself and dgate None. `means`: the dead rows' means
    of v where the forward skipped them, with `mask` (`[B, S, N]` int8, the
    kernels': its rows' ends tell the dead rows); None, and dead_dv None,
    where the forward visited every row.

    `mask_queries` (skipping, no means): the mask masks queries too (the
    op's `mask_queries`), so `dout` counts as 0 at a masked residue: `do`
    is written with its zeros there (with or without a gate), a dead row's
    is 0 and its dv too (dead_dv None), and nothing of a dead row is read.

    `row_group_tiles`: skipping, the tiles (`MosaicTiles`) of the
    backward kernels that read `do` and the statistics a group of rows at a
    time (dq, dk/dv; the bias gradient's reads end at the last live row):
    dead rows in groups after a batch element's last live row are then
    read by none of them and get no `do` or statistics. Empty: every
    row's are written."""
    # The results of this call, of (do, dgate, stats, dead_dv): without a
    # gate (and unmasked queries) `do` is dout itself and there is no dgate;
    # without the means, no dead rows' dv.
    returned = [index for index, made in enumerate(
        (gate is not None or mask_queries, gate is not None, True, means is not None)
    ) if made]
    skipping = means is not None or mask_queries

    def prologue(dout, gate, attention, means, row_max, row_log2_sum, mask):
        key_end, options = None, {}
        if skipping:
            # On this device's rows, as the kernels read their own bounds
            # (XLA computes the kernels' identical summaries once).
            spans = span_operands(mask, dout.shape[2])
            key_end = spans["key_end"]
            if row_group_tiles:
                options = {
                    "live_rows_end": spans["live_rows_end"],
                    "rows_per_group": math.lcm(
                        *(tiles.msa_rows_for(dout.shape[1]) for tiles in row_group_tiles)
                    ),
                }
        if mask_queries:
            options["query_mask"] = mask
        results = backward_prologue(
            dout, gate, attention, means, row_max, row_log2_sum, key_end,
            do_dtype=do_dtype, interpret=interpret, **options,
        )
        return tuple(results[index] for index in returned)

    layouts = (QUERY_ROWS, QUERY_ROWS, STACKED_STATS, ROW_VECTORS)
    results = partitioned_call(
        prologue, (dout, gate, attention, means, row_max, row_log2_sum, mask),
        (QUERY_ROWS, QUERY_ROWS, QUERY_ROWS, ROW_VECTORS, STATS, STATS, MASK),
        tuple(layouts[index] for index in returned),
    )
    full = [dout, None, None, None]
    for index, result in zip(returned, results):
        full[index] = result
    return tuple(full)


def _prologue_backward(scale, plan, residuals, dout):
    """`_fused_attention_bwd` where `plan.prologue_kernel`: `do`, the gate's
    gradient, the stacked statistics (and skipping, the dead rows' dv) from
    one Pallas kernel (`backward_prologue`) that reads each row once, a dead
    row's mean of v in place of its float32 output."""
    (q, k, v, bias, bias_dtype_token, mask, gate, seeds, attention, row_max, row_log2_sum,
     *means) = residuals  # the dead rows' means of v where padding was skipped
    means = means[0] if means else None
    do, dgate, stats, dead_dv = partitioned_prologue(
        dout, gate, attention, means, row_max, row_log2_sum, mask, do_dtype=q.dtype,
        interpret=plan.interpret,
        row_group_tiles=tuple(tiles for name, tiles in plan.backward_tiles if name != "dbias"),
        mask_queries=plan.kernels_mask_queries,
    )
    # As in `_fused_attention_bwd`: what the kernels make of the bias is
    # made after this, when the float32 o is no longer live.
    stats, bias, dgate = lax.optimization_barrier((stats, bias, dgate))
    dq, dk, dv, dbias = _mosaic_backward(
        q, k, v, bias, mask, do, stats, seeds, scale=scale, plan=plan, dead_dv=dead_dv
    )
    return dq, dk, dv, dbias.astype(bias_dtype_token.dtype), None, dgate, None


def _fused_attention_bwd(scale, plan, residuals, dout):
    if plan.prologue_kernel:
        return _prologue_backward(scale, plan, residuals, dout)
    (q, k, v, bias, bias_dtype_token, mask, gate, seeds, attention, row_max,
     row_log2_sum) = residuals
    dout32 = dout.astype(jnp.float32)
    if gate is None:
        do32, dgate = dout32, None
    else:
        gate_sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
        do32 = dout32 * gate_sigmoid
        dgate = dout32 * attention * gate_sigmoid * (1.0 - gate_sigmoid)
        dgate = dgate.astype(gate.dtype)
    rate = plan.dropout_rate
    if rate:
        do32 = do32 * (1.0 / (1.0 - rate))
    if gate is None and dout.dtype == q.dtype and not rate:
        # `do` is the cotangent itself, already in q's dtype: no rounding and no
        # copy (a reduce_precision here makes XLA write a rounded copy, one more
        # [B, S, N, H, d] array: 268 MB at the long shape in bf16).
        do = dout
    else:
        # The kernels multiply v by `do` in q's dtype: delta must see the same rounding.
        do32 = _round_to(do32, q.dtype)
        do = do32.astype(q.dtype)
    # The sum over d in the inputs' layout, then [B, S, N, H] -> [B, S, H, N],
    # the layout of the row statistics, as a pass of its own over the small
    # result. Fused with that transpose and the Mosaic kernels' stack of the
    # statistics, XLA's one pass took 36 us at the train crop on an H200,
    # against 19 + 4 us as two, and the stack was live beside o (50 MB more
    # f+b memory at the long shape).
    #
    # The bias (and the gate's gradient, which reads o too) pass the same
    # barrier, so that what the kernels make of the bias (the Mosaic dk/dv
    # kernel's transposed, pre-scaled copy: 34 MB at the long shape with a
    # float32 bias) is made after delta, when the float32 o is no longer live.
    delta = jnp.sum(do32 * attention, axis=-1)
    if rate:
        delta = delta * (1.0 - rate)
    delta, bias, dgate = lax.optimization_barrier((delta, bias, dgate))
    delta = jnp.swapaxes(delta, 2, 3)
    dq, dk, dv, dbias = _backward(
        q, k, v, bias, mask, do, row_max, row_log2_sum, delta, seeds,
        scale=scale, plan=plan,
    )
    return dq, dk, dv, dbias.astype(bias_dtype_token.dtype), None, dgate, None


fused_attention.defvjp(_fused_attention_fwd, _fused_attention_bwd)
