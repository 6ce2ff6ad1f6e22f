"""The static-verification tools (scripts/sass_stats_lib.py, scripts/sass_report.py): the SASS, PTX,
cubin and verifier-output parsers on hand-written samples with exact counts, on a compiled sm90
kernel of ours, and, where they exist on this machine, on upstream FlashAttention-4's sm_100a dumps
(compile_anchor.py's output, cross-checked against shared/sm100/sass_stats.py) and upstream's own
verifier diagnostics. CI has neither of the latter two: those tests skip and say why.

Optional inputs (environment variables):
  FA4_ANCHOR_DIR   compile_anchor.py --out folder (default /tmp/anchors)
  FA4_SASS_STATS   path of the project's reference sass_stats.py (default ../shared/sm100/sass_stats.py)
  FA4_SM100_VENV   venv with flash-attn-4 for upstream's verifier run (default /tmp/sm100venv)
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "torch-ext")) if p not in sys.path]

from flash_attn4.fa4_kernels.arch import Arch  # noqa: E402
from flash_attn4.fa4_kernels.config import BackwardConfig, ForwardConfig  # noqa: E402
from scripts import sass_stats_lib as lib  # noqa: E402

ANCHOR_DIR = Path(os.environ.get("FA4_ANCHOR_DIR", "/tmp/anchors"))
# ../shared next to the checkout (or next to the folder of worktrees), as the issue names it.
SHARED_SASS_STATS = Path(os.environ.get("FA4_SASS_STATS") or next(
    (p for p in (ROOT.parent / "shared" / "sm100" / "sass_stats.py",
                 ROOT.parent.parent / "shared" / "sm100" / "sass_stats.py") if p.exists()),
    ROOT.parent / "shared" / "sm100" / "sass_stats.py"))
SM100_VENV = Path(os.environ.get("FA4_SM100_VENV", "/tmp/sm100venv"))
BASELINE = Path(__file__).with_name("verifier_baseline.json")


def _reference_stats_module():
    """The project's reference sass_stats.py (an external tool, only compared against), or skip."""
    if not SHARED_SASS_STATS.is_file():
        pytest.skip(f"reference sass_stats.py not found at {SHARED_SASS_STATS} (set FA4_SASS_STATS)")
    spec = importlib.util.spec_from_file_location("reference_sass_stats", SHARED_SASS_STATS)
    module = importlib.util.module_from_spec(spec)
    sys.dont_write_bytecode, saved = True, sys.dont_write_bytecode
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = saved
    return module


def _need_nvdisasm():
    if lib.find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not read")


# Keys both parsers report, ours -> the reference's.
SHARED_KEYS = {k: k for k in ("instructions", "utcmma", "gmma", "mma_sync", "mufu_ex2", "mufu", "ffma2", "fmul2",
                              "fadd2", "ffma", "ldtm", "sttm", "utccp", "utcbar", "ldl", "stl", "ldl_bytes",
                              "stl_bytes", "spill_marked", "bar", "syncs", "usetmaxreg", "two_cta", "regs",
                              "frame_bytes", "static_smem", "num_barriers", "num_mbarriers")}
SHARED_KEYS["nops"] = "nop"


# --- hand-written samples ------------------------------------------------------------------------

SASS_SAMPLE = """\
\t.target\tsm_100a

//--------------------- .text.kern_a --------------------------
\t.section\t.text.kern_a,"ax",@progbits
\t.align\t128
kern_a:
.text.kern_a:
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;
        /*0020*/              @!P0 USETMAXREG.DEALLOC.CTAPOOL 0x40 ;
        /*0030*/                   UTCHMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;
        /*0040*/              @UP1 UTCQMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], !UPT ;
        /*0050*/                   UTCBAR.2CTA.MULTICAST [UR12], URZ, UR13 ;
        /*0060*/                   LDTM.x32 R4, tmem[UR14] ;
        /*0070*/                   STTM.x16 tmem[UR15], R4 ;
        /*0080*/                   MUFU.EX2 R3, R3 ;
        /*0090*/                   MUFU.RCP R5, R5 ;
        /*00a0*/                   FFMA2 R6, R6.F32x2.HI_LO, R8.F32, R10 ;
        /*00b0*/                   FMUL2 R6, R6.F32x2.HI_LO, R8 ;
        /*00c0*/                   FADD2 R6, R6.F32x2.HI_LO, R8 ;
        /*00d0*/                   FFMA R2, R3, R4, R5 ;
        /*00e0*/                   STL.64 [R1+0x8], R2                 (*"SpillRefill"*);
        /*00f0*/                   LDL R2, [R1+0x8] ;
        /*0100*/                   LDL.128 R4, [R1] ;
.L_x_3:
        /*0110*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4], RZ ;
        /*0120*/                   UTMALDG.4D.2CTA [UR16], [UR18] ;
        /*0130*/               @P1 BRA `(.L_x_3) ;
        /*0140*/                   NOP ;
        /*0150*/                   EXIT ;
.L_x_4:
        /*0160*/                   BRA `(.L_x_4);
//--------------------- .text.kern_b --------------------------
\t.section\t.text.kern_b,"ax",@progbits
        /*0000*/                   WARPGROUP.ARRIVE ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
        /*0030*/                   EXIT ;
//--------------------- .nv.info --------------------------
\t.section\t.nv.info,"",@"SHT_CUDA_INFO"
        /*0000*/ \t.byte\t0x04, 0x2f
"""

