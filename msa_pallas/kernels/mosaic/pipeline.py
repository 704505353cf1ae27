"""The warp specialisation every Mosaic GPU kernel here shares: consumer
warpgroups compute, one producer warpgroup streams the tiles of each loop
step by TMA into a `num_stages`-deep ring of shared-memory slots
(`produce`, between loop bounds that may be known only at run time;
`ring_slot`). A slot's `produced` barrier completes when its copies have
landed; each consumer arrives on the slot's `consumed` barrier when it is
done with it. Also: the consumers' ping-pong (`PingPong`), the register
budgets, the persistent grid's size and the launch (`launch`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


# Registers of the producer warpgroup: it only issues copies.
PRODUCER_REGISTERS = 40
# An SM's register file, the most registers a thread holds at launch, and the
# most the consumers ask for (`setmaxnreg` takes multiples of 8).
REGISTER_FILE = 65536
MAX_THREAD_REGISTERS = 255
MAX_CONSUMER_REGISTERS = 240
WARPGROUP_THREADS = 128
# Streaming multiprocessors of an H100 / H200 SXM: the persistent grid's
# size when lowering for one from a host without a GPU.
HOPPER_MULTIPROCESSORS = 132
# CTAs of a persistent grid in the interpreter: few, so that each runs
# several items (on a machine with few cores the interpreter stalls on the
# persistent grid: the tests run it on the GPU).
INTERPRETED_CTAS = 3
# The row reductions stay inside warps: no shared scratch for them.
COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


class PingPong:
    """Two consumer warpgroups taking turns, so that one's softmax work (the
    exponential and FP32 units) overlaps the other's matrix products.

    Each loop step: issue the first products and `hand_over()` while they
    run; the elementwise work; `release()`, then `take_turn()` before the
    second products. `start()` before the loop and `finish()` after it
    offset the two warpgroups by half a step and balance the barrier's
    arrivals. With `enabled` False every method does nothing.
    """

    def __init__(self, barrier, wg, enabled: bool):
        self.barrier, self.wg, self.enabled = barrier, wg, enabled

    def _sync(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def start(self):
        if self.enabled:
            pl.when(self.wg == 1)(self._sync)

    def hand_over(self):
        if self.enabled:
            self._sync()

    def release(self):
        if self.enabled:
            plgpu.barrier_arrive(self.barrier)

    def take_turn(self):
        if self.enabled:
            plgpu.barrier_wait(self.barrier)

    def finish(self):
        if self.enabled:
            pl.when(self.wg == 0)(self._sync)


def consumer_register_budget(consumers: int) -> int:
    """Registers per thread of a consumer warpgroup: what the producer
    (`producer_registers`) gives up, split among `consumers`.

    `setmaxnreg` moves registers within the CTA's launch allocation (every
    thread's count at launch, in units of 8, at most 65536 in all); an
    increase that asks for more than the decreases freed waits for ever.
    With 1 consumer the per-thread ceiling binds (240 of 255); with 2, 168
    at launch leave 232.
    """
    threads = (consumers + 1) * WARPGROUP_THREADS
    at_launch = min(MAX_THREAD_REGISTERS, REGISTER_FILE // threads // 8 * 8)
    freed = (at_launch - PRODUCER_REGISTERS) * WARPGROUP_THREADS
    return min(MAX_CONSUMER_REGISTERS, at_launch + freed // consumers // WARPGROUP_THREADS // 8 * 8)


def consumer_registers(consumers: int) -> None:
    """Raises a consumer warpgroup's register budget (`consumer_register_budget`)."""
    plgpu.set_max_registers(consumer_register_budget(consumers), action="increase")


def producer_registers() -> None:
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")


def copy_tiles(gmem, smem, names, source_index, destination_index, barrier) -> None:
    """TMA copies `gmem[name].at[source_index]` -> `smem[name].at[destination_index]`
    for each name, all completing `barrier`.

    A split float32 operand (`split_float32`) leads with its pieces in GMEM
    and is a tuple of one shared-memory ref per piece: every piece is copied.
    """
    as_tuple = lambda index: index if isinstance(index, tuple) else (index,)  # noqa: E731
    source_index, destination_index = as_tuple(source_index), as_tuple(destination_index)
    for name in names:
        if isinstance(smem[name], tuple):
            copies = [((piece, *source_index), ref) for piece, ref in enumerate(smem[name])]
        else:
            copies = [(source_index, smem[name])]
        for source, destination in copies:
            plgpu.copy_gmem_to_smem(gmem[name].at[source], destination.at[destination_index], barrier)


