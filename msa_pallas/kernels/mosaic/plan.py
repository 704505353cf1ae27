"""One plan per Mosaic GPU kernel: what a launch allocates and how it runs.

A `KernelPlan` holds a kernel's shared-memory specs, the copies that each
phase of each `produced` barrier awaits (its arrival count is derived from
them), the `consumed` barriers of its rings, its grid, and the shared-memory
bytes all of that takes. Each kernel builds its plan in one function
(`forward_plan`, `dkdv_plan`, `dq_plan`, `dbias_plan`); its launcher and
its default tile choice (`tiles`) both read it, and the tests check the bytes against what the
lowered kernel asks for.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The module, not its function: `block_sizes` imports the tiles, which import
# the plans.
from msa_pallas import block_sizes
from msa_pallas.kernels.constants import FLOAT32_PIECES
from msa_pallas.kernels.mosaic.heads import heads_per_tile, tile_heads
from msa_pallas.kernels.mosaic.pipeline import gpu_multiprocessors, multiprocessors
from msa_pallas.kernels.mosaic.smem import (
    row_tile, smem_tile, smem_vectors, split_tiles, takes_row_views,
)
from msa_pallas.kernels.mosaic.work_items import dead_zeros_smem

if TYPE_CHECKING:
    from msa_pallas.kernels.mosaic.tiles import MosaicTiles

# Mosaic GPU starts every shared-memory allocation of a kernel at a multiple
# of this many bytes, and places the barriers after them.
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8


def _aligned(size: int) -> int:
    return -(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def spec_bytes(spec) -> int:
    """The shared memory one spec takes: a `plgpu.SMEM` its elements, aligned;
    a `plgpu.RefUnion` (views of the same bytes) its largest view's; a tuple
    (bf16 pieces, column pieces, one tile per head) the sum of its members'."""
    if isinstance(spec, tuple):
        return sum(map(spec_bytes, spec))
    if isinstance(spec, plgpu.RefUnion):
        return max(map(spec_bytes, spec.refs))
    return _aligned(math.prod(spec.shape) * jnp.dtype(spec.dtype).itemsize)


def copies_into(spec) -> int:
    """The TMA copies that fill one spec: one per piece of a split operand
    (a tuple, `pipeline.copy_tiles`), else one."""
    return len(spec) if isinstance(spec, tuple) else 1


@dataclasses.dataclass(frozen=True, eq=False)
class KernelPlan:
    """One Mosaic GPU kernel's launch.

    Attributes:
      name: the kernel's name on the GPU (what a profiler lists).
      smem: shared-memory specs by name.
      copies: for each `produced` barrier, the names of `smem` whose copies
        complete one of its phases, a name once per copy issued into it (a
        split operand's pieces counted by `copies_into`).
      produced_barriers: how many barriers each `produced` name has (ring
        slots, or one per consumer).
      consumed_barriers: the rings' `consumed` barriers by name and count;
        each of the `consumers` arrives on them once per step.
      consumers: consumer warpgroups (one producer warpgroup besides).
      grid, grid_names: the CTAs.
      turns: whether the consumers take turns (`pipeline.PingPong`) on a
        barrier of their own.
      work_items: the work items a persistent grid's CTAs share out, or None
        where the grid has one CTA per item.
    """

    name: str
    smem: dict
    copies: dict
    produced_barriers: dict
    consumed_barriers: dict
    consumers: int
    grid: tuple
    grid_names: tuple
    turns: bool = True
    work_items: tuple | None = None

    def arrivals(self, barrier: str) -> int:
        """The copies that complete one phase of `produced[barrier]`."""
        return sum(copies_into(self.smem[name]) for name in self.copies[barrier])

    def barriers(self) -> tuple[dict, dict, list]:
        """The `produced` and `consumed` barrier specs by name, and the
        consumers' turn barrier (a list of one, or empty)."""
        produced = {
            name: plgpu.Barrier(num_arrivals=self.arrivals(name), num_barriers=count)
            for name, count in self.produced_barriers.items()
        }
        consumed = {
            name: plgpu.Barrier(num_arrivals=self.consumers, num_barriers=count)
            for name, count in self.consumed_barriers.items()
        }
        turn = [plgpu.Barrier(num_arrivals=self.consumers)] if self.turns else []
        return produced, consumed, turn

    def scratch(self) -> tuple:
        """What `pipeline.launch` allocates: `(smem, produced, consumed)`,
        then the turn barrier where the consumers take turns."""
        produced, consumed, turn = self.barriers()
        return (self.smem, produced, consumed, *turn)

    @property
    def shared_memory_bytes(self) -> int:
        """The shared memory one CTA asks for: every spec aligned, then 8
        bytes per barrier."""
        barriers = (
            sum(self.produced_barriers.values()) + sum(self.consumed_barriers.values())
            + self.turns
        )
        return sum(map(spec_bytes, self.smem.values())) + BARRIER_BYTES * barriers


