"""The support matrix of README.md, made from the dispatch rule.

Each row names a set of calls (GPU generation, dtypes, head dim d, N) and
lists sample calls from the edges of that set. `plan_call` plans every
sample for the row's target; the row's kernels are what the samples' plans
say, and every sample of a row must plan alike (tests/test_support_matrix.py
checks that, and that README.md holds `render()` as it is).

    python tests/support_matrix.py      # prints the table for README.md
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from msa_pallas.dispatch import Target, plan_call

BEGIN = "<!-- support matrix: made by tests/support_matrix.py -->"
END = "<!-- end of support matrix -->"

bf16, f16, f32, f64 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64
CPU, TPU = Target("cpu"), Target("tpu")
HOPPER = Target("gpu", 90)
OTHER_GPUS = (Target("gpu", 80), Target("gpu", 86), Target("gpu", 89), Target("gpu", 100))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call: q `[1, 2, n_res, heads, head_dim]` of `dtype`, a bias of `bias_dtype`."""

    target: Target
    dtype: object
    bias_dtype: object
    n_res: int
    head_dim: int
    heads: int = 4


@dataclasses.dataclass(frozen=True)
class Row:
    gpu: str
    dtype: str
    bias: str
    head_dim: str
    n_res: str
    why: str
    samples: tuple


def samples(targets, dtypes, n_res, head_dims, heads=(4,)):
    """Every combination of the arguments, each a tuple (dtype: (q, bias) pairs)."""
    return tuple(
        Sample(t, q, b, n, d, h)
        for t in targets for q, b in dtypes for n in n_res for d in head_dims for h in heads
    )


SIXTEEN_BIT = ((bf16, f32), (bf16, bf16), (f16, f32), (f16, f16))
KERNEL_DTYPES = SIXTEEN_BIT + ((f32, f32), (f32, bf16))

ROWS = (
    Row("none (CPU, TPU)", "any", "any", "any", "any",
        "the plain-`jnp` path (the kernels run interpreted only when asked)",
        samples((CPU, TPU), KERNEL_DTYPES, (37, 256), (8, 32, 128))),
    Row("any", "float64", "any", "any", "any", "the kernels take 16- and 32-bit inputs",
        samples((HOPPER,) + OTHER_GPUS, ((f64, f64), (f64, f32)), (37, 256), (8, 32))),
    Row("any", "any", "any", "> 128", "any", "the kernels take d <= 128",
        samples((HOPPER, OTHER_GPUS[0]), KERNEL_DTYPES, (37, 256), (160, 256))),
    Row("sm80, sm86, sm89, sm100 (A100, A10, L40, B200, ...)", "bf16, fp16, f32", "any",
        "<= 128", "any", "the Mosaic kernels need Hopper",
        samples(OTHER_GPUS, KERNEL_DTYPES, (37, 256, 1024), (8, 32, 48, 128))),
    Row("sm90 (H100, H200)", "bf16, fp16", "any", "<= 128", "< 192",
        "Triton measured faster at small N",
        samples((HOPPER,), SIXTEEN_BIT, (16, 37, 128, 191), (8, 16, 32, 64, 128))),
    Row("sm90", "bf16, fp16", "any", "16, 32, 64, 128", ">= 192, a multiple of 8",
        "Mosaic measured faster",
        samples((HOPPER,), SIXTEEN_BIT, (192, 256, 384, 2048), (16, 32, 64, 128))),
    Row("sm90", "bf16, fp16", "any", "16, 32, 64", ">= 192, not a multiple of 8",
        "Mosaic measured faster (N = 333, 381, 1001)",
        samples((HOPPER,), SIXTEEN_BIT, (193, 333, 1001), (16, 32, 64))),
    Row("sm90", "bf16, fp16", "any", "128", ">= 192, not a multiple of 8",
        "the Mosaic kernels need N % 8 == 0 at d = 128",
        samples((HOPPER,), SIXTEEN_BIT, (193, 333), (128,))),
    Row("sm90", "bf16, fp16", "any", "8 with H even", ">= 192",
        "Mosaic; heads 2h, 2h + 1 share a 16-wide tile",
        samples((HOPPER,), SIXTEEN_BIT, (192, 333, 384), (8,), heads=(2, 8))),
    Row("sm90", "bf16, fp16", "any", "1 to 15 (not 8 with H even)", ">= 192",
        "Mosaic on q, k, v zero-padded to d = 16",
        samples((HOPPER,), SIXTEEN_BIT, (192, 384), (4, 12), heads=(3, 4))
        + samples((HOPPER,), SIXTEEN_BIT, (256,), (8,), heads=(3,))),
    Row("sm90", "bf16, fp16, f32", "any", "17 to 127, not 32 or 64", "any",
        "the Mosaic kernels take d in 16, 32, 64, 128",
        samples((HOPPER,), KERNEL_DTYPES, (37, 256, 384), (24, 48, 96))),
    Row("sm90", "f32", "f32", "16, 32, 64", ">= 256, a multiple of 128",
        "the Mosaic backward on bf16 pieces measured faster",
        samples((HOPPER,), ((f32, f32),), (256, 384, 1024), (16, 32, 64))),
    Row("sm90", "f32", "f32", "1 to 15", ">= 256, a multiple of 128",
        "as above; the backward's operands zero-padded to d = 16",
        samples((HOPPER,), ((f32, f32),), (256, 384), (4, 8, 12), heads=(3, 4))),
    Row("sm90", "f32", "f32", "<= 128", "other N",
        "the float32 Mosaic backward was measured at N % 128 == 0 only",
        samples((HOPPER,), ((f32, f32),), (37, 128, 200, 320, 333), (8, 32, 64))),
    Row("sm90", "f32", "bf16, fp16", "<= 128", "any",
        "the float32 Mosaic backward was measured with a float32 bias only",
        samples((HOPPER,), ((f32, bf16), (f32, f16)), (37, 256, 384), (8, 32, 64))),
    Row("sm90", "f32", "f32", "128", "any", "three bf16 pieces of d = 128 overflow shared memory",
        samples((HOPPER,), ((f32, f32),), (37, 256, 384), (128,))),
)

_NAMES = {"xla": "XLA", "triton": "Triton", "mosaic": "Mosaic"}


def plan_of(sample: Sample):
    shape = (1, 2, sample.n_res, sample.heads, sample.head_dim)
    q = jax.ShapeDtypeStruct(shape, sample.dtype)
    bias = jax.ShapeDtypeStruct((1, sample.heads, sample.n_res, sample.n_res), sample.bias_dtype)
    return plan_call(q, q, q, bias, target=sample.target)


def outcome(sample: Sample) -> tuple[str, str]:
    """`(forward, backward)` as the table writes them, from the sample's plan."""
    plan = plan_of(sample)

    def cell(backend, width):
        if backend == "mosaic" and sample.head_dim < 16:
            return "Mosaic, d padded" if width > sample.head_dim else "Mosaic, 2 heads/tile"
        return _NAMES[backend]

    return cell(plan.forward, plan.forward_head_dim), cell(plan.backward, plan.backward_head_dim)


def render() -> str:
    """The Markdown table, rows in `ROWS` order, kernels from each row's first sample."""
    lines = [
        "| GPU | q dtype | bias | d | N | forward | backward | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        forward, backward = outcome(row.samples[0])
        lines.append(
            f"| {row.gpu} | {row.dtype} | {row.bias} | {row.head_dim} | {row.n_res} "
            f"| {forward} | {backward} | {row.why} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(BEGIN)
    print(render())
    print(END)