KERN_A = dict(instructions=23, nops=1, utcmma=2, gmma=0, mma_sync=0, mma=2, mufu_ex2=1, mufu=2, ffma2=1, fmul2=1,
              fadd2=1, packed_fp32=3, ffma=1, ldtm=1, sttm=1, utcbar=1, tma=1, ldl=2, stl=1, ldl_bytes=4 + 16,
              stl_bytes=8, spill_marked=1, syncs=1, bar=0, usetmaxreg=["+192", "-64"], two_cta=True)
KERN_B = dict(instructions=4, gmma=1, utcmma=0, mma=1, warpgroup_arrive=1, bar=1, two_cta=False, usetmaxreg=[])


def test_sass_parser_counts_a_hand_written_listing_exactly():
    kernels = lib.sass_kernels(SASS_SAMPLE)
    assert list(kernels) == ["kern_a", "kern_b"]  # the .nv.info data after kern_b belongs to nobody
    a = lib.sass_counts(kernels["kern_a"])
    a["mma"] = lib.mma_count(a)
    assert {k: a[k] for k in KERN_A} == KERN_A
    b = lib.sass_counts(kernels["kern_b"])
    b["mma"] = lib.mma_count(b)
    assert {k: b[k] for k in KERN_B} == KERN_B
    pred = kernels["kern_a"][2]
    assert (pred.predicate, pred.opcode, pred.operands) == ("@!P0", "USETMAXREG.DEALLOC.CTAPOOL", "0x40")
    assert kernels["kern_a"][14].notes == ("SpillRefill",)
    # the largest kernel is the one a file's statistics describe
    stats = lib.stats_from_files(sass=SASS_SAMPLE)
    assert stats["kernel"] == "kern_a" and stats["kernels"] == ["kern_a", "kern_b"] and stats["target"] == "sm_100a"


def test_sass_parser_reads_cuobjdump_and_normalised_listings_alike():
    cuobjdump = """\
\tcode for sm_90a
\t\tFunction : kern_c
\t.headerflags\t@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
                                                                               /* 0x000fe20000000800 */
        /*0010*/              @!PT HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;  /* 0x0000000004187df0 */
                                                                               /* 0x000fe20008000818 */
        /*0020*/                   EXIT ;                                      /* 0x000000000000794d */
"""
    kernels = lib.sass_kernels(cuobjdump)
    assert list(kernels) == ["kern_c"] and [i.opcode for i in kernels["kern_c"]] == [
        "LDC", "HGMMA.64x64x16.F32.BF16", "EXIT"]
    report = _sass_report()
    text_a = SASS_SAMPLE.split("//--------------------- .text.kern_b")[0]
    normalised = report.normalised(text_a)
    assert "/*" not in normalised and "L:" in normalised  # what --dump writes
    ops = [i.opcode for i in lib.sass_kernels(text_a)["kern_a"]]
    assert [i.opcode for i in lib.sass_kernels(normalised)["kern_a"]] == ops  # nvdisasm's banner is kept
    bare = "\n".join(line for line in normalised.splitlines() if not line.startswith("//"))
    assert [i.opcode for i in lib.sass_kernels(bare, default_name="k")["k"]] == ops


PTX_SAMPLE = """\
.version 8.8
.target sm_100a
.address_size 64

.visible .entry k(
\t.param .u64 k_param_0
)
.reqntid 512, 1, 1
.reqnctapercluster 2, 1, 1
{
\tmbarrier.init.shared::cta.b64 \t[%r1], 1;
\tmov.b32 \t%r9, 4;
\tmbarrier.init.shared::cta.b64 \t[%r1+8], %r9;
\tsetmaxnreg.dec.sync.aligned.u32 \t64;
\tmov.b32 \t%r518, 256;
\ttcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 \t[%r2+328], %r518;
\tsetmaxnreg.inc.sync.aligned.u32 \t192;
\tsetmaxnreg.dec.sync.aligned.u32 \t64;
\ttcgen05.relinquish_alloc_permit.cta_group::2.sync.aligned;
\tmov.b32 \t%r518, 512;
\ttcgen05.dealloc.cta_group::2.sync.aligned.b32 \t%r42, %r518;
\ttcgen05.mma.cta_group::2.kind::f16 \t[%r5], %rd1, %rd2, %r6, %p1;
\tret;
}
"""