def dbias_in_bias_tile(pieces: int, bias_dtype) -> bool:
    """Whether the kernel writes its result through the bias tile's shared
    memory instead of a tile of its own: for float32 q (split into
    `pieces` > 1, which need the room) with a float32 bias."""
    return pieces > 1 and jnp.dtype(bias_dtype).itemsize == 4


def _item_grid(items: tuple, tile_axis: str, persistent: bool, interpret: bool):
    """(grid, grid_names) for work items `items` = (B * H', tiles, MSA-row
    groups): one CTA per item, the row groups fastest, on axes
    ("row_groups", `tile_axis`, "batch_heads"); or, `persistent`, one CTA
    per SM ("ctas"), never more than there are items."""
    if persistent:
        return (min(math.prod(items), multiprocessors(interpret)),), ("ctas",)
    return items[::-1], ("row_groups", tile_axis, "batch_heads")


def zeroes_masked_queries(mask_queries: bool, tiles: MosaicTiles) -> bool:
    """Whether the forward kernel writes the zeros of the masked queries
    itself (`forward.attention_forward`'s `mask_queries` on a persistent
    grid), which its plan provides for: its items zero their masked
    queries, and the producer's third warp, idle beside the K and V rings'
    warps, stores the zeros of the rows and query tiles that have no item,
    in boxes of whole rows (`work_items.RowZeros`), while the consumers
    compute. With one CTA per item,
    `triton.dead_rows.zero_masked_queries` writes them after the kernel, a
    pass of its own (at the padded extra MSA on an H100, 13.5 us of the
    forward's 240, 2026-12-06). Stored by the consumers after their items,
    the same zeros cost that forward 77 us more; from the spare warp its
    forward took 3.2-7.6% less than with the pass (benchmarks/log,
    2026-12-06 08 and 10)."""
    return mask_queries and tiles.persistent


