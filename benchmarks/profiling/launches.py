"""The kernel launches of the op's compiled program at one shape, on a GPU or for one.

    python -m benchmarks profile launches --shape train_padded --skip
    python -m benchmarks profile launches --shape train_padded --skip --forward-only
    bash scripts/compile_for_gpu.sh --shape extra_padded --skip --dropout-rate 0.1

Compiles the op's forward+backward (gradients of q, k, v, the bias and the gate), or with
`--forward-only` its forward, without running it, and lists what the compiled program
launches, in order: XLA's fusions and copies, and the custom calls (the Pallas kernels, by
name). Each launch costs 1-2 us at the training crop on an H200 whatever it does, so the
launches a change adds are part of its cost; their count is exact where a timing needs
the GPU and varies from run to run.

Beside each launch, the megabytes of its operands and of its results, from the
program's types, and for XLA's own launches (fusions, copies) their sum and the time it
takes at the GPU's memory bandwidth: the least those passes can take, where each reads
its operands whole (a fusion that reads a slice of an operand counts the operand whole;
a Pallas kernel's operands are listed whole, though it may read part of them).

`--deviceless h200` (or `a100`) compiles for that GPU on a host without one, through JAX's
CUDA plugin (installed without its CUDA libraries) and a CUDA toolkit's ptxas and
libdevice; `scripts/compile_for_gpu.sh` sets them up. XLA then compiles every kernel for
that GPU, Triton's and Mosaic GPU's, as it would there: a check that they compile
(`profile sass` reads the Mosaic kernels' machine code so compiled).

`--kernel-options staggered_bias=0,mask_without_select=0` sets fields of `MosaicTiles` in
every Mosaic kernel the op's plan runs, its tiles otherwise as planned (and
`prologue_kernel=1`, `MosaicBackwardTiles`', the backward's prologue kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
from pathlib import Path

# What XLA's GPU compiler may leave in an entry computation that runs on the device.
LAUNCHING_OPCODES = (
    "fusion", "custom-call", "copy", "copy-start", "sort", "scatter", "while", "conditional",
    "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# A Pallas kernel's name: the scope its pallas_call (Triton) or mpmd_map (Mosaic GPU) runs in.
_KERNEL = re.compile(r'op_name="[^"]*?/([^/"]+)/(?:pallas_call|mpmd_map)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')


# An instruction's name and what follows " = ": its type, opcode and operands.
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<rest>.*)$")
_ARRAY_TYPE = re.compile(r"\b(?P<dtype>[a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[(?P<dims>[0-9,]*)\]")
_OPERAND = re.compile(r"%(?P<name>[^\s,()]+?)(?:#(?P<element>[0-9]+))?(?=[\s,)]|$)")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
XLA_OPCODES = ("fusion", "copy", "copy-start")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a compiled program: the instruction's name, its opcode, what it
    runs (a Pallas kernel's name, a custom call's target, or the JAX operation XLA
    named the fusion after), and the bytes of its operands (`reads`, each operand once)
    and of its results (`writes`)."""

    name: str
    opcode: str
    runs: str
    reads: int = 0
    writes: int = 0

    @property
    def by_xla(self) -> bool:
        """A pass XLA wrote (a fusion or a copy), not a kernel of a custom call."""
        return self.opcode in XLA_OPCODES


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis that closes the one at `text[start]`."""
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index
    raise ValueError(f"unbalanced parentheses in {text!r}")


def type_bytes(type_text: str) -> list[int]:
    """The bytes of each array of an HLO type (`f32[8,16]{1,0}`, a tuple of them, `s32[]`):
    one number per array, in order; dtypes not in DTYPE_BYTES count 0."""
    return [
        DTYPE_BYTES.get(array["dtype"], 0)
        * math.prod(int(d) for d in array["dims"].split(",") if d)
        for array in _ARRAY_TYPE.finditer(type_text)
    ]


def _split_definition(rest: str) -> tuple[str, str, str]:
    """(type, opcode, operands) of what follows an instruction's " = "."""
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ")
    type_text, after = rest[:end], rest[end:].lstrip()
    opcode_end = after.index("(")
    return type_text, after[:opcode_end], after[opcode_end:_closing(after, opcode_end) + 1]