def test_ptx_facts_of_a_hand_written_sample():
    facts = lib.ptx_facts(PTX_SAMPLE)
    assert facts == {
        "target": "sm_100a", "reqntid": [512, 1, 1], "maxnreg": None, "cluster": [2, 1, 1],
        "setmaxnreg": ["-64", "+192", "-64"],
        # each operand resolved by the last mov before its own instruction
        "tmem_alloc": [{"cta_group": 2, "columns": 256}], "tmem_dealloc": [{"cta_group": 2, "columns": 512}],
        "tmem_relinquish": [2], "cta_groups": [2], "two_cta": True, "mbarrier_inits": [1, 4],
        "grid_stride": False, "umma_commits": 0,
    }
    stats = lib.stats_from_files(sass=SASS_SAMPLE, ptx=PTX_SAMPLE)
    assert (stats["tmem_columns"], stats["cta_group"], stats["two_cta_ptx"]) == (256, 2, True)
    assert stats["setmaxnreg"] == ["-64", "+192", "-64"]
    one_cta = lib.ptx_facts(PTX_SAMPLE.replace("cta_group::2", "cta_group::1").replace("%r518, 256", "%r518, 128"))
    assert one_cta["tmem_alloc"] == [{"cta_group": 1, "columns": 128}] and not one_cta["two_cta"]


def test_static_problems_name_each_inconsistency():
    stats = lib.stats_from_files(sass=SASS_SAMPLE, ptx=PTX_SAMPLE)
    assert lib.static_problems(stats) == [
        "local memory: 2 LDL / 1 STL, stack frame ? B",  # no cubin: no frame size
        "USETMAXREG ['+192', '-64'] != PTX setmaxnreg ['-64', '+192', '-64']",
        "TMEM dealloc columns [512] != alloc [256]",
    ]
    third_dec = "\tsetmaxnreg.dec.sync.aligned.u32 \t64;\n\ttcgen05.rel"
    fixed = PTX_SAMPLE.replace("%r518, 512", "%r518, 256").replace(third_dec, "\ttcgen05.rel")
    clean = lib.stats_from_files(sass=SASS_SAMPLE, ptx=fixed)
    assert lib.static_problems(clean, allow_spills=True) == []
    one_cta = fixed.replace("cta_group::2", "cta_group::1")  # while the SASS still has .2CTA opcodes
    assert lib.static_problems(lib.stats_from_files(sass=SASS_SAMPLE, ptx=one_cta), allow_spills=True) == [
        "2-CTA disagrees: {'SASS .2CTA': True, 'PTX cta_group::2': False}"]
    twice = fixed.replace("\tret;", "\tmov.b32 \t%r7, 100;\n\ttcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 "
                                     "\t[%r2], %r7;\n\tret;")
    assert lib.static_problems(lib.stats_from_files(sass=SASS_SAMPLE, ptx=twice), allow_spills=True) == [
        "TMEM: 2 alloc, 1 relinquish, 1 dealloc (one each expected)",
        "TMEM alloc of 100 columns (a power of two in [32, 512] expected)",
        "TMEM dealloc columns [256] != alloc [256, 100]",
    ]


def _tiny_cubin() -> bytes:
    """A minimal ELF64 with the pieces a cubin's resources come from: one kernel 'k' (168 registers,
    16-byte frame, 384 threads, 2-CTA tcgen05, 3 barriers, 2 KiB static shared memory)."""
    names = ["", ".shstrtab", ".strtab", ".symtab", ".nv.info", ".nv.info.k", ".text.k", ".nv.shared.k",
             ".note.nv.tkinfo"]
    shstrtab = b"".join(n.encode() + b"\0" for n in names)
    name_at = {n: shstrtab.index(n.encode() + b"\0") if n else 0 for n in names}
    strtab = b"\0k\0"
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, 6, 0, 16)
    nv_info = (bytes([4, 0x2F]) + struct.pack("<HII", 8, 1, 168)  # REGCOUNT(sym 1) = 168
               + bytes([4, 0x11]) + struct.pack("<HII", 8, 1, 16))  # FRAME_SIZE(sym 1) = 16
    nv_info_k = (bytes([4, 0x10]) + struct.pack("<HIII", 12, 384, 1, 1)  # REQNTID
                 + bytes([1, 0x52, 0, 0])  # TCGEN05_2CTA_USED
                 + bytes([2, 0x4C, 3, 0])  # NUM_BARRIERS = 3
                 + bytes([3, 0x1B]) + struct.pack("<H", 168))  # MAXREG_COUNT
    note = struct.pack("<III", 8, 52, 2000) + b"NVIDIA\0\0" + b"Cuda compilation tools, release 13.4, V13.4.59\0"
    bodies = {".shstrtab": (3, shstrtab, 0, 0), ".strtab": (3, strtab, 0, 0), ".symtab": (2, symtab, 2, 24),
              ".nv.info": (0x70000000, nv_info, 3, 0), ".nv.info.k": (0x70000000, nv_info_k, 3, 0),
              ".text.k": (1, bytes(16), 3, 0), ".nv.shared.k": (8, b"", 0, 0), ".note.nv.tkinfo": (7, note, 0, 0)}
    data, headers = bytearray(64), [bytes(64)]
    for name in names[1:]:
        kind, body, link, entsize = bodies[name]
        offset = len(data)
        data += body
        size = 2048 if name == ".nv.shared.k" else len(body)
        headers.append(struct.pack("<IIQQQQIIQQ", name_at[name], kind, 0, 0, offset, size, link, 0, 1, entsize))
    shoff = len(data)
    data += b"".join(headers)
    data[:16] = b"\x7fELF\x02\x01\x01" + bytes(9)
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, len(names), 1)
    return bytes(data)


