"""Which kernels run a call of `msa_row_attention`, with which tiles, and why.

`plan_call` answers, for one call, with a frozen `CallPlan`: the forward
kernel and the backward kernels (`"xla"`, `"triton"` or `"mosaic"`), their
tiles, the zero-padding of the head dim, the dtype the kernels read the bias
in, compiled or interpreted, and a one-line reason. The op runs the plan;
`kernels/vjp.py` branches on it alone; `msa_pallas.explain` prints it.

The rule (this is its one description):

- `implementation="xla"`: the plain-`jnp` path. `"triton"` (or `"pallas"`,
  the same): the Triton kernels, forward and backward. `"mosaic"`: the Mosaic
  GPU kernels where `kernels.mosaic.support.supports` takes the inputs, else a
  ValueError that says why; float32 inputs there run the Triton forward (three
  TF32 products) and the Mosaic backward (three bf16 pieces per operand).
  Off a GPU the kernels run in their interpreters (slow; for tests).
- `implementation=None`: `"xla"` for dtypes or head dims the kernels do not
  take (float64, d > 128), or off a GPU. On a Hopper
  GPU (sm90: H100, H200) `"mosaic"` where it was measured faster and takes
  the inputs: 16-bit inputs with N >= `MOSAIC_MIN_RESIDUES`; float32 inputs
  with a float32 bias and N >= `MOSAIC_FLOAT32_MIN_RESIDUES` a multiple of
  `MOSAIC_FLOAT32_RESIDUE_MULTIPLE`. `"triton"` on every other GPU call.
- d < 16 on the Mosaic kernels: d = 8 with an even H is read as it is, two
  heads per tile (`pairs_heads`; the float32 backward excepted); other d are
  zero-padded to 16 and the padded columns sliced off.
- The target is the GPU the call is traced for: JAX's default device, or the
  abstract device of the current abstract mesh (`exporting.gpu_target`), so
  an export for "NVIDIA H200" holds the kernels an H200 would run.
- Attention dropout runs in every backend (`msa_pallas.dropout`: the same
  mask everywhere); skipping padding with dropout, the forward and dk/dv
  visit the fully masked rows whole (their uniform weights are dropped
  too) and skip the masked key tiles of the others.
- Tiles: `block_config` where given (its `mosaic_*` fields for the Mosaic
  kernels), else `block_sizes.default_block_config` and the Mosaic kernels'
  own `default_tiles`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from msa_pallas.block_sizes import BlockConfig, default_block_config
from msa_pallas.kernels.key_tiles import skips_padding
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.heads import pairs_heads
from msa_pallas.kernels.mosaic.support import pad_head_dim
from msa_pallas.kernels.mosaic.support import supports as mosaic_supports
from msa_pallas.validation import (
    IMPLEMENTATION_ALIASES, IMPLEMENTATIONS, KERNEL_DTYPES, MAX_KERNEL_HEAD_DIM,
    canonical_implementation, validate_arguments, validate_block_config, validate_dropout,
)

__all__ = [
    "CallPlan", "Target", "plan_call", "current_target", "IMPLEMENTATIONS",
    "IMPLEMENTATION_ALIASES",
]

# 16-bit on Hopper: from this N the Mosaic kernels, forward and backward, are
# faster than the Triton ones (measured from N = 200 up, the train crop
# N = 256 included, and at N no multiple of 8 with d <= 64;
# benchmarks/RESULTS.md).
MOSAIC_MIN_RESIDUES = 192
# float32 with a float32 bias: the Triton forward and the Mosaic backward
# (bf16 pieces) were faster than the Triton kernels from N = 256 (the train
# crop) up, at N a multiple of 128 (benchmarks/RESULTS.md); other N were not
# measured and run the Triton kernels.
MOSAIC_FLOAT32_MIN_RESIDUES = 256
MOSAIC_FLOAT32_RESIDUE_MULTIPLE = 128
# The Mosaic GPU kernels use Hopper's wgmma and TMA: compute capability 9.x.
HOPPER = 90

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# Compute capability of the NVIDIA device kinds an abstract device may name
# (no GPU to ask). Longer names first: "GH200" before "H200", "A100" before "A10".
_COMPUTE_CAPABILITY_OF_KIND = (
    ("GH200", 90), ("H200", 90), ("H100", 90), ("H800", 90), ("H20", 90),
    ("GB200", 100), ("B200", 100), ("A100", 80), ("A800", 80), ("A30", 80), ("A10", 86),
    ("L40", 89), ("L4", 89), ("RTX 4090", 89), ("T4", 75), ("V100", 70),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a call is traced for.

    Attributes:
      platform: `"gpu"`, `"cpu"`, `"tpu"`, ...
      compute_capability: e.g. 90 for an H100 / H200, 80 for an A100; None
        off a GPU or for a GPU whose generation is unknown.
    """

    platform: str
    compute_capability: int | None = None

    @property
    def gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def hopper(self) -> bool:
        return self.gpu and self.compute_capability is not None and (
            self.compute_capability // 10 == HOPPER // 10
        )

    def __str__(self) -> str:
        if self.gpu and self.compute_capability is not None:
            return f"gpu sm{self.compute_capability}"
        return self.platform


