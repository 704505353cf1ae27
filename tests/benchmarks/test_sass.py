"""`python -m benchmarks profile sass`: the innermost wgmma loops of a kernel's SASS and
their opcode counts, read from nvdisasm's text (the tool itself needs a CUDA toolkit and
a GPU's compiler: scripts/compile_for_gpu.sh sass)."""

from __future__ import annotations

from benchmarks.profiling import sass

# nvdisasm -c text, shortened: a set-up block, an outer loop (.L_x_1) around an inner
# one (.L_x_2) that runs wgmma, a loop without wgmma (.L_x_3), and a forward branch.
SASS = """        .text.kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   S2R R2, SR_TID.X ;
.L_x_2:
        /*0020*/                   LDS.64 R4, [R2] ;
        /*0030*/                   FSEL R6, R4, R5, !P1 ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0050*/                   MUFU.EX2 R7, R6 ;
        /*0060*/                   MUFU.EX2 R8, R6 ;
        /*0070*/              @!P2 FSEL R9, R7, RZ, P3 ;
        /*0080*/               @P0 BRA `(.L_x_2) ;
        /*0090*/                   FADD R10, R7, R8 ;
        /*00a0*/               @P1 BRA `(.L_x_1) ;
.L_x_3:
        /*00b0*/                   IADD3 R1, R1, 0x1, RZ ;
        /*00c0*/               @P4 BRA `(.L_x_3) ;
        /*00d0*/                   BRA `(.L_x_4) ;
.L_x_4:
        /*00e0*/                   EXIT ;
"""


def test_wgmma_loops_are_the_innermost_loops_that_run_wgmma():
    (loop,) = sass.wgmma_loops(SASS)
    assert (loop.first, loop.last) == (4, 11)  # .L_x_2 to its back branch
    assert loop.opcodes == {"LDS": 1, "FSEL": 2, "HGMMA": 1, "MUFU": 2, "BRA": 1}
    assert loop.instructions == 7
    line = sass.loop_line("forward", loop)
    assert line.split()[:3] == ["forward", "5-12", "7"]
    assert "FSEL 2" in line and "MUFU 2" in line and "HGMMA 1" in line


def test_a_loop_around_a_wgmma_loop_counts_alone_where_it_is_the_only_one():
    """Without the inner back branch the outer loop is the innermost one that runs
    wgmma; a kernel with no wgmma loop has none."""
    outer_only = SASS.replace("@P0 BRA `(.L_x_2)", "@P0 BRA `(.L_x_4)")
    (loop,) = sass.wgmma_loops(outer_only)
    assert (loop.first, loop.last) == (2, 13) and loop.opcodes["FADD"] == 1
    assert sass.wgmma_loops(SASS.replace("HGMMA", "IMAD")) == []


def test_resources_line_reads_registers_and_spills_from_ptxas():
    report = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    48 bytes stack frame, 52 bytes spill stores, 160 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 48 bytes cumulative stack size"""
    assert sass.resources_line(report) == "168 registers, spills 52 B stored / 160 B loaded"
    assert sass.resources_line("") == "? registers, spills ? B stored / ? B loaded"


def test_embedded_cubin_is_the_last_binary_of_the_pass_dump():
    """The cubin Mosaic GPU prints in its pass dump: printable bytes as they are,
    the others as \\XX escapes; the last `gpu.binary` is the compiled one."""
    raw = bytes([0x7F]) + b"ELF" + bytes([0, 2, 0x22, 0x5C, 0xBE]) + b"ab"
    escaped = "".join(chr(b) if 32 <= b < 127 and b not in (0x22, 0x5C) else f"\\{b:02X}"
                      for b in raw)
    dump = (
        '// -----// IR Dump Before GpuAssemblyToBinaryPass //----- //\n'
        '  gpu.binary @k_kernel  [#gpu.object<#nvvm.target<O = 3, chip = "sm_90a">, '
        'properties = {O = 3 : i32}, bin = "\\7Fold">]\n'
        '// -----// IR Dump Before GpuLaunchLoweringPass //----- //\n'
        '  gpu.binary @k_kernel  [#gpu.object<#nvvm.target<O = 3, chip = "sm_90a">, '
        f'properties = {{O = 3 : i32}}, bin = "{escaped}">]\n'
    )
    assert sass.embedded_cubin(dump) == raw
    assert sass.embedded_cubin("no binary here") is None