def test_cubin_resources_of_a_hand_built_elf():
    res = lib.cubin_resources(_tiny_cubin())
    assert res == {"k": {"static_smem": 2048, "reserved_smem": 0, "regs": 168, "frame_bytes": 16,
                         "reqntid": [384, 1, 1], "num_barriers": 3, "maxreg_count": 168, "tcgen05_cta_used": 2,
                         "ptxas": "Cuda compilation tools, release 13.4, V13.4.59"}}


def test_cubin_resources_agree_with_the_reference_tool_on_the_hand_built_elf():
    ref = _reference_stats_module().cubin_resources(_tiny_cubin())["k"]
    ours = lib.cubin_resources(_tiny_cubin())["k"]
    for key in ("regs", "frame_bytes", "static_smem", "num_barriers", "ptxas"):
        assert ours[key] == ref[key], key
    assert list(ours["reqntid"]) == list(ref["threads"])


def test_sass_counts_agree_with_the_reference_tool_on_the_hand_written_listing(tmp_path):
    ref = _reference_stats_module()
    path = tmp_path / "sample.sass"
    path.write_text(SASS_SAMPLE)
    rows = {r["kernel"]: r for r in ref.analyse(path, None, None)}
    for name, insts in lib.sass_kernels(SASS_SAMPLE).items():
        ours = lib.sass_counts(insts)
        for key, ref_key in SHARED_KEYS.items():
            if key in ours:
                assert ours[key] == rows[name][ref_key], (name, key)


# Two C3 and one W0014 as CuTe DSL 4.8.1 prints them (colours included), made-up sources.
C3_HEAD = ("\x1b[93mwarning[nvvm-diag:C3]:\x1b[0m mbarrier arrive count may not match the mbarrier.init count "
           "(statically-visible or effective count: 32)")
VERIFIER_SAMPLE = f"""\
{C3_HEAD}

  --> /src/pkg/pipeline.py:26:14
      in function `\x1b[92mcreate\x1b[0m(...)`:
   |
  24 |     def create(*args):
> 26 |         obj = make(*args)
     |              ^
  \x1b[93mwarning:\x1b[0m All arrives are guarded by a warp-ID predicate, so 32 threads
           arrive, which differs from mbarrier.init.
  \x1b[92msuggestion:\x1b[0m set the init count to 32
  \x1b[94mnote:\x1b[0m PTX ISA mbarrier.init

{C3_HEAD}

  --> /src/pkg/pipeline.py:236:14
      in function `\x1b[92mcreate\x1b[0m(...)`:
  \x1b[93mwarning:\x1b[0m same story

\x1b[93mwarning[W0014]:\x1b[0m TMEM load reaches a synchronization or release boundary without tcgen05.wait<load>

  --> /src/pkg/fwd.py:3869:8
      in function `\x1b[92mload_KV\x1b[0m(...)`:
  \x1b[93mwarning:\x1b[0m A prior tcgen05.ld may still be outstanding.
  \x1b[92msuggestion:\x1b[0m insert tcgen05.wait<load>
"""


def test_verifier_output_parser_on_a_hand_written_sample():
    diags = lib.parse_verifier_output(VERIFIER_SAMPLE + "some unrelated stderr line\n")
    assert [(d["severity"], d["code"], d["namespace"]) for d in diags] == [
        ("warning", "C3", "nvvm-diag"), ("warning", "C3", "nvvm-diag"), ("warning", "W0014", "")]
    first, _, last = diags
    assert (first["file"], first["line"], first["function"]) == ("/src/pkg/pipeline.py", 26, "create")
    assert first["reason"] == ("All arrives are guarded by a warp-ID predicate, so 32 threads arrive, which "
                               "differs from mbarrier.init.")
    assert first["suggestion"] == "set the init count to 32"
    assert (last["file"], last["line"], last["function"]) == ("/src/pkg/fwd.py", 3869, "load_KV")
    assert lib.diagnostic_key(last) == ("W0014 | TMEM load reaches a synchronization or release boundary without "
                                        "tcgen05.wait<load> | fwd.py | load_KV")
    assert lib.parse_verifier_output("nothing to see\n") == []


