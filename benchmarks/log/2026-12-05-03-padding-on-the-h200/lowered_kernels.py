"""The op's forward+backward at the training crop, lowered for an H200 on a host
without a GPU, written out so that two checkouts can be compared: the StableHLO (XLA's
part) and each Mosaic GPU kernel's module printed without source locations.

    PYTHONPATH=.cuda-plugin:CHECKOUT python lowered_kernels.py OUT_PREFIX {f32,input} [skip]

msa_pallas comes from PYTHONPATH (CHECKOUT: the tree to lower); the deviceless helpers
are loaded by path from this repository's benchmarks/profiling/launches.py. Writes
OUT_PREFIX.stablehlo and OUT_PREFIX_kernel_I.mlir, one per Mosaic custom call in
program order. Then e.g. `diff A_kernel_1.mlir B_kernel_1.mlir`.
"""

import importlib.util
import pathlib
import re
import sys

out_prefix, bias_name = sys.argv[1:3]
skip = sys.argv[3:4] == ["skip"]
here = pathlib.Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location(
    "launches_tool", here / "benchmarks" / "profiling" / "launches.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["launches_tool"] = tool
spec.loader.exec_module(tool)
tool.prepare_deviceless_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.interpreters import mlir as jax_mlir  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import msa_pallas  # noqa: E402


def module_bytes(escaped: str) -> bytes:
    """The bytes of a StableHLO string attribute as printed (\\XX escapes)."""
    out, i = bytearray(), 0
    while i < len(escaped):
        if escaped[i] == "\\":
            if escaped[i + 1] in '\\"':
                out.append(ord(escaped[i + 1]))
                i += 2
            else:
                out.append(int(escaped[i + 1:i + 3], 16))
                i += 3
        else:
            out += escaped[i].encode()
            i += 1
    return bytes(out)


mesh = tool.deviceless_mesh("h200")
placed = NamedSharding(mesh, PartitionSpec())
batch, rows, n_res, heads, head_dim = 1, 128, 256, 8, 32
dtype = jnp.bfloat16
bias_dtype = dtype if bias_name == "input" else jnp.float32
rows_like = jax.ShapeDtypeStruct((batch, rows, n_res, heads, head_dim), dtype, sharding=placed)
bias = jax.ShapeDtypeStruct((batch, heads, n_res, n_res), bias_dtype, sharding=placed)
mask = jax.ShapeDtypeStruct((batch, rows, n_res), jnp.bool_, sharding=placed)


def loss(q, k, v, bias, gate, mask):
    out = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate)
    return jnp.sum(out.astype(jnp.float32) ** 2)


with jax.sharding.set_mesh(mesh), msa_pallas.skipping_padding(skip):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
        rows_like, rows_like, rows_like, bias, rows_like, mask).lower()
text = lowered.as_text()
pathlib.Path(out_prefix + ".stablehlo").write_text(text)
for index, escaped in enumerate(re.findall(r'module = "((?:[^"\\]|\\.)*)"', text)):
    context = jax_mlir.make_ir_context()
    context.allow_unregistered_dialects = True
    with context:
        module = ir.Module.parse(module_bytes(escaped))
        printed = module.operation.get_asm(enable_debug_info=False)
    pathlib.Path(f"{out_prefix}_kernel_{index}.mlir").write_text(printed)
    print(f"kernel {index}: {len(printed)} characters")