def run_when(condition, body) -> None:
    """Runs `body()` where `condition` holds: at once for a Python True (the
    trace as if unconditional), under `pl.when` for a traced bool."""
    if condition is True:
        body()
    else:
        pl.when(condition)(body)


def ring_slot(index, lower, stages: int):
    """The ring slot of tile `index` of a loop that starts at tile `lower`:
    its step `index - lower` modulo `stages`."""
    if isinstance(lower, int) and lower == 0:
        return lax.rem(index, stages)
    return lax.rem(index - lower, stages)


def produce(lower, upper, stages: int, issue_copies, consumed) -> None:
    """The producer's loop over one item's tiles `lower <= index < upper`
    (Python ints, or int32 known at run time with lower < upper), the ring's
    steps 0, 1, ...: `issue_copies(index, slot)` for every tile, each into
    its ring slot once the consumers have released that slot.

    Args:
      lower, upper: the loop's bounds.
      stages: ring depth.
      issue_copies: issues the TMA copies of tile `index` into slot `slot`.
      consumed: `[stages]` barriers the consumers arrive on.
    """
    static = isinstance(lower, int) and isinstance(upper, int)
    # The first `stages` steps find their slots free.
    for step in range(min(stages, upper - lower) if static else stages):
        if static:
            issue_copies(jnp.int32(lower + step), step)
        else:
            pl.when(lower + step < upper)(
                lambda step=step: issue_copies(lower + step, step)
            )

    @pl.loop(lower + stages, max(lower + stages, upper) if static else upper)
    def _(index):
        slot = ring_slot(index, lower, stages)
        plgpu.barrier_wait(consumed.at[slot])
        issue_copies(index, slot)

    # Observe the consumers' last release of every slot, so that no barrier
    # phase is left unobserved when the CTA ends.
    steps = upper - lower
    if static:
        for step in range(max(0, steps - stages), steps):
            plgpu.barrier_wait(consumed.at[step % stages])
        return
    for back in range(stages, 0, -1):
        pl.when(steps >= back)(
            lambda back=back: plgpu.barrier_wait(consumed.at[lax.rem(steps - back, stages)])
        )


def batch_head_and_warpgroup(heads: int):
    """(batch, head, wg) of this thread, for grids whose last axis is the
    flattened B * H ("batch_heads")."""
    batch_head = lax.axis_index("batch_heads")
    return lax.div(batch_head, heads), lax.rem(batch_head, heads), lax.axis_index("wg")


def gpu_multiprocessors() -> int:
    """The SMs of the GPU the kernels run on (an H100 / H200's without one)."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return device.core_count
    return HOPPER_MULTIPROCESSORS


def multiprocessors(interpret: bool) -> int:
    """The CTAs of a persistent grid: one per SM of the GPU the kernel runs on."""
    return INTERPRETED_CTAS if interpret else gpu_multiprocessors()


def launch(body, plan, *, inputs: dict, out_types: dict, interpret: bool):
    """Runs `body(gmem, *plan.scratch())` as the warp-specialised kernel of
    `plan` (a `plan.KernelPlan`): `plan.consumers` consumer warpgroups and
    one producer (the last `wg`), on `plan.grid`.

    `gmem` maps the names of `inputs` and `out_types` to their refs.
    """
    names = (*inputs, *out_types)

    def entry(*refs):
        gmem = dict(zip(names, refs))
        # The kernel's index arithmetic is int32 whatever `jax_enable_x64`
        # says: traced with it on, its Python ints would be int64 operands.
        with jax.enable_x64(False):
            pl.run_scoped(lambda *scratch_refs: body(gmem, *scratch_refs), *plan.scratch(),
                          collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=tuple(out_types.values()),
        grid=plan.grid,
        grid_names=plan.grid_names,
        num_threads=plan.consumers + 1,
        thread_name="wg",
        kernel_name=plan.name,
        compiler_params=COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*inputs.values())
