"""The Mosaic GPU forward kernel: Hopper (sm90), 16-bit inputs.

One CTA serves one query tile of one head for `msa_rows` MSA rows of one
batch element. The MSA rows share the pair bias, and that is what the CTA is
built around:

- a producer warpgroup streams, per key tile, the K and V tiles of every row
  and ONE bias tile (and the rows' key-mask vectors) by TMA into a
  `num_stages`-deep shared-memory ring;
- each of the `msa_rows` consumer warpgroups owns one MSA row: it computes
  `q k^T` with `wgmma` from shared memory, adds the shared bias tile, runs the
  online softmax in float32 (base 2), and multiplies the 16-bit
  probabilities, straight from registers, with V by `wgmma`;
- with two consumers, a schedule barrier makes them alternate, so one's
  softmax (the exponential unit) overlaps the other's matrix products.

The grid is (S / msa_rows, query tiles, B * H) with the MSA rows fastest, so
the CTAs that run at the same time read the same bias tiles and find them in
L2. N need not be a whole number of tiles (`common.supports`: a multiple of
8): TMA reads past N as zeros, keys past N get a -inf logit and TMA stores
of q's layout past N are dropped. q, k, v, the gate and the output are never
padded; the bias and mask rows are padded to whole TMA rows
(`common.pad_residues`), and the row statistics are written into planes
padded to whole query tiles and sliced: their `[1, block_q]` windows are
contiguous, and Mosaic GPU stores a contiguous unswizzled window with a bulk
copy that is clipped only at the end of the whole array, not at N, so a
window running past N would overwrite the next head's statistics. Results
and residuals are those of the Triton forward
(`msa_pallas.kernels.triton.forward.attention_forward`), so either backward follows.

The key loop visits every key tile; it is the place where tiles that the key
mask removes entirely, and attention dropout, will go.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.block_sizes import MosaicTiles, mosaic_shared_memory_bytes
from msa_pallas.kernels.constants import LOG2E, MASKED_LOGIT_LOG2
from msa_pallas.kernels.mosaic.common import (
    MAX_SHARED_MEMORY, WGMMA, WGMMA_COL, WGMMA_ROW, PingPong, accumulate_products,
    accumulator_bias, batch_head_and_warpgroup, bias_tile, check_kernel_inputs,
    consumer_registers, keys_before, launch, masked_accumulator_logit, pad_residues,
    producer_registers, sigmoid, smem_products, smem_tile, smem_vectors,
)


def default_tiles(q_shape, q_dtype, bias_dtype, save_stats: bool, has_gate: bool = True):
    """The fastest configuration measured on an H200 that fits in shared memory.

    128-query tiles per warpgroup and 2 MSA rows per CTA win at every N
    (benchmarks/RESULTS.md); 128-key stages where they fit (a 16-bit bias),
    else 64-key stages; one MSA row per CTA only for head dims too large for two.
    """
    *_, head_dim = q_shape
    preferred = (
        MosaicTiles(128, 128, 2, 2), MosaicTiles(128, 64, 2, 2), MosaicTiles(64, 64, 2, 2),
        MosaicTiles(64, 64, 2, 1),
    )
    for tiles in preferred:
        used = mosaic_shared_memory_bytes(
            tiles, head_dim, q_dtype, bias_dtype, has_mask=True, has_gate=has_gate,
            save_stats=save_stats,
        )
        if used <= MAX_SHARED_MEMORY:
            return tiles
    raise ValueError(f"no Mosaic configuration fits head dim {head_dim} in shared memory")


def _kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int,
    tiles: MosaicTiles, msa_rows: int, heads: int, dtype, interpret: bool,
):
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    key_tiles = pl.cdiv(n_res, block_k)
    has_mask, has_gate = "mask" in gmem, "gate" in gmem
    save_stats = "attention" in gmem
    ping_pong = msa_rows == 2 and tiles.ping_pong
    to_log2 = scale * LOG2E
    masked = masked_accumulator_logit(scale)

    row_group = lax.axis_index("row_groups")
    q_start = lax.axis_index("query_tiles") * block_q
    batch, head, wg = batch_head_and_warpgroup(heads)
    queries = pl.ds(q_start, block_q)

    @pl.when(wg < msa_rows)
    def _consumer():
        consumer_registers(msa_rows)
        row = row_group * msa_rows + wg
        q_smem = smem["q"].at[wg]
        plgpu.copy_gmem_to_smem(
            gmem["q"].at[batch, row, queries, head], q_smem, produced["q"].at[wg]
        )
        if has_gate:
            plgpu.copy_gmem_to_smem(
                gmem["gate"].at[batch, row, queries, head], smem["gate"].at[wg],
                produced["q"].at[wg],
            )
        plgpu.barrier_wait(produced["q"].at[wg])

        head_dim = q_smem.shape[-1]
        row_max = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), WGMMA_ROW)
        row_sum = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), WGMMA_ROW)
        acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), WGMMA)

        plgpu.barrier_wait(produced["k"].at[0])
        turns = PingPong(schedule, wg, enabled=ping_pong)
        turns.start()

        def visit_key_tile(key_tile, carry):
            acc, row_max, row_sum = carry
            slot = lax.rem(key_tile, stages)

            # The product starts from the bias tile, so the matrix units add it.
            (logits,) = smem_products(
                ((q_smem, smem["k"].at[slot, wg].T),), turns.hand_over,
                inits=(bias_tile(smem["bias"][slot], scale),), interpret=interpret,
            )
            if has_mask:
                keep = plgpu.load(
                    smem["mask"].at[slot, wg, 0, pl.ds(0, block_k)], layout=WGMMA_COL
                )
                keep = lax.broadcast_in_dim(keep != 0, logits.shape, [1])
            plgpu.barrier_arrive(consumed["k"].at[slot])

            t = logits
            if has_mask:
                t = jnp.where(keep, t, masked)
            if n_res % block_k:
                t = jnp.where(keys_before(n_res, key_tile, block_k, t.shape), t, -jnp.inf)

            # Base 2 from the accumulator's units: one FMA per logit.
            new_max = jnp.maximum(row_max, t.max(axis=1))
            new_max_log2 = new_max * to_log2
            rescale = jnp.exp2(row_max * to_log2 - new_max_log2)
            p = jnp.exp2(t * to_log2 - lax.broadcast_in_dim(new_max_log2, t.shape, [0]))
            acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
            row_sum = row_sum * rescale + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, row_sum, new_max, p16 = lax.optimization_barrier((acc, row_sum, new_max, p16))

            turns.release()
            plgpu.barrier_wait(produced["v"].at[slot])
            turns.take_turn()

            def wait_for_next_keys():
                next_tile = key_tile + 1

                @pl.when(next_tile < key_tiles)
                def _():
                    plgpu.barrier_wait(produced["k"].at[lax.rem(next_tile, stages)])

            (acc,) = accumulate_products(
                (acc,), (p16,), (smem["v"].at[slot, wg],), interpret, wait_for_next_keys
            )
            plgpu.barrier_arrive(consumed["v"].at[slot])
            return acc, new_max, row_sum

        acc, row_max, row_sum = lax.fori_loop(
            0, key_tiles, visit_key_tile, (acc, row_max, row_sum)
        )
        turns.finish()

        out = acc * lax.broadcast_in_dim(1.0 / row_sum, acc.shape, [0])
        if save_stats:
            smem["attention"][wg] = out
            # The backward's masked logit (base 2) for a row whose keys are all
            # masked, so that its weights come out uniform there as here.
            row_max_log2 = row_max * to_log2
            if has_mask:
                row_max_log2 = jnp.where(row_max <= masked, MASKED_LOGIT_LOG2, row_max_log2)
            smem["row_max"][wg, 0] = row_max_log2
            smem["row_log2_sum"][wg, 0] = jnp.log2(row_sum)
        if has_gate:
            out = out * sigmoid(smem["gate"][wg].astype(jnp.float32))
        # q's tile is free again: it holds the output on its way out.
        q_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, gmem["out"].at[batch, row, queries, head])
        if save_stats:
            plgpu.copy_smem_to_gmem(
                smem["attention"].at[wg], gmem["attention"].at[batch, row, queries, head]
            )
            # [1, block_q] windows of the statistics' [H, N] planes.
            for name in ("row_max", "row_log2_sum"):
                plgpu.copy_smem_to_gmem(
                    smem[name].at[wg], gmem[name].at[batch, row, pl.ds(head, 1), queries]
                )
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == msa_rows)
    def _producer():
        producer_registers()
        first_row = row_group * msa_rows

        def copy_rows(name, keys, slot):
            for r in range(msa_rows):
                plgpu.copy_gmem_to_smem(
                    gmem[name].at[batch, first_row + r, keys, head], smem[name].at[slot, r],
                    produced[name].at[slot],
                )

        def load(key_tile, slot, wait_for_slot: bool):
            keys = pl.ds(key_tile * block_k, block_k)
            if wait_for_slot:
                plgpu.barrier_wait(consumed["k"].at[slot])
            copy_rows("k", keys, slot)
            # The mask vectors and the bias tile complete the "k" barrier too.
            for r in range(msa_rows if has_mask else 0):
                plgpu.copy_gmem_to_smem(
                    gmem["mask"].at[batch, pl.ds(first_row + r, 1), keys],
                    smem["mask"].at[slot, r, :, pl.ds(0, block_k)], produced["k"].at[slot],
                )
            plgpu.copy_gmem_to_smem(
                gmem["bias"].at[batch, head, queries, keys], smem["bias"].at[slot],
                produced["k"].at[slot],
            )
            if wait_for_slot:
                plgpu.barrier_wait(consumed["v"].at[slot])
            copy_rows("v", keys, slot)

        for key_tile in range(min(stages, key_tiles)):
            load(jnp.int32(key_tile), key_tile, wait_for_slot=False)

        @pl.loop(stages, max(stages, key_tiles))
        def _(key_tile):
            load(key_tile, lax.rem(key_tile, stages), wait_for_slot=True)

        # Observe the consumers' last releases of every slot, so that no
        # barrier phase is left unobserved when the CTA ends.
        for key_tile in range(max(0, key_tiles - stages), key_tiles):
            plgpu.barrier_wait(consumed["k"].at[key_tile % stages])
            plgpu.barrier_wait(consumed["v"].at[key_tile % stages])


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret", "save_stats"))
def attention_forward(
    q, k, v, bias, mask, gate, *, scale: float, tiles: MosaicTiles, interpret: bool,
    save_stats: bool,
):
    """Runs the Mosaic GPU forward kernel; the contract of the Triton forward.

    Args:
      q, k, v: `[B, S, N, H, d]`, bfloat16 / float16, d in `HEAD_DIMS`, N a
        multiple of `common.RESIDUE_MULTIPLE`.
      bias: `[B, H, N, N]`, 16- or 32-bit float.
      mask: `[B, S, N]` int8 (nonzero keeps) or None.
      gate: `[B, S, N, H, d]` gate logits or None.
      scale: multiplies q . k.
      tiles: the kernel's configuration.
      interpret: run in the Mosaic GPU interpreter (CPU).
      save_stats: also return what the backward needs.

    Returns:
      out `[B, S, N, H, d]` in q's dtype, and, if `save_stats`, the ungated
      attention output `[B, S, N, H, d]` in float32 and the float32 row max
      and log2 row sum, each `[B, S, H, N]`, in base-2 units.
    """
    check_kernel_inputs(q, bias)
    batch, rows, n_res, heads, head_dim = q.shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages

    bias = accumulator_bias(bias, scale)
    bias = pad_residues(bias, swizzled=True)
    if mask is not None:
        mask = pad_residues(mask, swizzled=False)
    inputs = {"q": q, "k": k, "v": v, "bias": bias, "mask": mask, "gate": gate}
    inputs = {name: x for name, x in inputs.items() if x is not None}
    out_types = {"out": jax.ShapeDtypeStruct(q.shape, q.dtype)}
    query_tiles = pl.cdiv(n_res, block_q)
    if save_stats:
        # Whole query tiles, so that no statistics window runs past its plane.
        stats = jax.ShapeDtypeStruct((batch, rows, heads, query_tiles * block_q), jnp.float32)
        out_types |= {
            "attention": jax.ShapeDtypeStruct(q.shape, jnp.float32),
            "row_max": stats, "row_log2_sum": stats,
        }

    smem = {
        "q": smem_tile((msa_rows, block_q, head_dim), q.dtype),
        "k": smem_tile((stages, msa_rows, block_k, head_dim), k.dtype),
        "v": smem_tile((stages, msa_rows, block_k, head_dim), v.dtype),
        "bias": smem_tile((stages, block_q, block_k), bias.dtype),
    }
    k_copies = msa_rows + 1
    if mask is not None:
        smem["mask"] = smem_vectors((stages, msa_rows, 1, block_k), mask.dtype)
        k_copies += msa_rows
    if gate is not None:
        smem["gate"] = smem_tile((msa_rows, block_q, head_dim), gate.dtype)
    if save_stats:
        smem["attention"] = smem_tile((msa_rows, block_q, head_dim), jnp.float32)
        smem["row_max"] = plgpu.SMEM((msa_rows, 1, block_q), jnp.float32)
        smem["row_log2_sum"] = plgpu.SMEM((msa_rows, 1, block_q), jnp.float32)
    produced = {
        "q": plgpu.Barrier(num_arrivals=2 if gate is not None else 1, num_barriers=msa_rows),
        "k": plgpu.Barrier(num_arrivals=k_copies, num_barriers=stages),
        "v": plgpu.Barrier(num_arrivals=msa_rows, num_barriers=stages),
    }
    consumed = {
        name: plgpu.Barrier(num_arrivals=msa_rows, num_barriers=stages) for name in ("k", "v")
    }
    schedule = plgpu.Barrier(num_arrivals=msa_rows)

    body = functools.partial(
        _kernel, scale=scale, n_res=n_res, tiles=tiles,
        msa_rows=msa_rows, heads=heads, dtype=q.dtype, interpret=interpret,
    )

    outs = launch(
        body, name="msa_mosaic_forward", scratch=(smem, produced, consumed, schedule),
        inputs=inputs, out_types=out_types,
        grid=(rows // msa_rows, query_tiles, batch * heads),
        grid_names=("row_groups", "query_tiles", "batch_heads"),
        consumers=msa_rows, interpret=interpret,
    )
    if not save_stats:
        return outs[0]
    out, attention, row_max, row_log2_sum = outs
    return out, attention, row_max[..., :n_res], row_log2_sum[..., :n_res]