def compute_capability_of_kind(device_kind: str) -> int | None:
    """90 for "NVIDIA H200" and the like; None for a device kind not listed."""
    for name, capability in _COMPUTE_CAPABILITY_OF_KIND:
        if re.search(rf"\b{re.escape(name)}\b", device_kind):
            return capability
    return None


def current_target() -> Target:
    """The target `msa_row_attention` traces for now: the abstract device of
    the current abstract mesh where one is set (`jax.sharding.use_abstract_mesh`,
    as `msa_pallas.exporting.gpu_target` sets to export for a GPU from a host
    without one; its device kind gives the GPU generation), else JAX's
    default device. Pallas's Triton lowering reads the same abstract device."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        platform = "gpu" if device.platform in _GPU_PLATFORMS else device.platform
        capability = compute_capability_of_kind(device.device_kind) if platform == "gpu" else None
        return Target(platform, capability)
    platform = jax.default_backend()
    platform = "gpu" if platform in _GPU_PLATFORMS else platform
    if platform != "gpu":
        return Target(platform)
    local = jax.devices()[0]
    capability = str(getattr(local, "compute_capability", ""))
    if re.fullmatch(r"\d+\.\d+", capability):
        major, minor = capability.split(".")
        return Target("gpu", 10 * int(major) + int(minor))
    return Target("gpu", compute_capability_of_kind(local.device_kind))


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What one call of `msa_row_attention` runs (hashable: a static argument).

    Attributes:
      implementation: `"xla"`, `"triton"` or `"mosaic"`.
      forward: the forward kernel's backend, `"xla"`, `"triton"` or
        `"mosaic"` (float32 on `"mosaic"` runs the Triton forward).
      backward: the backward kernels' backend (either follows either forward:
        the residuals are the same).
      forward_tiles: `KernelTiles` (Triton) or `MosaicTiles`; None for xla.
      backward_tiles: `(kernel, tiles)` per backward kernel, in launch order:
        Triton `dkdv` then `dq` and `dbias`, or the fused `dq_dbias`; Mosaic
        `dkdv`, `dq`, `dbias`.
      ping_pong: the Mosaic dk/dv and dq kernels' two consumers take turns.
      head_dim: d of the call.
      forward_head_dim, backward_head_dim: d the kernels read: above
        `head_dim` where q, k, v (and `do`, the gate) are zero-padded first.
      bias_dtype: the dtype name the kernels read the bias in, None for its own.
      interpret: the kernels run in their interpreters (off a GPU).
      skips_padding: the kernels skip the key tiles and MSA rows the mask
        removes (`kernels.key_tiles.skipping_padding`; a mask given). With
        dropout the forward and dk/dv visit the rows that keep no key.
      dropout_rate: attention dropout's rate (`msa_pallas.dropout`); 0 for none.
      masks_queries: the mask masks queries too (the op's `mask_queries`; a
        mask given): the output is 0 at a masked residue.
      prologue_kernel: the backward kernels' `do` and stacked statistics
        (and the gate's gradient, and skipping, the dead rows' dv) come from
        one Pallas kernel (`kernels.triton.backward_prologue`), not XLA's
        passes: asked by `MosaicBackwardTiles.prologue_kernel`, taken on the
        Mosaic forward and backward without dropout.
      target: the device traced for.
      reason: why these kernels, in one line.
    """

    implementation: str
    forward: str
    backward: str
    # Not in the plan's hash: two calls that run the same kernels share the
    # compiled custom VJP whatever the words.
    reason: str = dataclasses.field(compare=False)
    target: Target
    head_dim: int
    forward_head_dim: int
    backward_head_dim: int
    forward_tiles: object = None
    backward_tiles: tuple = ()
    ping_pong: bool = False
    bias_dtype: str | None = None
    interpret: bool = False
    skips_padding: bool = False
    dropout_rate: float = 0.0
    prologue_kernel: bool = False
    masks_queries: bool = False

    @property
    def kernels_mask_queries(self) -> bool:
        """Whether the kernels give the masked queries their zeros (and
        skip them): skipping padding on the Mosaic forward and backward with
        the prologue kernel (no dropout). Elsewhere the op zeroes them after
        the kernels (`attention.run_plan`), and the gradients follow."""
        return self.masks_queries and self.skips_padding and self.prologue_kernel

    def tiles_of(self, kernel: str):
        """The tiles of backward kernel `kernel`, or None where it does not run."""
        return dict(self.backward_tiles).get(kernel)

    def __str__(self) -> str:
        mode = "interpreted" if self.interpret else "compiled"
        lines = [f"msa_row_attention: {self.implementation} ({mode}, target {self.target})"]
        if self.implementation == "xla":
            lines.append("  forward, backward: plain jnp (XLA)")
        else:
            lines.append(f"  forward:  {self.forward} {self.forward_tiles}")
            turns = ", consumers ping-pong" if self.backward == "mosaic" and self.ping_pong else ""
            lines.append(f"  backward: {self.backward}{turns}")
            lines += [f"    {kernel}: {tiles}" for kernel, tiles in self.backward_tiles]
            if self.skips_padding and self.dropout_rate:
                lines.append("  padding: masked key tiles skipped; rows that keep no key skipped"
                             " by dq and dbias alone (dropout drops their uniform weights)")
            elif self.skips_padding:
                lines.append("  padding: key tiles and MSA rows the mask removes are skipped")
            if self.kernels_mask_queries:
                lines.append("  masked queries: output 0, skipped by every kernel")
            elif self.masks_queries:
                lines.append("  masked queries: output 0, set after the kernels")
            if self.prologue_kernel:
                lines.append("  backward prologue: do, the gate's gradient and the statistics"
                             " (skipping, dead rows' dv) in one Pallas kernel")
            if self.dropout_rate:
                lines.append(f"  attention dropout: rate {self.dropout_rate} in the kernels")
            for name, width in (("forward", self.forward_head_dim),
                                ("backward", self.backward_head_dim)):
                if width != self.head_dim:
                    lines.append(f"  {name} head dim: d = {self.head_dim} zero-padded to {width}")
            if self.bias_dtype is not None:
                lines.append(f"  bias read as {self.bias_dtype} (round_bias)")
        lines.append(f"  why: {self.reason}")
        return "\n".join(lines)


