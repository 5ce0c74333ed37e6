"""``sm90_compile.loop_mix``: the instruction mix of a kernel's longest loop, read off a SASS
listing (the ``--loops`` view of the sm_90 builds). A canned listing: two loops (the longer one
wins), predicated instructions counted by their opcode, a forward branch not taken for a loop."""

from __future__ import annotations

from sm90_compile import loop_mix, sass_loops

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.U16 R2, [R3] ;
        /*0020*/              @P0 BRA 0x0060 ;
        /*0030*/                   LDS.U16 R4, [R3+0x2] ;
        /*0040*/              @!P1 LDS.64 R6, [R3+0x8] ;
        /*0050*/                   PRMT R8, R6, 0x1404, RZ ;
        /*0060*/                   HMUL2.BF16_V2 R8, R8, R9 ;
        /*0070*/              @P2 BRA 0x0010 ;
        /*0080*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0090*/              @P3 BRA 0x0080 ;
        /*00a0*/                   EXIT ;
"""


def test_the_longest_loop_and_its_opcodes():
    loops = sass_loops(SASS)
    assert [len(body) for body in loops] == [7, 2]  # 0x10..0x70, then 0x80..0x90
    assert loops[0][3] == "LDS.64 R6, [R3+0x8]"  # the predicate dropped
    mix = loop_mix(SASS)
    assert mix["length"] == 7
    assert mix["ops"] == {"LDS.U16": 2, "BRA": 2, "LDS.64": 1, "PRMT": 1, "HMUL2.BF16_V2": 1}


def test_no_loop():
    assert loop_mix("        /*0000*/                   EXIT ;\n") == {"length": 0, "ops": {}}
