"""The shapes of MSA row attention that matter, their dtypes and their key masks, once.

The benchmarks, the tests and the demo import them from here (only jax is needed), from
the repository root:

    from benchmarks import shapes
    shape = shapes.SHAPES["train"]               # Shape(name="train", dims=(1, 128, 256, 8, 32), ...)
    mask = shapes.make_mask(shape, jax.random.key(0))   # [B, S, N] bool, True keeps a key

A `Shape` is the attention's `(B, S, N, H, d)`: batch, MSA rows, residues, heads and head
width, so q/k/v are `[B, S, N, H, d]`, the pair bias `[B, H, N, N]` and the key mask
`[B, S, N]`. Its `mask` kind says how the benchmark masks keys:

- `"random"`: each key is kept with probability 0.9, independently in every row.
- `"padded"`: a padded batch as a data loader makes it. The shape's `padding` gives the
  fractions (MSA rows, residues) that are padding, at the end: padding residues are
  masked in every row, padding rows have every key masked. Every other key is kept, as
  in a real alignment.

A `Case` adds the dtype of q/k/v and the dtype of the bias.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

MASK_KINDS = ("random", "padded")
RANDOM_MASKED_FRACTION = 0.1  # "random": the fraction of keys masked
# "padded": the fractions of MSA rows and of residues that are padding, unless a shape says.
DEFAULT_PADDING = (0.25, 0.25)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention shape: `dims` = (B, S, N, H, d), and how its keys are masked
    (`padding`: with `mask="padded"`, the fractions of MSA rows and of residues that
    are padding)."""

    name: str
    dims: tuple[int, int, int, int, int]
    mask: str = "random"
    about: str = ""
    padding: tuple[float, float] = DEFAULT_PADDING

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask={self.mask!r}; expected one of {MASK_KINDS}")
        if len(self.dims) != 5 or min(self.dims) < 1:
            raise ValueError(f"dims={self.dims}; expected five positive (B, S, N, H, d)")
        if len(self.padding) != 2 or not all(0.0 <= f < 1.0 for f in self.padding):
            raise ValueError(f"padding={self.padding}; expected (rows, residues) in [0, 1)")


SHAPES: dict[str, Shape] = {shape.name: shape for shape in (
    Shape("tiny", (1, 4, 64, 2, 16), about="a smoke test on CPU (Pallas interpret mode)"),
    Shape("seed", (2, 8, 32, 4, 16), about="the project's first test case"),
    Shape("train", (1, 128, 256, 8, 32), about="AlphaFold2 initial training crop"),
    Shape("finetune", (1, 512, 384, 8, 32), about="AlphaFold2 fine-tuning crop"),
    Shape("extra", (1, 1024, 384, 8, 8), about="extra-MSA stack (small head width)"),
    Shape("long", (1, 512, 1024, 8, 32), about="inference on a long chain"),
    Shape("longer", (1, 128, 2048, 8, 32), about="inference on a longer chain"),
    Shape("train_padded", (1, 128, 256, 8, 32), mask="padded", padding=(0.25, 0.25),
          about="the training crop of a short chain: a quarter of residues and rows padding"),
    Shape("extra_padded", (1, 1024, 384, 8, 8), mask="padded", padding=(0.75, 0.0),
          about="the extra MSA of a protein with few homologues: three quarters of rows padding"),
    Shape("long_padded", (1, 512, 1024, 8, 32), mask="padded", padding=(0.0, 0.10),
          about="a long chain padded to N = 1024: a tenth of residues padding"),
    # Triangle attention (AlphaFold2's around a node, AlphaFold3's call through
    # `dot_product_attention`): the pair's N rows as the MSA rows, H = 4, d = 32.
    Shape("triangle", (1, 384, 384, 4, 32), about="triangle attention at N = 384"),
    Shape("triangle_long", (1, 768, 768, 4, 32), about="triangle attention at N = 768"),
    # A 288-residue chain in a 384 crop: its padding residues are dead rows and masked keys.
    Shape("triangle_padded", (1, 384, 384, 4, 32), mask="padded", padding=(0.25, 0.25),
          about="triangle attention on a chain padded to N = 384: a quarter of residues padding"),
)}
# (B, S, N, H, d) by name, for scripts that need only the numbers.
DIMS: dict[str, tuple[int, int, int, int, int]] = {name: s.dims for name, s in SHAPES.items()}
GPU_DEFAULT_SHAPES = ("train", "finetune", "extra", "long", "longer", "train_padded",
                      "extra_padded", "long_padded")
CPU_DEFAULT_SHAPES = ("tiny",)
# Not MSA row attention: a results file of these alone is not the op's table.
TRIANGLE_SHAPES = ("triangle", "triangle_long", "triangle_padded")


