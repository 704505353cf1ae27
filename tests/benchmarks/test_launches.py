"""`python -m benchmarks profile launches`: the launches of a compiled program, read
from its text, and the tool run end to end on the CPU (the op's plain-jnp path there)."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp

import msa_pallas
from benchmarks.alternatives import asked_block_config
from benchmarks.profiling import launches

# An entry computation as XLA's GPU compiler prints it (lines shortened): a fusion, a
# Mosaic GPU kernel, a Pallas Triton kernel, a custom call of XLA's own, and
# instructions that launch nothing; a fused computation before it is not the entry's.
MODULE = """HloModule jit_loss, is_scheduled=true

%fused_reduce (param_0: pred[1,8,16]) -> s32[8] {
  %fusion.9 = s32[8]{0} fusion(%param_0), kind=kLoop, calls=%inner
}

ENTRY %main.30 (a_0_.1: bf16[1,8,16,2,8], a_5_.1: pred[1,8,16]) -> (bf16[1,8,16,2,8]) {
  %a_0_.1 = bf16[1,8,16,2,8]{4,3,2,1,0} parameter(0)
  %a_5_.1 = pred[1,8,16]{2,1,0} parameter(1)
  %input_reduce_fusion = (s32[8]{0}, s8[1,8,16]{2,1,0}) fusion(%a_5_.1), kind=kInput, calls=%fused_reduce, metadata={op_name="jit(loss)/jvp()/jit(attention_forward)/reduce_max" scheduling_name="input_reduce_fusion"}
  %get-tuple-element.1 = s32[8]{0} get-tuple-element(%input_reduce_fusion), index=0
  %mpmd_map.0 = (bf16[1,8,16,2,8]{4,3,2,1,0}, f32[1,8,2,16]{3,2,1,0}) custom-call(%a_0_.1, %get-tuple-element.1), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(loss)/jvp()/jit(attention_forward)/msa_mosaic_forward/mpmd_map" scheduling_name="mpmd_map.0"}
  %pallas_call.0 = bf16[1,8,16,16]{3,2,1,0} custom-call(%a_5_.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(loss)/jvp()/jit(attention_forward)/msa_fill_dead_rows/pallas_call" scheduling_name="pallas_call.0"}, backend_config={debug = false, grid_x = 8}
  %cublas-gemm.1 = f32[16,16]{1,0} custom-call(%a_0_.1), custom_call_target="__cublas$gemm"
  %copy.3 = bf16[1,8,16,2,8]{4,3,2,1,0} copy(%mpmd_map.0#0)
  ROOT %tuple.2 = (bf16[1,8,16,2,8]{4,3,2,1,0}) tuple(%copy.3)
}
"""


def test_entry_launches_name_each_kernel():
    got = launches.entry_launches(MODULE)
    assert [(x.name, x.opcode, x.runs) for x in got] == [
        ("input_reduce_fusion", "fusion", "jit(attention_forward)/reduce_max"),
        ("mpmd_map.0", "custom-call", "msa_mosaic_forward"),
        ("pallas_call.0", "custom-call", "msa_fill_dead_rows"),
        ("cublas-gemm.1", "custom-call", "__cublas$gemm"),
        ("copy.3", "copy", ""),
    ]


def test_entry_launches_count_the_bytes_of_operands_and_results():
    got = {x.name: (x.reads, x.writes, x.by_xla) for x in launches.entry_launches(MODULE)}
    bf16_rows, mask = 1 * 8 * 16 * 2 * 8 * 2, 1 * 8 * 16
    assert got == {
        # the mask in; an int32 [8] and an int8 mask out
        "input_reduce_fusion": (mask, 8 * 4 + mask, True),
        # q and the reduction's first result (a get-tuple-element) in; a tuple out
        "mpmd_map.0": (bf16_rows + 8 * 4, bf16_rows + 1 * 8 * 2 * 16 * 4, False),
        "pallas_call.0": (mask, 1 * 8 * 16 * 16 * 2, False),
        "cublas-gemm.1": (bf16_rows, 16 * 16 * 4, False),
        # one element of the kernel's tuple (`%mpmd_map.0#0`), not the whole tuple
        "copy.3": (bf16_rows, bf16_rows, True),
    }
    moved = mask + 8 * 4 + mask + 2 * bf16_rows
    line = launches.xla_traffic_line(launches.entry_launches(MODULE), 4.8e12)
    assert line == (f"# XLA's passes: 2, {moved / 1e6:.1f} MB read and written, "
                    f"{moved / 4.8e12 * 1e6:.1f} us at 4.8 TB/s")


def test_type_bytes_of_arrays_tuples_and_scalars():
    assert launches.type_bytes("f32[8,16]{1,0}") == [512]
    assert launches.type_bytes("(bf16[2,3]{1,0}, s32[], pred[4]{0})") == [12, 4, 4]
    assert launches.type_bytes("token[]") == [0]
    assert launches.bandwidth_of("NVIDIA H200", None) == 4_800_000_000_000
    assert launches.bandwidth_of("cpu", "a100") == 2_039_000_000_000
    assert launches.bandwidth_of("cpu", None) is None


def test_target_configs_name_their_gpu():
    for kind, target in launches.DEVICELESS_TARGETS.items():
        text = launches.target_config(kind)
        assert f'device_description_str: "{target["name"]}"' in text
        assert f"major: {target['major']}" in text and f"core_count: {target['cores']}" in text
        assert text.count("{") == text.count("}")


def test_the_tool_lists_a_compiled_program(capsys):
    """On the CPU the op runs its plain-jnp path: XLA's fusions, and no Pallas kernel."""
    assert launches.main(["--shape", "1x2x16x2x8", "--dtype", "f32", "--skip"]) == 0
    out = capsys.readouterr().out.splitlines()
    count = int(out[1].split()[0])
    assert count >= 1 and len(out) == 4 + count  # the heading, the columns, the XLA line
    assert out[2].split()[:3] == ["opcode", "instruction", "MB"]
    assert out[-1].startswith("# XLA's passes: ") and " us at " not in out[-1]  # a CPU
    assert "forward+backward at 1x2x16x2x8 f32" in out[0] and "skip=True" in out[0]
    assert not any("msa_mosaic" in line or "msa_fill" in line for line in out[2:])


def test_kernel_options_name_flags_of_mosaic_tiles():
    """`--kernel-options`: boolean fields of `MosaicTiles` set to 0 or 1; another
    name, a value other than 0 or 1, or a tile size, is refused."""
    assert launches.parse_kernel_options("staggered_bias=0,mask_without_select=1") == {
        "staggered_bias": False, "mask_without_select": True}
    assert launches.parse_kernel_options("") == {}
    # ... and `MosaicBackwardTiles.prologue_kernel`, the three backward kernels' together.
    assert launches.parse_kernel_options("prologue_kernel=1") == {"prologue_kernel": True}
    for wrong in ("staggered=0", "mask_without_select=2", "block_k=64", "persistent"):
        try:
            launches.parse_kernel_options(wrong)
        except SystemExit as refusal:
            assert wrong in str(refusal)
        else:
            raise AssertionError(f"{wrong!r} was taken")


def test_asked_block_config_of_the_profiling_commands():
    """What `profile launch` (and timeline, durations) and `profile launches` ask
    for: None without options; `--persistent-backward` makes the plan's dq and
    dk/dv persistent; `--kernel-options` sets flags on the plan's tiles, the plan
    that skipping makes with `--skip` (persistent dq and dk/dv there)."""
    q = jax.ShapeDtypeStruct((1, 8, 256, 8, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 256, 256), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 8, 256), jnp.bool_)
    target = msa_pallas.dispatch.Target("gpu", 90)
    with mock.patch.object(msa_pallas.dispatch, "current_target", return_value=target):
        assert asked_block_config(q, bias, mask, implementation="mosaic") is None
        persistent = asked_block_config(q, bias, mask, implementation="mosaic",
                                        persistent_backward=True).mosaic_backward
        assert persistent.dq.persistent and persistent.dkdv.persistent
        assert not persistent.dbias.persistent
        options = launches.parse_kernel_options("mask_without_select=0,prologue_kernel=1")
        for skip in (True, False):
            config = asked_block_config(q, bias, mask, implementation="mosaic", skip=skip,
                                        kernel_options=options)
            tiles = config.mosaic_backward
            assert tiles.prologue_kernel and not tiles.dq.mask_without_select
            assert tiles.dq.persistent == tiles.dkdv.persistent == skip, skip