def test_sass_report_builds_sm100_configs_through_dispatch():
    report = _sass_report()
    cfg, how = report.build_config("fwd", "sm_100a", "d=128,causal=true")
    assert cfg.arch is Arch.SM100 and (cfg.head_dim, cfg.causal, cfg.tile_m) == (128, True, 256)
    assert how == "dispatch"
    with pytest.raises(ValueError, match="tiles are 256 x 128"):  # the sm100 rules refuse other tiles
        report.build_config("fwd", "sm_100a", "d=128,causal=true,tile_m=128")
    direct, how = report.build_config("fwd", "sm_90a", "d=64,dtype=float16", direct=True)
    assert how == "direct" and direct.dtype == "float16" and direct.arch is Arch.SM90


def test_anchor_names_and_comparison(tmp_path):
    """sass_report --anchors: our config -> compile_anchor.py's config name, and the ratios against
    the anchors.json of the flavour and arch our compile used."""
    report = _sass_report()
    def fwd(**fields):
        from flash_attn4.fa4_kernels.sm100.tiles import forward_tiles

        fields = {"head_dim": 128, "head_dim_v": 128, **fields}
        tiles = forward_tiles(fields["head_dim"], fields["head_dim_v"], False, False)
        return ForwardConfig(arch=Arch.SM100, dtype="bfloat16", **{**tiles, **fields})

    assert report.anchor_name("fwd", fwd()) == "fwd_d128"
    assert report.anchor_name("fwd", fwd(head_dim=192)) == "fwd_d192_dv128"
    assert report.anchor_name("fwd", fwd(causal=True)) == "fwd_d128_causal"
    assert report.anchor_name("fwd", fwd(varlen=True)) == "fwd_d128_varlen"
    assert report.anchor_name("fwd", fwd(local=True)) == "fwd_d128_local256_0"
    assert report.anchor_name("fwd", fwd(pack_gqa=4)) == "fwd_d128_gqa32_8"
    (tmp_path / "cu13").mkdir()
    (tmp_path / "cu13" / "anchors.json").write_text(json.dumps({"arch": "sm_100a", "configs": [
        {"config": "fwd_d128_causal", "status": "ok", "sass": {"instructions": 4000, "utcmma": 64, "gmma": 0}}]}))
    ours = {"dsl_ir_module": "_cutlass_ir.cu13.cpython-311-x86_64-linux-gnu.so", "target": "sm_100a",
            "instructions": 4200, "mma": 32}
    cmp = report.anchor_comparison(tmp_path, "fwd", fwd(causal=True), ours)
    assert (cmp["config"], cmp["flavour"], cmp["instructions"], cmp["mma"]) == ("fwd_d128_causal", "cu13", 4000, 64)
    assert cmp["instructions_ratio"] == pytest.approx(1.05) and cmp["per_mma_ratio"] == pytest.approx(2.1)
    assert report.anchor_comparison(tmp_path, "fwd", fwd(), ours) is None  # no such anchor
    assert report.anchor_comparison(tmp_path, "fwd", fwd(causal=True), {**ours, "target": "sm_90a"}) is None
    cu12 = {**ours, "dsl_ir_module": "_cutlass_ir.cu12.cpython-311-x86_64-linux-gnu.so"}
    assert report.anchor_comparison(tmp_path, "fwd", fwd(causal=True), cu12) is None  # no cu12 table here


def test_sass_report_set_mode_lists_the_ci_kernel_set(monkeypatch, capsys):
    report = _sass_report()
    jobs = report.kernel_set_jobs("sm_90a")
    kinds = Counter(kind for kind, _, _ in jobs)
    assert kinds["fwd"] > 0 and kinds["bwd"] > 0 and all(label for _, label, _ in jobs)
    assert all(cfg.arch is Arch.SM90 for _, _, cfg in jobs)
    assert len({(kind, label) for kind, label, _ in jobs}) == len(jobs)  # distinct labels, distinct dump files
    assert report.config_label(ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=64, head_dim_v=64,
                                             causal=True)) == "dtype=bfloat16,head_dim=64,head_dim_v=64,causal=True"
    monkeypatch.setattr(report, "kernel_set_jobs", lambda arch: [])
    assert report.main(["set", "--arch", "sm_100a"]) == 1  # an arch without kernels is an error
    assert "no kernels" in capsys.readouterr().err


# --- our compiled sm90 kernels ---------------------------------------------------------------------

def _sm90_forward(d=64, **fields) -> ForwardConfig:
    from flash_attn4 import dispatch

    flags = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, has_sink=False)
    flags.update({k: fields.pop(k) for k in list(fields) if k in flags})
    return dispatch.forward_config(Arch.SM90, "bfloat16", d, d, **flags).replace(**fields)