def first_rows(dims: tuple[int, int, int, int, int], rows: int) -> tuple[int, int, int, int, int]:
    """`dims` with S cut to `rows` MSA rows."""
    b, _, n, h, d = dims
    return (b, rows, n, h, d)


# The GPU tests' shapes (tests/gpu_inputs.py): the table's, long and longer cut to their
# first 16 MSA rows, where a float64 reference of every row would take minutes.
GPU_TEST_DIMS: dict[str, tuple[int, int, int, int, int]] = {
    "seed": DIMS["seed"],
    "train": DIMS["train"],
    "finetune": DIMS["finetune"],
    "extra": DIMS["extra"],
    "long-S16": first_rows(DIMS["long"], 16),
    "longer-S16": first_rows(DIMS["longer"], 16),
}

# The channels (c_m, c_z) of the AlphaFold2 layer whose attention has this shape
# (c_m = H * d); the layer benchmark builds its layers from these.
LAYER_CHANNELS: dict[str, tuple[int, int]] = {
    "tiny": (32, 16),
    "train": (256, 128),
    "finetune": (256, 128),
    "extra": (64, 128),
    "train_padded": (256, 128),
    "extra_padded": (64, 128),
}

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
HALF_DTYPES = ("bf16", "f16")
DEFAULT_DTYPES = ("bf16", "f32")
# The bias dtype: float32 (what the Haiku drop-in and the README example hand the op) or
# the dtype of q/k/v ("input"). For float32 inputs both are float32: one case.
BIAS_DTYPES = ("f32", "input")


def parse_shape(text: str) -> Shape:
    """A name of SHAPES, or `BxSxNxHxd` with an optional `:padded` (default `:random`)."""
    if text in SHAPES:
        return SHAPES[text]
    dims_text, _, mask = text.partition(":")
    parts = dims_text.lower().split("x")
    if len(parts) == 5 and all(p.isdigit() and int(p) > 0 for p in parts) and (
            mask in ("",) + MASK_KINDS):
        return Shape(text, tuple(int(p) for p in parts), mask or "random")
    raise ValueError(f"unknown shape {text!r}; expected one of {', '.join(SHAPES)} "
                     f"or BxSxNxHxd[:{'|'.join(MASK_KINDS)}]")


def bias_dtype_names(dtype_name: str, requested) -> list[str]:
    """The bias dtypes (names of DTYPES) to measure with `dtype_name` inputs.

    `requested` holds `"f32"`, `"input"` (the input dtype) or names of DTYPES; repeats
    are dropped, so float32 inputs get one case for `("f32", "input")`.
    """
    names = []
    for name in requested:
        resolved = dtype_name if name == "input" else name
        if resolved not in DTYPES:
            raise ValueError(f"unknown bias dtype {name!r}; expected input or one of "
                             f"{', '.join(DTYPES)}")
        if resolved not in names:
            names.append(resolved)
    return names


def padding_sizes(shape: Shape) -> tuple[int, int]:
    """(real MSA rows, real residues) of a `"padded"` shape: the rest is padding."""
    _, s, n, _, _ = shape.dims
    rows, residues = shape.padding
    return s - math.floor(rows * s), n - math.floor(residues * n)


def make_mask(shape: Shape, key: jax.Array) -> jax.Array:
    """The `[B, S, N]` bool key mask of `shape` (True keeps a key); `key` seeds `"random"`."""
    b, s, n, _, _ = shape.dims
    if shape.mask == "random":
        return jax.random.bernoulli(key, 1.0 - RANDOM_MASKED_FRACTION, (b, s, n))
    rows, residues = padding_sizes(shape)
    keep = (jnp.arange(s)[:, None] < rows) & (jnp.arange(n)[None, :] < residues)
    return jnp.broadcast_to(keep, (b, s, n))


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape with the dtype of q/k/v and the dtype of the bias (names of DTYPES)."""

    shape: Shape
    dtype_name: str
    bias_dtype_name: str

    @property
    def shape_name(self) -> str:
        return self.shape.name

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return self.shape.dims

    @property
    def key(self) -> str:
        return f"{self.shape.name}/{self.dtype_name}/bias {self.bias_dtype_name}"

    @property
    def dtype(self):
        return DTYPES[self.dtype_name]

    @property
    def bias_dtype(self):
        return DTYPES[self.bias_dtype_name]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.dims[4])

    @property
    def logits(self) -> int:
        """B*S*H*N*N: the number of attention logits."""
        b, s, n, h, _ = self.dims
        return b * s * h * n * n