def choose_implementation(
    implementation, q, bias, dropout_rate: float, target: Target
) -> tuple[str, str]:
    """`(implementation, reason)` by the rule in this module's docstring.

    Runs before the arguments are validated (a malformed q must reach the
    checks that name it), so it reads shapes and dtypes defensively.
    """
    requested = canonical_implementation(implementation)
    where = "interpreted off a GPU" if not target.gpu else f"on {target}"
    if requested is not None:
        return requested, f"implementation={implementation!r} asked ({where})"
    shape = tuple(getattr(q, "shape", ()))
    dtype = getattr(q, "dtype", None)
    bias_dtype = getattr(bias, "dtype", None)
    if len(shape) < 4:
        return "xla", f"q of rank {len(shape)}: the kernels take [*batch, S, N, H, d]"
    if dtype is None or jnp.dtype(dtype) not in KERNEL_DTYPES:
        return "xla", f"q dtype {dtype}: the kernels take float16, bfloat16, float32"
    if shape[-1] > MAX_KERNEL_HEAD_DIM:
        return "xla", f"head dim {shape[-1]}: the kernels take d <= {MAX_KERNEL_HEAD_DIM}"
    if not target.gpu:
        return "xla", f"no GPU target ({target}): the plain-jnp path"
    if not target.hopper:
        return "triton", f"{target}: the Mosaic GPU kernels need Hopper (sm90)"
    if bias_dtype is None:
        return "triton", "no bias dtype known: the Triton kernels"
    n_res, dtype = shape[-3], jnp.dtype(dtype)
    if dtype == jnp.float32:
        if jnp.dtype(bias_dtype) != jnp.float32:
            return "triton", (
                f"float32 q with a {jnp.dtype(bias_dtype).name} bias: the Mosaic kernels "
                "were measured with a float32 bias only"
            )
        if n_res < MOSAIC_FLOAT32_MIN_RESIDUES or n_res % MOSAIC_FLOAT32_RESIDUE_MULTIPLE:
            return "triton", (
                f"float32, N = {n_res}: the Mosaic backward was measured faster from "
                f"N = {MOSAIC_FLOAT32_MIN_RESIDUES}, N a multiple of "
                f"{MOSAIC_FLOAT32_RESIDUE_MULTIPLE}"
            )
        measured = (
            f"Hopper, float32, N = {n_res}: the Triton forward and the Mosaic backward "
            "measured faster"
        )
    else:
        if n_res < MOSAIC_MIN_RESIDUES:
            return "triton", (
                f"Hopper, {dtype.name}, N = {n_res} < {MOSAIC_MIN_RESIDUES}: the Triton "
                "kernels measured faster"
            )
        measured = (
            f"Hopper, {dtype.name}, N = {n_res} >= {MOSAIC_MIN_RESIDUES}: the Mosaic "
            "kernels measured faster"
        )
    unsupported = mosaic_supports(shape, dtype, bias_dtype)
    if unsupported is not None:
        return "triton", f"the Mosaic kernels do not take it ({unsupported})"
    return "mosaic", measured


