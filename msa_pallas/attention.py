"""The public op `msa_row_attention`: it asks `dispatch.plan_call` which
kernels run and runs that plan; `explain` shows the plan."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from msa_pallas.block_sizes import BlockConfig
from msa_pallas.dispatch import (  # noqa: F401  (kernel_bias_dtype: public before dispatch.py)
    CallPlan, choose_implementation, current_target, kernel_bias_dtype, plan_call,
)
from msa_pallas.dropout import row_seeds
from msa_pallas.kernels.mosaic.support import pad_head_dim
from msa_pallas.kernels.vjp import fused_attention
from msa_pallas.reference import key_keep, msa_row_attention_xla


def target_platform() -> str:
    """The platform the op is traced for: `"gpu"`, `"cpu"`, `"tpu"`, ...
    (`dispatch.current_target`: JAX's default backend, or the abstract device
    of the current abstract mesh)."""
    return current_target().platform


def on_gpu() -> bool:
    """True when the op is traced for a GPU (`target_platform()`), where the
    kernels compile; elsewhere they run in their interpreters."""
    return current_target().gpu


def on_hopper() -> bool:
    """True when the op is traced for a GPU of compute capability 9.x (H100,
    H200; an abstract device of such a kind too), where the Mosaic GPU
    kernels compile."""
    return current_target().hopper


def resolve_implementation(implementation, q, dropout_rate: float, bias=None) -> str:
    """The implementation `msa_row_attention` runs for q (and the bias), as
    `"xla"`, `"triton"` or `"mosaic"` (`"pallas"` asked comes back as
    `"triton"`): the rule of `msa_pallas.dispatch`. `msa_pallas.explain`
    gives the whole plan (kernels, tiles, padding, reason)."""
    return choose_implementation(implementation, q, bias, dropout_rate, current_target())[0]


def msa_row_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    mask: jax.Array | None = None,
    gate: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: str | None = None,
    block_config: BlockConfig | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    round_bias: bool = False,
    mask_queries: bool = False,
) -> jax.Array:
    """Row-wise gated self-attention over an MSA, with a pair bias.

    For each batch element b, MSA row s, head h and query residue i::

        logits[j] = scale * <q[b,s,i,h], k[b,s,j,h]> + bias[b,h,i,j]
        logits[j] = -1e9                     where mask[b,s,j] is False / 0
        out[b,s,i,h] = softmax(logits) @ v[b,s,:,h] * sigmoid(gate[b,s,i,h])

    The softmax and every accumulation run in float32; a row whose keys are
    all masked gets uniform weights (finite, never NaN).

    Args:
      q, k, v: `[*batch, S, N, H, d]`, float16, bfloat16 or float32 (float64
        too with `implementation="xla"`). The layout a Dense projection of
        `[*batch, S, N, C]` produces, so no transposes are needed.
      bias: `[*batch, H, N, N]`, floating; shared by all S rows.
      mask: `[*batch, S, N]`, bool or numeric (nonzero keeps a key), or None.
      gate: `[*batch, S, N, H, d]` gate logits, or None for no gate.
      scale: multiplies `q . k`; default `1 / sqrt(d)`.
      implementation: `"triton"` (or `"pallas"`, the same), `"mosaic"`,
        `"xla"`, or None (default) for the rule in `msa_pallas.dispatch`, the
        one place that says which kernels run where; `msa_pallas.explain`
        with the same arguments shows what this call runs and why.
      block_config: tiles for the Pallas kernels; default chosen by
        `msa_pallas.block_sizes.default_block_config(N, d, dtype, bias_dtype)`.
      dropout_rate: dropout on the attention weights (the reference layer's
        convention: torch.nn.Dropout on the softmax output, the kept weights
        scaled by 1 / (1 - rate)), inside the kernels on every backend.
      dropout_rng: a PRNG key, required with a rate > 0. The mask is a
        function of the key and of (b, s, h, i, j) alone
        (`msa_pallas.dropout`): every backend, tile size and number of
        devices draws the same mask from the same key, and the backward
        regenerates it without storing it.
      round_bias: opt-in speed for 16-bit q with a wider bias (float32, as
        AlphaFold's pair projections give): the kernels then read the bias
        rounded once to q's dtype (float16: saturated to its range), half
        the memory traffic of a float32 bias. It costs accuracy in
        proportion to the bias's size (README, "Numerics"); the logits,
        softmax and bias gradient stay float32, and the bias gradient comes
        back in the bias's own dtype. Default False: the kernels read the
        bias as given. No effect on the `"xla"` path or on float32 inputs.
      mask_queries: the mask masks query residues too: `out[b, s, i] = 0`
        wherever `mask[b, s, i]` is False, and no gradient flows from there
        (a padding residue is padding as a key and as a query; a row of
        padding gives zeros). Every other output, and every gradient at a
        kept position, is the default's. Inside `msa_pallas.skipping_padding`
        the Mosaic kernels then skip masked queries as they skip masked
        keys, and padding rows cost only their zeros. Default False: a
        masked residue's query attends as any other (SPEC §1). No effect
        without a mask.

    Returns:
      `[*batch, S, N, H, d]` in q's dtype. Differentiable in q, k, v, bias and
      gate; the bias gradient is summed over S inside the kernels.

    Example::

        q = k = v = jnp.ones((2, 8, 32, 4, 16), jnp.bfloat16)
        bias = jnp.zeros((2, 4, 32, 32), jnp.float32)
        out = msa_pallas.msa_row_attention(q, k, v, bias)   # [2, 8, 32, 4, 16]
    """
    plan = plan_call(
        q, k, v, bias, mask, gate, scale=scale, implementation=implementation,
        block_config=block_config, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        round_bias=round_bias, mask_queries=mask_queries,
    )
    *batch_shape, rows, n_res, heads, _ = q.shape
    seeds = None
    if plan.dropout_rate:
        seeds = row_seeds(dropout_rng, math.prod(batch_shape), rows, heads)
    return run_plan(plan, q, k, v, bias, mask, gate, scale=scale, dropout_seeds=seeds)


def run_plan(plan: CallPlan, q, k, v, bias, mask=None, gate=None, *, scale=None,
             dropout_seeds=None) -> jax.Array:
    """`msa_row_attention` on the kernels of `plan` (from `plan_call` with the
    same arguments). `dropout_seeds`: `[prod(batch), S, H]` uint32 from
    `dropout.row_seeds`, given where `plan.dropout_rate > 0`: drawn by the
    caller on the call's global shape, so that a `shard_map` over the rows
    (`msa_pallas.sharding`) hands each device its slice of the same draw."""
    *batch_shape, rows, n_res, heads, head_dim = q.shape
    batch = math.prod(batch_shape)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scale = float(scale)

    # One flat batch axis: a free reshape, undone on the output.
    rows_shape = (batch, rows, n_res, heads, head_dim)
    q, k, v = (x.reshape(rows_shape) for x in (q, k, v))
    gate = None if gate is None else gate.reshape(rows_shape)
    bias = bias.reshape(batch, heads, n_res, n_res)
    if mask is not None:
        mask = key_keep(mask.reshape(batch, rows, n_res))

    if plan.implementation == "xla":
        out = msa_row_attention_xla(
            q, k, v, bias, mask, gate,
            scale=scale, dropout_rate=plan.dropout_rate, dropout_seeds=dropout_seeds,
        )
    else:
        if plan.forward_head_dim > head_dim:
            # Zero columns change no logit; the output's are sliced off below
            # and their gradients dropped by the pad's transpose.
            q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
            gate = None if gate is None else pad_head_dim(gate)
        out = fused_attention(
            q, k, v, bias,
            None if mask is None else mask.astype(jnp.int8),
            gate, dropout_seeds, scale, plan,
        )[..., :head_dim]
    if plan.masks_queries and not plan.kernels_mask_queries:
        # The gradients follow the select: none flows from a masked query.
        out = jnp.where(mask[..., None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(*batch_shape, rows, n_res, heads, head_dim)


def explain(q, k, v, bias, mask=None, gate=None, **kwargs) -> CallPlan:
    """What `msa_row_attention(q, k, v, bias, mask, gate, **kwargs)` would run
    here: the forward and backward kernels, their tiles, any padding of the
    head dim, and why (`msa_pallas.dispatch` states the rule). Arrays or
    `jax.ShapeDtypeStruct`s; nothing runs. Print the result for a summary;
    its fields (`CallPlan`) for a program.

    Example::

        q = jax.ShapeDtypeStruct((1, 128, 384, 8, 32), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((1, 8, 384, 384), jnp.float32)
        print(msa_pallas.explain(q, q, q, bias))
        # on an H200:
        # msa_row_attention: mosaic (compiled, target gpu sm90)
        #   forward:  mosaic MosaicTiles(block_q=128, block_k=64, ...)
        #   backward: mosaic
        #     dkdv: MosaicTiles(...)  dq: ...  dbias: ...
        #   why: Hopper, bfloat16, N = 384 >= 192: the Mosaic kernels measured faster

    Under `msa_pallas.exporting.gpu_target("NVIDIA A100")` it explains the
    export for that GPU instead; `target=msa_pallas.dispatch.Target("gpu", 90)`
    plans for an sm90 GPU from anywhere.
    """
    return plan_call(q, k, v, bias, mask, gate, **kwargs)