@pytest.mark.slow
def test_compiled_sm90_forward_statistics():
    _need_nvdisasm()
    cfg = _sm90_forward(64)
    stats = lib.kernel_stats(cfg)
    assert stats["target"] == "sm_90a" and stats["ptx"]["target"] == "sm_90a"
    assert stats["gmma"] > 0 and stats["mma"] == stats["gmma"] and stats["utcmma"] == 0
    assert stats["mufu_ex2"] > 0
    assert stats["ldl"] == stats["stl"] == 0 and stats["frame_bytes"] == 0, "register spills"
    assert 0 < stats["regs"] <= 255
    assert stats["static_smem"] >= 0 and stats["reqntid"] == stats["ptx"]["reqntid"]
    assert sorted(stats["usetmaxreg"]) == sorted(stats["setmaxnreg"]) and stats["usetmaxreg"]
    assert stats["tmem_columns"] is None and stats["cta_group"] is None and not stats["two_cta"]
    assert stats["packed_fp32"] == 0  # f32x2 arithmetic does not exist on sm_90
    assert lib.static_problems(stats) == []
    # one compile per (config, flavour) in a process
    hits = lib._cached_stats.cache_info().hits
    again = lib.kernel_stats(cfg)
    assert lib._cached_stats.cache_info().hits == hits + 1 and again == stats
    again["instructions"] = -1  # callers get a copy
    assert lib.kernel_stats(cfg)["instructions"] == stats["instructions"]


@pytest.mark.slow
def test_compiled_sm90_forward_agrees_with_the_reference_tool():
    _need_nvdisasm()
    ref = _reference_stats_module()
    cfg = _sm90_forward(64)
    files = lib.kernel_artifacts(cfg)  # the compile kernel_stats reads
    ours = lib.stats_from_files(sass=files["sass"], cubin=files["cubin"], ptx=files["ptx"])
    theirs = max(ref.analyse(files["sass"], files["cubin"], None), key=lambda r: r["instructions"])
    assert {k: ours[k] for k in SHARED_KEYS} == {k: theirs.get(r) for k, r in SHARED_KEYS.items()}
    assert lib.kernel_stats(cfg) == {**ours, "flavour": "auto", "dsl_ir_module": files["dsl_ir_module"]}
    # compile.py compiles without the JIT engine, and then 4.8.1 keeps PTX and cubin but writes no
    # .sass even with KEEP=sass: the tools disassemble the cubin (nvdisasm -c), as sass_report did
    assert files["sass"].read_text() == lib.disassemble(files["cubin"])


@pytest.mark.slow
def test_sm100_target_through_an_arch_neutral_kernel():
    """The sm_100a path end to end before the Blackwell forward exists: the backward's
    architecture-independent preprocessing kernel compiled for sm_100a."""
    _need_nvdisasm()
    from flash_attn4.fa4_kernels.config import PreprocessConfig

    stats = lib.kernel_stats(PreprocessConfig(arch=Arch.SM100, dtype="bfloat16", head_dim_v=128))
    assert stats["target"] == "sm_100a" and stats["ptx"]["target"] == "sm_100a"
    assert stats["instructions"] > 0 and stats["mma"] == 0 and stats["ldl"] == stats["stl"] == 0
    assert stats["tmem_columns"] is None and stats["tcgen05_cta_used"] is None and not stats["two_cta"]