def entry_launches(hlo_text: str) -> list[Launch]:
    """The launches of a compiled module's entry computation (`Compiled.as_text()`),
    in the order of its schedule."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    launches = []
    arrays: dict[str, list[int]] = {}  # each instruction's result arrays' bytes
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        definition = _DEFINITION.match(line)
        if not definition:
            continue
        try:
            type_text, opcode, operands_text = _split_definition(definition["rest"])
        except ValueError:
            continue
        name = definition["name"]
        arrays[name] = type_bytes(type_text)
        if opcode not in LAUNCHING_OPCODES:
            continue
        read = {}
        for operand in _OPERAND.finditer(operands_text):
            sizes = arrays.get(operand["name"], [])
            element = operand["element"]
            if element is None:
                read[operand["name"]] = sum(sizes)
            elif int(element) < len(sizes):
                read[operand.group(0)] = sizes[int(element)]
        kernel, target, op_name = (p.search(line) for p in (_KERNEL, _TARGET, _OP_NAME))
        if kernel:
            runs = kernel.group(1)
        elif target:
            runs = target.group(1)
        else:
            runs = op_name.group(1).rsplit("/", 2)[-2:] if op_name else ""
            runs = "/".join(runs)
        launches.append(Launch(name, opcode, runs, sum(read.values()), sum(arrays[name])))
    return launches


# Device properties for `--deviceless` (XLA's GpuTargetConfigProto as text): the
# figures NVIDIA publishes for the parts.
DEVICELESS_TARGETS = {
    "h200": dict(name="NVIDIA H200", major=9, cores=132, shared_per_block_optin=232448,
                 shared_per_core=233472, l2=52428800, memory=150_000_000_000,
                 bandwidth=4_800_000_000_000, clock_ghz=1.98),
    "a100": dict(name="NVIDIA A100-SXM4-80GB", major=8, cores=108, shared_per_block_optin=166912,
                 shared_per_core=167936, l2=41943040, memory=85_000_000_000,
                 bandwidth=2_039_000_000_000, clock_ghz=1.41),
}


def target_config(kind: str) -> str:
    """XLA's GPU target config (text proto) for `DEVICELESS_TARGETS[kind]`."""
    t = DEVICELESS_TARGETS[kind]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {t['shared_per_core']}
  threads_per_core_limit: 2048
  core_count: {t['cores']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t['bandwidth']}
  l2_cache_size: {t['l2']}
  clock_rate_ghz: {t['clock_ghz']}
  device_memory_size: {t['memory']}
  shared_memory_per_block_optin: {t['shared_per_block_optin']}
  cuda_compute_capability {{ major: {t['major']} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{t['name']}"
"""


def cuda_directory() -> str | None:
    """A CUDA toolkit's root (libdevice, ptxas): $CUDA_HOME, else where ptxas is."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    ptxas = shutil.which("ptxas")
    return str(Path(ptxas).resolve().parent.parent) if ptxas else None


def prepare_deviceless_environment() -> None:
    """What JAX's CUDA plugin needs to compile without a GPU, set before JAX starts
    its backends: no check of the CUDA libraries it was installed without, and
    XLA told where the CUDA toolkit is."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    flags = os.environ.get("XLA_FLAGS", "")
    directory = cuda_directory()
    if directory and "xla_gpu_cuda_data_dir" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={directory}".strip()


def deviceless_mesh(kind: str):
    """A one-device mesh of the GPU `kind` with no GPU present."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        "cuda", "cuda", topology="1x1x1", target_config=target_config(kind)
    )
    return topologies.make_mesh(topology, (1,), ("devices",))


def compile_op(args, mesh):
    """The op's compiled forward+backward (or forward) for `args`, on `mesh`'s device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import msa_pallas
    from benchmarks.alternatives import asked_block_config
    from benchmarks.profiling.forward import parse_shape
    from benchmarks.shapes import DTYPES

    batch, rows, n_res, heads, head_dim = parse_shape(args.shape)
    dtype = DTYPES[args.dtype]
    bias_dtype = dtype if args.bias_dtype == "input" else DTYPES[args.bias_dtype]
    key_dtype = jax.random.key(0).dtype  # made before the mesh holds the default device
    placed = NamedSharding(mesh, PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    rows_like = spec((batch, rows, n_res, heads, head_dim), dtype)
    bias = spec((batch, heads, n_res, n_res), bias_dtype)
    mask = spec((batch, rows, n_res), jnp.bool_)
    key = spec((), key_dtype)
    implementation = None if args.implementation == "default" else args.implementation
    with jax.sharding.set_mesh(mesh):
        config = asked_block_config(
            rows_like, bias, mask, rows_like, implementation=implementation, skip=args.skip,
            persistent_backward=args.persistent_backward,
            kernel_options=parse_kernel_options(args.kernel_options),
            narrow_key_tiles=split_kernels(args.narrow_keys),
            narrow_query_tiles=split_kernels(args.narrow_queries),
        )

        def op(q, k, v, bias, gate, mask, key):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, None if args.no_gate else gate,
                implementation=implementation, block_config=config,
                dropout_rate=args.dropout_rate, dropout_rng=key if args.dropout_rate else None,
                mask_queries=args.mask_queries,
            )

        def loss(*operands):
            # The cotangent an input, as in the op benchmark (`alternatives.jitted_pair`):
            # no XLA computation of it to fuse into the backward's first pass.
            *operands, cotangent = operands
            out = op(*operands).astype(jnp.float32)
            return jnp.sum(out * cotangent.astype(jnp.float32))

        if args.forward_only:
            program, operands = op, (rows_like, rows_like, rows_like, bias, rows_like, mask, key)
        else:
            # Without a gate its operand is unused: no zero gradient for it.
            program = jax.grad(loss, argnums=(0, 1, 2, 3) if args.no_gate else (0, 1, 2, 3, 4))
            operands = (rows_like, rows_like, rows_like, bias, rows_like, mask, key, rows_like)
        with msa_pallas.skipping_padding(args.skip):
            traced = jax.jit(program).trace(*operands)
            return traced.lower().compile()


def parse_kernel_options(text: str, op_options: bool = True) -> dict[str, bool]:
    """`"staggered_bias=0,mask_without_select=0"` -> {field of `MosaicTiles`, or
    with `op_options` of `alternatives.backward_options` (`prologue_kernel`, which
    acts on the op's backward as a whole): bool}."""
    from benchmarks.alternatives import backward_options
    from msa_pallas.kernels.mosaic.tiles import MosaicTiles

    flags = {field.name for field in dataclasses.fields(MosaicTiles)
             if field.type in ("bool", bool)}
    if op_options:
        flags |= backward_options()
    options = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in flags or value not in ("0", "1"):
            raise SystemExit(f"--kernel-options: {item!r}; expected NAME=0 or NAME=1, NAME "
                             f"one of {sorted(flags)}")
        options[name] = value == "1"
    return options


def split_kernels(text: str) -> tuple[str, ...]:
    """`"forward,dq"` -> ("forward", "dq") (kernels of `--narrow-keys`/`--narrow-queries`)."""
    return tuple(filter(None, text.split(",")))


def add_narrow_arguments(parser) -> None:
    """`--narrow-keys` and `--narrow-queries` (the tiles of the benchmark variants
    `alternatives.narrow_key_tiles_config` and `narrow_query_tiles_config` make)."""
    parser.add_argument("--narrow-keys", default="",
                        help="KERNEL,...: the skipping plan's Mosaic tiles of these kernels "
                             "(forward, dkdv, dbias) cut to 64 keys")
    parser.add_argument("--narrow-queries", default="",
                        help="KERNEL,...: those of these (forward, dq) cut to 64 queries")


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="train", help="a name of shapes.py or BxSxNxHxd")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--bias-dtype", default="f32", help="input (q's dtype) or a dtype name")
    parser.add_argument("--implementation", default="default",
                        help="msa_row_attention's implementation; default: its own choice")
    parser.add_argument("--skip", action="store_true",
                        help="trace inside msa_pallas.skipping_padding()")
    parser.add_argument("--dropout-rate", type=float, default=0.0)
    parser.add_argument("--mask-queries", action="store_true",
                        help="msa_row_attention's mask_queries (the mask masks queries too)")
    add_narrow_arguments(parser)
    parser.add_argument("--persistent-backward", action="store_true",
                        help="the Mosaic dq and dk/dv kernels persistent (one CTA per SM)")
    parser.add_argument("--kernel-options", default="",
                        help="NAME=0|1,...: MosaicTiles flags set in every Mosaic kernel, "
                             "and MosaicBackwardTiles' prologue_kernel")
    parser.add_argument("--no-gate", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--deviceless", choices=sorted(DEVICELESS_TARGETS), default=None,
                        help="compile for this GPU on a host without one")
    return parser


def compile_mesh(args):
    """The one-device mesh `compile_op` compiles for: the `--deviceless` GPU (its
    environment prepared before JAX starts its backends), else this machine's first
    device."""
    if args.deviceless:
        prepare_deviceless_environment()
    import jax
    from jax.sharding import Mesh

    if args.deviceless:
        return deviceless_mesh(args.deviceless)
    return Mesh(jax.devices()[:1], ("devices",))


def compiled_what(args, mesh) -> str:
    """What `compile_op` compiled for `args`, and for which device: a heading's words."""
    what = "forward" if args.forward_only else "forward+backward"
    flags = [f"skip={args.skip}", f"dropout={args.dropout_rate}", f"gate={not args.no_gate}"]
    if args.mask_queries:
        flags.append("mask_queries")
    if args.narrow_keys or args.narrow_queries:
        flags.append(f"64-key tiles of {args.narrow_keys or 'none'}, 64-query tiles of "
                     f"{args.narrow_queries or 'none'}")
    if args.kernel_options:
        flags.append(f"kernel options {args.kernel_options}")
    return (f"{what} at {args.shape} {args.dtype}, bias {args.bias_dtype}, "
            f"{args.implementation}, {', '.join(flags)}, compiled for "
            f"{mesh.devices.flat[0].device_kind}")


def main(argv=None, prog: str | None = None) -> int:
    args = make_parser(prog).parse_args(argv)
    mesh = compile_mesh(args)
    compiled = compile_op(args, mesh)
    launches = entry_launches(compiled.as_text())
    device = mesh.devices.flat[0].device_kind
    print(f"# {compiled_what(args, mesh)}")
    print(f"{len(launches)} launches")
    print(f"{'':3}  {'opcode':<12} {'instruction':<36} {'MB in':>8} {'MB out':>8}  runs")
    for index, launch in enumerate(launches):
        print(f"{index:3d}  {launch.opcode:<12} {launch.name:<36} {launch.reads / 1e6:8.1f} "
              f"{launch.writes / 1e6:8.1f}  {launch.runs}")
    print(xla_traffic_line(launches, bandwidth_of(device, args.deviceless)))
    return 0


def bandwidth_of(device_kind: str, deviceless: str | None) -> float | None:
    """The memory bandwidth (bytes/s) of the `--deviceless` target, or of a device
    whose kind names one of DEVICELESS_TARGETS' GPUs; None otherwise."""
    if deviceless:
        return DEVICELESS_TARGETS[deviceless]["bandwidth"]
    for target in DEVICELESS_TARGETS.values():
        if target["name"].split()[-1] in device_kind:
            return target["bandwidth"]
    return None


def xla_traffic_line(launches: list[Launch], bandwidth: float | None) -> str:
    """The summary of XLA's own passes: their count, bytes, and at `bandwidth` the time
    those bytes take."""
    passes = [launch for launch in launches if launch.by_xla]
    moved = sum(launch.reads + launch.writes for launch in passes)
    line = f"# XLA's passes: {len(passes)}, {moved / 1e6:.1f} MB read and written"
    if bandwidth:
        line += f", {moved / bandwidth * 1e6:.1f} us at {bandwidth / 1e12:.1f} TB/s"
    return line