def kernel_bias_dtype(q_dtype, bias_dtype, round_bias: bool) -> str | None:
    """The dtype name the kernels read the bias in, or None for its own:
    q's for `round_bias` with 16-bit q and a wider bias."""
    q_dtype, bias_dtype = jnp.dtype(q_dtype), jnp.dtype(bias_dtype)
    if round_bias and q_dtype.itemsize < 4 and bias_dtype.itemsize > q_dtype.itemsize:
        return q_dtype.name
    return None


def plan_call(
    q, k, v, bias, mask=None, gate=None, *,
    scale: float | None = None,
    implementation: str | None = None,
    block_config: BlockConfig | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    round_bias: bool = False,
    mask_queries: bool = False,
    target: Target | None = None,
) -> CallPlan:
    """The plan of `msa_row_attention(q, k, v, bias, mask, gate, **kwargs)`.

    Arguments as the op's (arrays or `jax.ShapeDtypeStruct`s: only shapes
    and dtypes are read); `target`: the device to plan for (default
    `current_target()`). Validates the arguments as the op does.
    """
    target = current_target() if target is None else target
    # 1. The backend, by the rule (before validation: see choose_implementation).
    implementation, reason = choose_implementation(implementation, q, bias, dropout_rate, target)
    validate_arguments(q, k, v, bias, mask, gate, scale, implementation)
    validate_dropout(dropout_rate, dropout_rng)
    validate_block_config(block_config)
    *batch, rows, n_res, heads, head_dim = q.shape
    interpret = not target.gpu
    masks_queries = mask is not None and bool(mask_queries)
    if implementation == "xla":
        return CallPlan(
            "xla", "xla", "xla", reason, target, head_dim, head_dim, head_dim,
            interpret=interpret, dropout_rate=float(dropout_rate), masks_queries=masks_queries,
        )

    # 2. The bias as the kernels read it, and the Triton tiles (the Triton
    # forward runs for float32 inputs on "mosaic" too).
    bias_dtype = kernel_bias_dtype(q.dtype, bias.dtype, round_bias)
    read_bias_dtype = jnp.dtype(bias.dtype if bias_dtype is None else bias_dtype)
    config = block_config or default_block_config(n_res, head_dim, q.dtype, read_bias_dtype)
    config = config.clipped(n_res)
    kernel_shape = (math.prod(batch), rows, n_res, heads, head_dim)
    padded_head_dim = jax.eval_shape(
        pad_head_dim, jax.ShapeDtypeStruct((head_dim,), q.dtype)
    ).shape[-1]

    # 3. The forward: the Mosaic forward takes 16-bit inputs; d = 8 with an
    # even H as it is (two heads per tile), other d < 16 zero-padded.
    skipping = mask is not None and skips_padding()
    if implementation == "mosaic" and jnp.dtype(q.dtype).itemsize == 2:
        forward = "mosaic"
        forward_head_dim = head_dim if pairs_heads(head_dim, heads) else padded_head_dim
        forward_tiles = config.mosaic_forward or mosaic_forward.default_tiles(
            (*kernel_shape[:-1], forward_head_dim), q.dtype, read_bias_dtype,
            save_stats=True, has_gate=gate is not None,
            # The Mosaic GPU interpreter stalls on the persistent grid.
            persistent=not interpret, dropout=bool(dropout_rate),
            # Its tiles where the kernels skip masked queries (step 4's
            # prologue kernel, without dropout).
            skips_masked_queries=masks_queries and skipping,
        )
    else:
        forward, forward_head_dim, forward_tiles = "triton", head_dim, config.forward

    # 4. The backward: the Mosaic kernels pad d < 16 where they do not read
    # two heads per tile (`tile_heads`; never in float32).
    if implementation == "mosaic":
        backward = "mosaic"
        paired = mosaic_backward.tile_heads(kernel_shape, q.dtype) > 1
        backward_head_dim = head_dim if paired else padded_head_dim
        tiles = config.mosaic_backward or mosaic_backward.default_tiles(
            (*kernel_shape[:-1], backward_head_dim), q.dtype, read_bias_dtype,
            dropout=bool(dropout_rate),
            # Skipping padding, the persistent dq and dk/dv kernels measured
            # faster (16-bit inputs; they take no dropout), and so did the
            # backward's prologue in one kernel (taken below where it applies).
            persistent=skipping and not dropout_rate and jnp.dtype(q.dtype).itemsize == 2,
            prologue_kernel=skipping,
        )
        backward_tiles = (("dkdv", tiles.dkdv), ("dq", tiles.dq), ("dbias", tiles.dbias))
        ping_pong = tiles.ping_pong
        # Skipping, it reads the Mosaic forward's dead-row means (which the
        # forward gives without dropout alone); it scales nothing for dropout.
        prologue_kernel = tiles.prologue_kernel and forward == "mosaic" and not dropout_rate
    else:
        backward, backward_head_dim, ping_pong = "triton", head_dim, False
        prologue_kernel = False
        backward_tiles = (("dkdv", config.backward_dkdv),)
        if config.fuses_dq_dbias(n_res):
            backward_tiles += (("dq_dbias", config.backward_dq_dbias),)
        else:
            backward_tiles += (("dq", config.backward_dq), ("dbias", config.backward_dbias))

    return CallPlan(
        implementation, forward, backward, reason, target, head_dim, forward_head_dim,
        backward_head_dim, forward_tiles, backward_tiles, ping_pong, bias_dtype, interpret,
        skips_padding=skipping,
        dropout_rate=float(dropout_rate),
        prologue_kernel=prologue_kernel,
        masks_queries=masks_queries,
    )