def forward_plan(
    q_shape, q_dtype, bias_dtype, tiles: MosaicTiles, *, mask_dtype, gate_dtype,
    save_stats: bool, interpret: bool, mask_queries: bool = False,
) -> KernelPlan:
    """The forward kernel's plan for q of `q_shape` `[B, S, N, H, d]` (d = 8
    with an even H: two heads per tile, `heads.pairs_heads`), a mask and a
    gate of these dtypes (None: none), with the residuals or without.
    `mask_queries` (with a mask): the mask masks queries too, and where the
    grid is persistent the kernel writes every zero of the output itself
    (`zeroes_masked_queries`): each consumer loads its item's query
    mask with the gate ("q"), and the producer stores a tile of zeros
    (`work_items.dead_zeros_smem`) over the rows and query tiles without
    items.

    Shared memory: each consumer's q tile (and one copy per head of it for
    two heads per tile), gate and output tiles, the residual and statistics
    tiles; the ring's K, V, bias and mask tiles. The producer's "k" ring
    step copies each consumer's K tile and mask vector and the bias tile of
    each head, its "v" step each consumer's V tile; each consumer loads its
    own q and gate tiles ("q"). Padding skipping (`kernels.key_tiles`)
    takes no shared memory: the kernel reads its bounds from GMEM.
    """
    batch, rows, n_res, heads, head_dim = q_shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile(head_dim, heads)
    tile_dim = head_dim * pair
    row_views = takes_row_views(n_res, interpret)
    rows_tile = lambda shape, dtype: row_tile(shape, dtype, row_views)  # noqa: E731
    smem = {
        "q": rows_tile((msa_rows, block_q, tile_dim), q_dtype),
        "k": rows_tile((stages, msa_rows, block_k, tile_dim), q_dtype),
        "v": rows_tile((stages, msa_rows, block_k, tile_dim), q_dtype),
        "bias": smem_tile((stages, pair, block_q, block_k), bias_dtype),
    }
    if pair > 1:
        # One ref per head: a wgmma operand indexed by a constant fails to lower.
        smem["q_heads"] = tuple(
            smem_tile((msa_rows, block_q, tile_dim), q_dtype) for _ in range(pair)
        )
    if mask_dtype is not None:
        smem["mask"] = smem_vectors((stages, msa_rows, 1, block_k), mask_dtype)
    if gate_dtype is not None:
        smem["gate"] = rows_tile((msa_rows, block_q, tile_dim), gate_dtype)
    if save_stats:
        smem["attention"] = rows_tile((msa_rows, block_q, tile_dim), jnp.float32)
        smem["row_max"] = plgpu.SMEM((msa_rows, pair, block_q), jnp.float32)
        smem["row_log2_sum"] = plgpu.SMEM((msa_rows, pair, block_q), jnp.float32)
    if tiles.persistent:
        smem["out"] = rows_tile((msa_rows, block_q, tile_dim), q_dtype)
    masks = ("mask",) * msa_rows if mask_dtype is not None else ()
    copies = {
        "q": ("q",) + ("gate",) * (gate_dtype is not None),
        "k": ("k",) * msa_rows + masks + ("bias",) * pair,
        "v": ("v",) * msa_rows,
    }
    if zeroes_masked_queries(mask_queries, tiles) and mask_dtype is not None:
        smem["query_mask"] = smem_vectors((msa_rows, 1, block_q), mask_dtype)
        copies["q"] += ("query_mask",)
        # Chunks of at most a query tile's residues: the query tiles without
        # items start at a chunk.
        smem["dead_zeros"] = dead_zeros_smem(
            heads // pair * tile_dim, q_dtype, min(n_res, block_q)
        )
    # Work items, the MSA-row groups fastest.
    items = (batch * heads // pair, pl.cdiv(n_res, block_q), rows // msa_rows)
    grid, grid_names = _item_grid(items, "query_tiles", tiles.persistent, interpret)
    return KernelPlan(
        name="msa_mosaic_forward", smem=smem, copies=copies,
        produced_barriers={"q": msa_rows, "k": stages, "v": stages},
        consumed_barriers={"k": stages, "v": stages}, consumers=msa_rows, grid=grid,
        grid_names=grid_names, work_items=items,
    )


def _backward_operand_tiles(q_shape, q_dtype, interpret: bool):
    """What the backward plans share about q, k, v and do for q of `q_shape`:
    heads per tile (`heads.tile_heads`), bf16 pieces per operand (3 for
    float32, else 1), whether row tiles are view pairs (`smem.takes_row_views`),
    and a function of a tile shape giving the operand's shared-memory tile(s)
    (`smem.split_tiles`)."""
    pieces = FLOAT32_PIECES if jnp.dtype(q_dtype) == jnp.float32 else 1
    row_views = takes_row_views(q_shape[2], interpret)

    def operand_tiles(shape):
        return split_tiles(shape, q_dtype, pieces, row_views)

    return tile_heads(q_shape, q_dtype), pieces, row_views, operand_tiles


# The dk/dv kernel's keys per consumer (`dkdv_plan`).
DKDV_BLOCK_K = (64, 128, 256)


def _ring_words(stages: int, copies: int, heads: int, length: int):
    """A ring's dropout words (`dropout_words.copy_words_to_ring`): per slot,
    `copies` copies of `heads` heads' `length` words each."""
    return smem_vectors((stages, copies, heads, length), jnp.uint32)


def dkdv_plan(
    q_shape, q_dtype, bias_dtype, tiles: MosaicTiles, *, mask_dtype, interpret: bool,
    dead_rows: bool = False, dropout: bool = False,
):
    """The dk/dv kernel's plan for q of `q_shape` `[B, S, N, H, d]` (d = 8
    with an even H and 16 bits: two heads per tile, `heads.tile_heads`;
    float32: bf16 pieces) and a mask of `mask_dtype` (None: none).
    `dead_rows` (with a mask): whether each consumer also loads the dv its
    row takes where the kernel skips the tile of a dead row ("dead_dv",
    a barrier of its own: it is read after the loop). `dropout`: with
    attention dropout, whose words of the step's queries ride the ring, a
    copy per consumer (`dropout_words.copy_words_to_ring`).

    Shared memory: each consumer's K and V tiles (and one copy per head of
    each for two heads per tile), its float32 dK and dV tiles (float32
    inputs), its mask vector and dead row's dv; the ring's q, do,
    statistics and transposed bias tiles. Each consumer loads its own K, V
    and mask ("kv") and dead row's dv ("dead_dv"); the
    producer's step copies each consumer's q and do tiles and statistics
    and the bias tile of each head. The grid: a CTA per work item (B * H',
    key tiles, row groups), or with `tiles.persistent` one per SM sharing
    them out (`work_items.BackwardItems`).
    """
    batch, rows, n_res, heads, head_dim = q_shape
    if tiles.block_k not in DKDV_BLOCK_K:
        # Measured on the H200 (jax 0.11.2): block_k = 192 compiles, then the
        # launch fails with a misaligned address, which poisons the process.
        raise ValueError(
            f"block_k={tiles.block_k}: the dk/dv kernel takes block_k in {DKDV_BLOCK_K}."
        )
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair, pieces, row_views, operand_tiles = _backward_operand_tiles(q_shape, q_dtype, interpret)
    tile_dim = head_dim * pair
    smem = {
        "k": operand_tiles((msa_rows, block_k, tile_dim)),
        "v": operand_tiles((msa_rows, block_k, tile_dim)),
        "q": operand_tiles((stages, msa_rows, block_q, tile_dim)),
        "do": operand_tiles((stages, msa_rows, block_q, tile_dim)),
        "stats": smem_vectors((stages, msa_rows, pair, 3, block_q), jnp.float32),
        "bias": smem_tile((stages, pair, block_k, block_q), bias_dtype),
    }
    if pair > 1:
        for name in ("k_heads", "v_heads"):
            smem[name] = tuple(
                smem_tile((msa_rows, block_k, tile_dim), q_dtype) for _ in range(pair)
            )
    if pieces > 1:
        smem["dk"] = row_tile((msa_rows, block_k, tile_dim), jnp.float32, row_views)
        smem["dv"] = row_tile((msa_rows, block_k, tile_dim), jnp.float32, row_views)
    if mask_dtype is not None:
        smem["mask"] = smem_vectors((msa_rows, 1, block_k), mask_dtype)
    step_copies = ("q", "do", "stats")
    if dropout:
        smem["query_words"] = _ring_words(stages, msa_rows, pair, block_q)
        step_copies += ("query_words",)
    copies = {
        "kv": ("k", "v", "mask") if mask_dtype is not None else ("k", "v"),
        "step": step_copies * msa_rows + ("bias",) * pair,
    }
    produced = {"kv": msa_rows, "step": stages}
    if mask_dtype is not None and tiles.persistent:
        # The dead row groups' zeros, every head's at once.
        smem["dead_zeros"] = dead_zeros_smem(heads * head_dim, q_dtype, n_res)
    if mask_dtype is not None and dead_rows:
        smem["dead_dv"] = smem_vectors((msa_rows, 1, tile_dim), jnp.float32)
        copies["dead_dv"] = ("dead_dv",)
        produced["dead_dv"] = msa_rows
    # Work items, the MSA-row groups fastest.
    items = (batch * heads // pair, pl.cdiv(n_res, block_k), rows // msa_rows)
    grid, grid_names = _item_grid(items, "key_tiles", tiles.persistent, interpret)
    return KernelPlan(
        name="msa_mosaic_dkdv", smem=smem, copies=copies,
        produced_barriers=produced,
        consumed_barriers={"step": stages}, consumers=msa_rows,
        grid=grid, grid_names=grid_names, work_items=items,
    )


def dq_plan(
    q_shape, q_dtype, bias_dtype, tiles: MosaicTiles, *, mask_dtype, interpret: bool,
    dropout: bool = False,
):
    """The dq kernel's plan (arguments as in `dkdv_plan`; with `dropout` the
    words of the step's keys ride the ring).

    Shared memory: each consumer's q and do tiles (and one copy per head of
    each for two heads per tile), statistics and float32 dq tile (float32
    inputs); the ring's K, V, mask and bias tiles. Each consumer loads its
    own q, do and statistics ("q"); the producer's step copies each
    consumer's K and V tiles and mask vector and the bias tile of each head.
    The grid: a CTA per work item, or with `tiles.persistent` one per SM
    sharing them out (`work_items.BackwardItems`), as for dk/dv.
    """
    batch, rows, n_res, heads, head_dim = q_shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair, pieces, row_views, operand_tiles = _backward_operand_tiles(q_shape, q_dtype, interpret)
    tile_dim = head_dim * pair
    smem = {
        "q": operand_tiles((msa_rows, block_q, tile_dim)),
        "do": operand_tiles((msa_rows, block_q, tile_dim)),
        "stats": smem_vectors((msa_rows, pair, 3, block_q), jnp.float32),
        "k": operand_tiles((stages, msa_rows, block_k, tile_dim)),
        "v": operand_tiles((stages, msa_rows, block_k, tile_dim)),
        "bias": smem_tile((stages, pair, block_q, block_k), bias_dtype),
    }
    if pair > 1:
        for name in ("q_heads", "do_heads"):
            smem[name] = tuple(
                smem_tile((msa_rows, block_q, tile_dim), q_dtype) for _ in range(pair)
            )
    if pieces > 1:
        smem["dq"] = row_tile((msa_rows, block_q, tile_dim), jnp.float32, row_views)
    key_copies = ("k", "v")
    if mask_dtype is not None:
        smem["mask"] = smem_vectors((stages, msa_rows, 1, block_k), mask_dtype)
        key_copies += ("mask",)
    if dropout:
        smem["key_words"] = _ring_words(stages, msa_rows, pair, block_k)
        key_copies += ("key_words",)
    if mask_dtype is not None and tiles.persistent:
        # The dead row groups' zeros, every head's at once.
        smem["dead_zeros"] = dead_zeros_smem(heads * head_dim, q_dtype, n_res)
    copies = {"q": ("q", "do", "stats"), "step": key_copies * msa_rows + ("bias",) * pair}
    # Work items, the MSA-row groups fastest.
    items = (batch * heads // pair, pl.cdiv(n_res, block_q), rows // msa_rows)
    grid, grid_names = _item_grid(items, "query_tiles", tiles.persistent, interpret)
    return KernelPlan(
        name="msa_mosaic_dq", smem=smem, copies=copies,
        produced_barriers={"q": msa_rows, "step": stages},
        consumed_barriers={"step": stages}, consumers=msa_rows,
        grid=grid, grid_names=grid_names, work_items=items,
    )


def dbias_plan(
    q_shape, q_dtype, bias_dtype, tiles: MosaicTiles, *, mask_dtype, interpret: bool,
    dropout: bool = False,
):
    """The dbias kernel's plan (arguments as in `dkdv_plan`; `tiles.msa_rows`
    consumers split the CTA's query tile); `dropout`: with attention dropout.

    Shared memory: each consumer's bias tile and float32 result tile (unless
    `dbias_in_bias_tile`); the ring's q, do and statistics tiles of each
    consumer, and K, V and mask of the step's MSA row. Each consumer loads
    its own bias tile ("bias"); the producer's step copies each consumer's
    q and do tiles and statistics, and the row's K and V tiles and mask.
    With dropout the step also copies the row's dropout words, each
    consumer's queries' and the keys' (`dropout_words`): each step is
    another row, whose words, read from GMEM in the step, would wait there.
    """
    batch, rows, n_res, heads, head_dim = q_shape
    consumers = tiles.msa_rows
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair, pieces, row_views, operand_tiles = _backward_operand_tiles(q_shape, q_dtype, interpret)
    tile_dim = head_dim * pair
    smem = {"bias": smem_tile((consumers, block_q, block_k), bias_dtype)}
    if not dbias_in_bias_tile(pieces, bias_dtype):
        smem["dbias"] = smem_tile((consumers, block_q, block_k), jnp.float32)
    smem |= {
        "q": operand_tiles((stages, consumers, block_q, tile_dim)),
        "do": operand_tiles((stages, consumers, block_q, tile_dim)),
        "stats": smem_vectors((stages, consumers, 3, block_q), jnp.float32),
        "k": operand_tiles((stages, block_k, tile_dim)),
        "v": operand_tiles((stages, block_k, tile_dim)),
    }
    row_copies = ("k", "v")
    if mask_dtype is not None:
        smem["mask"] = smem_vectors((stages, 1, block_k), mask_dtype)
        row_copies += ("mask",)
    consumer_copies = ("q", "do", "stats")
    if dropout:
        smem["query_words"] = _ring_words(stages, consumers, 1, block_q)
        smem["key_words"] = _ring_words(stages, 1, 1, block_k)
        consumer_copies += ("query_words",)
        row_copies += ("key_words",)
    query_tiles = pl.cdiv(n_res, block_q * consumers)
    key_tiles = pl.cdiv(n_res, block_k)
    # One CTA per SM (the shared memory allows no second); sized for the GPU in
    # the interpreter too, so that it splits S as the GPU does.
    chunks = block_sizes.row_chunks_in_waves(
        query_tiles * key_tiles * batch * heads // pair, rows, slots=gpu_multiprocessors()
    )
    return KernelPlan(
        name="msa_mosaic_dbias", smem=smem,
        copies={"bias": ("bias",), "step": consumer_copies * consumers + row_copies},
        produced_barriers={"bias": consumers, "step": stages},
        consumed_barriers={"step": stages}, consumers=consumers,
        grid=(query_tiles, key_tiles, chunks * batch * heads // pair),
        grid_names=("query_tiles", "key_tiles", "chunk_batch_heads"), turns=False,
    )