@pytest.mark.slow
def test_sass_report_dumps_mode_reads_a_dump_folder(tmp_path, capsys):
    _need_nvdisasm()
    import shutil

    cfg = _sm90_forward(64)
    files = lib.kernel_artifacts(cfg)
    for key in ("cubin", "ptx", "sass"):
        shutil.copy(files[key], tmp_path / {"cubin": "k.sm_90a.cubin", "ptx": "k.sm_90a.ptx", "sass": "k.sass"}[key])
    assert _sass_report().main(["dumps", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    expected = lib.kernel_stats(cfg)
    assert {k: row[k] for k in ("instructions", "gmma", "regs", "usetmaxreg", "setmaxnreg")} == {
        k: expected[k] for k in ("instructions", "gmma", "regs", "usetmaxreg", "setmaxnreg")}


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
def test_flavour_selects_the_embedded_ptxas():
    _need_nvdisasm()
    if not (_installed("nvidia-cutlass-dsl-libs-cu12") and _installed("nvidia-cutlass-dsl-libs-cu13")):
        pytest.skip("needs both DSL flavours (pip install 'nvidia-cutlass-dsl[cu13]' next to the default cu12)")
    cfg = _sm90_forward(64)
    cu12, cu13 = lib.kernel_stats(cfg, "cu12"), lib.kernel_stats(cfg, "cu13")
    assert ".cu12." in cu12["dsl_ir_module"] and ".cu13." in cu13["dsl_ir_module"]
    assert cu13["ptxas"] and "release 13." in cu13["ptxas"]
    assert cu12["ptxas"] is None or "release 12." in cu12["ptxas"]  # 12.9 leaves no note in the cubin
    assert cu12["gmma"] == cu13["gmma"] > 0  # same PTX, another assembler
    with pytest.raises(ValueError):
        lib.compile_config(cfg, "cu11")


class _NotAConfig:
    """Unpickles into an exception in the compiling interpreter (int("not a config"))."""

    arch = "sm_90a"

    def __reduce__(self):
        return int, ("not a config",)


@pytest.mark.slow
def test_compile_workers_build_what_a_fresh_interpreter_builds(tmp_path, monkeypatch):
    """A compile in a worker interpreter (one that has compiled before, with other CUTE_DSL_*
    settings) leaves the same PTX and SASS as one in a fresh interpreter; a compile that fails in
    a worker reports the child's failure (exit code, traceback) and the worker compiles on; one
    that died while idle is passed over."""
    _need_nvdisasm()
    monkeypatch.delenv(lib.WORKERS_ENV, raising=False)
    monkeypatch.setattr(lib, "WORKER_COMPILES", 10**6)  # no replacement by age within this test
    cfg = _sm90_forward(64, causal=True)
    failed = lib.compile_config(_NotAConfig(), "auto", tmp_path / "bad")
    assert failed.returncode != 0 and "invalid literal for int()" in failed.stderr
    with pytest.raises(RuntimeError, match="invalid literal"):
        failed.check()
    served = list(lib._IDLE_WORKERS.values())[-1][-1]  # the most recently used worker
    assert served.proc.poll() is None
    assert lib.compile_config(cfg, "auto", tmp_path / "verify", keep="", compiler_opt="warnings").returncode == 0
    assert list(lib._IDLE_WORKERS.values())[-1][-1] is served  # the same worker compiled on
    by_worker = lib._main_module(lib.compile_config(cfg, "auto", tmp_path / "worker").check())
    monkeypatch.setenv(lib.WORKERS_ENV, "0")
    fresh = lib._main_module(lib.compile_config(cfg, "auto", tmp_path / "fresh").check())
    assert by_worker["ptx"].read_text() == fresh["ptx"].read_text()
    assert lib.disassemble(by_worker["cubin"]) == lib.disassemble(fresh["cubin"])
    assert not any((tmp_path / "verify").iterdir())  # nothing kept where nothing was asked for
    # A worker that died while idle is passed over: the next compile fails for its own reason (the
    # config), not with the dead worker's exit, and runs in a new worker.
    monkeypatch.delenv(lib.WORKERS_ENV)
    served.proc.kill()
    served.proc.wait()
    again = lib.compile_config(_NotAConfig(), "auto", tmp_path / "bad_again")
    assert "invalid literal for int()" in again.stderr and "compile worker exited" not in again.stderr
    assert list(lib._IDLE_WORKERS.values())[-1][-1] is not served and served.proc.stdin.closed


def _baseline() -> dict:
    return json.loads(BASELINE.read_text())


# name -> config, for the verifier baseline (each one compile of a few seconds).
def _verifier_configs() -> dict:
    from flash_attn4 import dispatch

    return {
        "sm90 fwd d128 causal": _sm90_forward(128, causal=True),
        "sm90 bwd d64": dispatch.backward_config(Arch.SM90, "bfloat16", 64, 64, causal=False, local=False,
                                                 has_softcap=False, varlen=False, has_seqused_k=False,
                                                 deterministic=False),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sm90 fwd d128 causal", "sm90 bwd d64"])
def test_verifier_reports_nothing_beyond_the_reviewed_baseline(name):
    """CUTE_DSL_COMPILER_OPT=warnings on our kernels: the diagnostics (code, message, source file,
    function) must equal tests/cpu/verifier_baseline.json's reviewed list for the config, no more,
    no fewer (a fixed one is removed from the baseline in the same commit)."""
    cfg = _verifier_configs()[name]
    assert isinstance(cfg, (ForwardConfig, BackwardConfig))
    found = Counter(lib.diagnostic_key(d) for d in lib.verifier_diagnostics(cfg))
    expected = Counter(_baseline()["configs"][name])
    assert found == expected, {"new": sorted((found - expected).elements()),
                               "gone": sorted((expected - found).elements())}


# --- upstream's sm_100a kernels (where compile_anchor.py's output and venv exist) ----------------

def _anchor_flavours() -> list[Path]:
    found = [ANCHOR_DIR / f for f in ("cu12", "cu13") if (ANCHOR_DIR / f / "anchors.json").exists()]
    if not found:
        pytest.skip(f"no upstream anchor dumps in {ANCHOR_DIR} (compile_anchor.py --out DIR; set FA4_ANCHOR_DIR)")
    return found


def test_anchor_dumps_agree_with_the_reference_tool():
    ref = _reference_stats_module()
    for flavour_dir in _anchor_flavours():
        for stem, files in lib.dump_artifacts(flavour_dir / "main").items():
            ours = lib.stats_from_files(sass=files["sass"], cubin=files["cubin"], ptx=files.get("ptx"))
            theirs = max(ref.analyse(files["sass"], files["cubin"], None), key=lambda r: r["instructions"])
            diff = {k: (ours[k], theirs.get(r)) for k, r in SHARED_KEYS.items() if ours[k] != theirs.get(r)}
            assert not diff, (flavour_dir.name, stem, diff)


def test_anchor_dumps_agree_with_their_recorded_table():
    """compile_anchor.py's anchors.json (the ANCHOR_SASS.md numbers) against our parser, PTX facts
    included: TMEM columns and cta_group, setmaxnreg, .reqntid; and the tcgen05 facts hold together
    (one alloc/relinquish/dealloc, .2CTA in SASS iff cta_group::2 in PTX iff the cubin says 2-CTA,
    USETMAXREG = setmaxnreg)."""
    for flavour_dir in _anchor_flavours():
        recorded = {r["config"]: r for r in json.loads((flavour_dir / "anchors.json").read_text())["configs"]}
        artifacts = lib.dump_artifacts(flavour_dir / "main")
        for name, rec in recorded.items():
            if rec.get("status") != "ok":
                continue
            files = artifacts[name]
            ours = lib.stats_from_files(sass=files["sass"], cubin=files["cubin"], ptx=files["ptx"])
            for key in ("instructions", "utcmma", "mufu_ex2", "ffma2", "ldtm", "sttm", "ldl", "stl", "regs",
                        "static_smem", "usetmaxreg", "two_cta"):
                assert ours[key] == rec["sass"][key], (flavour_dir.name, name, key)
            ptx = rec["ptx"]
            assert [a["columns"] for a in ours["ptx"]["tmem_alloc"]] == [a["columns"] for a in ptx["tmem_alloc"]]
            assert ours["ptx"]["setmaxnreg"] == ptx["setmaxnreg"]
            assert ",".join(map(str, ours["ptx"]["reqntid"])) == ptx["reqntid"]
            assert ours["two_cta_ptx"] == ptx["cta_group_2"] == ours["two_cta"] == (ours["tcgen05_cta_used"] == 2)
            assert ours["cta_group"] == (2 if ours["two_cta"] else 1) and ours["tmem_columns"] <= 512
            assert len(ours["ptx"]["tmem_alloc"]) == len(ours["ptx"]["tmem_dealloc"]) == 1
            assert len(ours["ptx"]["tmem_relinquish"]) == 1
            assert sorted(ours["usetmaxreg"]) == sorted(ours["setmaxnreg"])
            assert ours["mma"] == ours["utcmma"] > 0
            assert lib.static_problems(ours, allow_spills=True) == []
            spills = ours["ldl"] + ours["stl"] > 0
            assert bool(lib.static_problems(ours)) == spills  # upstream spills at d=192 (and cu12 bwd d=128)


@pytest.mark.slow
def test_upstream_forward_verifier_diagnostics_are_captured():
    """Upstream's sm100 forward (d=128, cu13) gets 2 C3 and 1 W0014 from 4.8.1's verifier (false
    positives, BLACKWELL.md): the parser must see them in a real compile's output."""
    python = SM100_VENV / "bin" / "python"
    anchor = SHARED_SASS_STATS.with_name("compile_anchor.py")
    if not python.exists() or not anchor.exists():
        pytest.skip(f"needs the flash-attn-4 venv {SM100_VENV} (FA4_SM100_VENV) and compile_anchor.py")
    if subprocess.run([str(python), "-c", "import flash_attn.cute"], capture_output=True).returncode != 0:
        pytest.skip(f"flash-attn-4 is not importable in {SM100_VENV}")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100", FLASH_ATTENTION_NUM_SMS="148",
               CUTE_DSL_COMPILER_OPT="warnings", PYTHONWARNINGS="ignore", PYTHONDONTWRITEBYTECODE="1")
    env.pop("CUTE_DSL_KEEP", None)
    proc = subprocess.run([str(python), str(anchor), "--worker", "fwd_d128", "--arch", "sm_100a", "--flavour", "cu13"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diags = lib.parse_verifier_output(proc.stderr)
    assert Counter(d["code"] for d in diags) == {"C3": 2, "W0014": 1}, [lib.diagnostic_key(d) for d in diags]
    assert all(d["file"] and d["function"] and d["reason"] for d in diags)


# --- helpers ------------------------------------------------------------------------------------

def _sass_report():
    spec = importlib.util.spec_from_file_location("sass_report_under_test", ROOT / "scripts" / "sass_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
