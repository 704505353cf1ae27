"""What fills the compiled forward+backward's temporary memory: the largest buffers.

    python -m benchmarks profile memory --shape long --dtype bf16
    python -m benchmarks profile memory --shape 1x128x4096x8x32 --impl xla --top 5

Compiles the benchmark's forward+backward (`alternatives.jitted_pair`:
gradients of q, k, v and bias) without running it, prints XLA's memory
analysis, and lists the largest allocations of XLA's buffer assignment with
the values that live in them, largest first (size, offset in the allocation,
shape and the instruction that makes them; values whose offsets overlap
share memory at different times).
The buffer assignment is read from an XLA dump in a temporary folder, so the
script sets `XLA_FLAGS` itself and must start before anything imports jax.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

DUMP_DIR = tempfile.mkdtemp(prefix="msa_pallas_xla_dump_")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_module_re=.*loss.*"
).strip()

import jax  # noqa: E402

from benchmarks import measure
from benchmarks import shapes
from benchmarks.alternatives import IMPLEMENTATIONS

ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
VALUE = re.compile(r"^\s*value: <\d+ ([^ ]+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def largest_allocations(text: str, top: int) -> list[tuple[int, str, list[str]]]:
    """(bytes, attributes, values) of the `top` largest allocations in a buffer-assignment dump."""
    allocations, current = [], None
    for line in text.splitlines():
        if match := ALLOCATION.match(line):
            current = (int(match.group(2)), match.group(3).strip(" ,:"), [])
            allocations.append(current)
        elif current is not None and (match := VALUE.match(line)):
            name, size, offset, shape = match.groups()
            current[2].append((int(size), f"{int(size) / 1e6:9.1f} MB at {int(offset) / 1e6:9.1f}  "
                                          f"{shape:<40} {name}"))
    return [
        (size, attributes, [text for _, text in sorted(values, key=lambda v: -v[0])])
        for size, attributes, values in sorted(allocations, key=lambda a: -a[0])[:top]
    ]


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="long",
                        help="a name of benchmarks/shapes.py or BxSxNxHxd[:padded]")
    parser.add_argument("--dtype", default="bf16", choices=list(shapes.DTYPES))
    parser.add_argument("--bias-dtype", default="f32", choices=list(shapes.BIAS_DTYPES),
                        help="f32 or input (the q/k/v dtype) (default %(default)s)")
    parser.add_argument("--impl", default="msa_pallas", choices=list(IMPLEMENTATIONS))
    parser.add_argument("--top", type=int, default=8, help="allocations to list")
    args = parser.parse_args(argv)
    try:
        shape = shapes.parse_shape(args.shape)
    except ValueError as exc:
        parser.error(str(exc))
    bias = shapes.bias_dtype_names(args.dtype, [args.bias_dtype])[0]
    case = shapes.Case(shape, args.dtype, bias)
    inputs = measure.make_input_set(case, measure.input_key(0))
    compiled = IMPLEMENTATIONS[args.impl](case).fwd_bwd.lower(*inputs).compile()
    stats = measure.memory_stats(compiled)
    print(f"# {args.impl} f+b, {case.key} {shape.dims}, {jax.devices()[0].device_kind}")
    for key, value in stats.items():
        print(f"{key:>24}: {'?' if value is None else f'{value / 1e6:,.1f} MB'}")
    dumps = sorted(Path(DUMP_DIR).glob("*buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not dumps:
        print(f"no buffer assignment was dumped to {DUMP_DIR}")
        return 1
    for size, attributes, values in largest_allocations(dumps[-1].read_text(), args.top):
        print(f"\n{size / 1e6:,.1f} MB  {attributes[:100]}")
        for value in values[:12]:
            print("    " + value)
        if len(values) > 12:
            print(f"    ... {len(values) - 12} more values")
    return 0
