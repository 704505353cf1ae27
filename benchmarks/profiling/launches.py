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

`--deviceless h200` (or `a100`) compiles for that GPU on a host without one, through JAX's
CUDA plugin (installed without its CUDA libraries) and a CUDA toolkit's ptxas and
libdevice; `scripts/compile_for_gpu.sh` sets them up. XLA then compiles every Triton kernel
for that GPU, as it would there: a check that they compile. The Mosaic GPU kernels are
compiled when they first run, so only their lowering is checked (as the CPU tests do).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
from pathlib import Path

# What XLA's GPU compiler may leave in an entry computation that runs on the device.
LAUNCHING_OPCODES = (
    "fusion", "custom-call", "copy", "copy-start", "sort", "scatter", "while", "conditional",
    "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = .*? (?P<opcode>" + "|".join(LAUNCHING_OPCODES) + r")\("
)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# A Pallas kernel's name: the scope its pallas_call (Triton) or mpmd_map (Mosaic GPU) runs in.
_KERNEL = re.compile(r'op_name="[^"]*?/([^/"]+)/(?:pallas_call|mpmd_map)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a compiled program: the instruction's name, its opcode, and what
    it runs (a Pallas kernel's name, a custom call's target, or the JAX operation XLA
    named the fusion after)."""

    name: str
    opcode: str
    runs: str


def entry_launches(hlo_text: str) -> list[Launch]:
    """The launches of a compiled module's entry computation (`Compiled.as_text()`),
    in the order of its schedule."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    launches = []
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        kernel, target, op_name = (p.search(line) for p in (_KERNEL, _TARGET, _OP_NAME))
        if kernel:
            runs = kernel.group(1)
        elif target:
            runs = target.group(1)
        else:
            runs = op_name.group(1).rsplit("/", 2)[-2:] if op_name else ""
            runs = "/".join(runs)
        launches.append(Launch(match["name"], match["opcode"], runs))
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
    from benchmarks.alternatives import persistent_backward_block_config
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
        config = None
        if args.persistent_backward:
            config = persistent_backward_block_config(
                rows_like, bias, mask, rows_like, implementation=implementation)

        def op(q, k, v, bias, gate, mask, key):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, None if args.no_gate else gate,
                implementation=implementation, block_config=config,
                dropout_rate=args.dropout_rate, dropout_rng=key if args.dropout_rate else None,
            )

        def loss(*operands):
            return jnp.sum(op(*operands).astype(jnp.float32) ** 2)

        program = op if args.forward_only else jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        with msa_pallas.skipping_padding(args.skip):
            traced = jax.jit(program).trace(rows_like, rows_like, rows_like, bias, rows_like,
                                            mask, key)
            return traced.lower().compile()


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
    parser.add_argument("--persistent-backward", action="store_true",
                        help="the Mosaic dq and dk/dv kernels persistent (one CTA per SM)")
    parser.add_argument("--no-gate", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--deviceless", choices=sorted(DEVICELESS_TARGETS), default=None,
                        help="compile for this GPU on a host without one")
    return parser


def main(argv=None, prog: str | None = None) -> int:
    args = make_parser(prog).parse_args(argv)
    if args.deviceless:
        prepare_deviceless_environment()
    import jax
    from jax.sharding import Mesh

    if args.deviceless:
        mesh = deviceless_mesh(args.deviceless)
    else:
        mesh = Mesh(jax.devices()[:1], ("devices",))
    compiled = compile_op(args, mesh)
    launches = entry_launches(compiled.as_text())
    device = mesh.devices.flat[0].device_kind
    what = "forward" if args.forward_only else "forward+backward"
    flags = [f"skip={args.skip}", f"dropout={args.dropout_rate}", f"gate={not args.no_gate}"]
    print(f"# {what} at {args.shape} {args.dtype}, bias {args.bias_dtype}, "
          f"{args.implementation}, {', '.join(flags)}, compiled for {device}")
    print(f"{len(launches)} launches")
    for index, launch in enumerate(launches):
        print(f"{index:3d}  {launch.opcode:<12} {launch.name:<36} {launch.runs}")
    return 0
