"""Static facts about a compiled kernel, without a GPU: SASS counts, cubin resources, PTX facts and
the DSL verifier's diagnostics. Used by scripts/sass_report.py and the CPU tests.

Entry points (everything below them is reusable on its own):

    kernel_stats(cfg, flavour="auto")          -> dict   (cached per (cfg.key(), flavour))
    kernel_artifacts(cfg, flavour="auto")      -> {cubin, sass, ptx: Path, dsl_ir_module}   (the same compile)
    verifier_diagnostics(cfg, flavour="auto", options="warnings") -> list[dict]   (cached likewise)
    diagnostic_key(diag) -> str   ('code | message | file name | function': what a baseline compares)
    compile_config(cfg, flavour, out_dir, keep=..., compiler_opt=...) -> CompileResult
    stats_from_files(sass=..., cubin=..., ptx=...) -> dict
    sass_kernels(text) / sass_counts(instructions) / ptx_facts(text) / cubin_resources(data)
    parse_verifier_output(stderr_text) -> list[dict]
    static_problems(stats) -> list[str]   (spills, USETMAXREG vs setmaxnreg, TMEM alloc/free, 2-CTA views)

``cfg`` is any fa4_kernels configuration object (ForwardConfig, BackwardConfig, PreprocessConfig,
PostprocessConfig, or a future class): it is pickled to another interpreter, which imports the
``compile`` module next to the config's module and calls the compiler registered for its class
(``_COMPILERS``, else ``compile_<kind>`` by class name). Not this interpreter, because the DSL
picks its toolkit flavour at import and reads CUTE_DSL_* (dumps, verifier options) into its own
objects: a worker interpreter per flavour (and environment) serves one compile after another,
making the DSL read CUTE_DSL_* again for each (FA4_SASS_COMPILE_WORKERS=0: a fresh interpreter
per compile instead).

Toolkit flavour: the DSL embeds ptxas in ``_cutlass_ir.cuNN.so`` and loads the newest flavour whose
major version is at most the driver's (no driver: the newest installed). ``cu12`` / ``cu13`` make
the child report a CUDA 12.9 / 13.4 driver to the DSL's import-time probe (ctypes' view of
``libcuda.so``'s cuDriverGetVersion; nothing else of the driver is used when compiling); ``auto``
leaves the choice to the DSL. The ptxas that really ran is read back from the cubin
(``ptxas`` key) and the IR module the DSL loaded is reported (``dsl_ir_module``).

The statistics dict (``kernel_stats`` / ``stats_from_files``), one kernel (the largest in the cubin):
  kernel, kernels (every kernel in the cubin), target (``sm_100a``...), ptxas, flavour, dsl_ir_module
  instructions, nops; mma (the tensor-core MMAs of the target: utcmma on sm_100, gmma on sm_90, else
  warp-level mma_sync), utcmma (UTC*MMA), gmma (HGMMA/QGMMA/IGMMA/BGMMA), mma_sync (HMMA/IMMA/...)
  mufu_ex2, mufu; ffma2, fmul2, fadd2, packed_fp32 (their sum), ffma
  ldtm, sttm (tcgen05.ld/st), utccp, utcbar (tcgen05.commit), tma (UTMALDG/UTMASTG/UTMAREDG/UBLK*)
  ldl, stl (local memory: spills or local arrays), ldl_bytes, stl_bytes, spill_marked (nvdisasm's
  SpillRefill notes), frame_bytes (per-thread stack frame from the cubin; where spills live)
  bar, syncs (SYNCS.*: mbarriers), warpgroup_arrive, bra_u_any (uniformity loops)
  usetmaxreg: ["+240", "-24", ...] in code order (TRY_ALLOC/ALLOC "+", DEALLOC "-")
  two_cta: any opcode with a .2CTA modifier; two_cta_ptx: cta_group::2 anywhere in the PTX
  regs, static_smem (bytes of .nv.shared.<kernel>; dynamic shared memory is a launch value),
  reserved_smem, reqntid ([x, y, z] from the cubin), max_threads, num_barriers, num_mbarriers,
  tcgen05_cta_used (1 / 2 / None: the cubin's TCGEN05_1CTA/2CTA_USED attribute), maxreg_count
  (the cubin's register cap: 65536 / threads when the kernel sets its budgets with setmaxnreg)
  ptx: {target, reqntid, maxnreg, cluster, setmaxnreg: ["+240", ...], tmem_alloc: [{cta_group,
  columns}], tmem_dealloc: [...], tmem_relinquish: [cta_group, ...], cta_groups: sorted set,
  mbarrier_inits: [count or register, ...], grid_stride: reads %nctaid.x (a persistent grid's
  stride), umma_commits: tcgen05.commit sites}
  setmaxnreg (= ptx.setmaxnreg); tmem_columns: the alloc operands summed (None without
  tcgen05.alloc); cta_group: the one cta_group of the tcgen05 instructions (None without, a list if
  mixed)
  opcodes: {opcode: count}, most frequent first
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import functools
import json
import os
import pickle
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAVOURS = ("auto", "cu12", "cu13")
# cuDriverGetVersion values that make the DSL's import pick a flavour (major*1000 + minor*10).
DRIVER_VERSION_FOR_FLAVOUR = {"cu12": 12090, "cu13": 13040}


# ---------------------------------------------------------------------------------------------
# SASS text (nvdisasm -c, nvdisasm in full, cuobjdump -sass, or sass_report's normalised dump)
# ---------------------------------------------------------------------------------------------

_SECTION_BANNER = re.compile(r"^//-{3,}\s+(\.\S+?)\s*-*\s*$")  # nvdisasm: //----- .text.k -----
_SECTION_DIRECTIVE = re.compile(r"^\.section\s+([^,\s]+)")
_CUOBJDUMP_FUNCTION = re.compile(r"^Function\s*:\s*(\S+)")
_ADDRESS = re.compile(r"^/\*[0-9a-fA-F]{4,}\*/")
_ENCODING = re.compile(r"/\*\s*0x[0-9a-fA-F]+\s*\*/")
_NOTE = re.compile(r"\(\*(.*?)\*\)")
_OPCODE = re.compile(r"[A-Z][A-Z0-9_]*(\.[A-Za-z0-9_]+)*")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One SASS instruction: guard predicate ('' if none), opcode with modifiers, operand text,
    and nvdisasm's notes such as 'SpillRefill'."""

    predicate: str
    opcode: str
    operands: str
    notes: tuple[str, ...] = ()

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def modifiers(self) -> tuple[str, ...]:
        return tuple(self.opcode.split(".")[1:])


def parse_instruction(line: str) -> Instruction | None:
    """The instruction on a listing line, or None for directives, labels, banners and blanks."""
    text = _ADDRESS.sub("", line.strip()).strip()
    text = _ENCODING.sub("", text)
    notes = tuple(n.strip().strip('"') for n in _NOTE.findall(text))
    text = _NOTE.sub("", text).strip().strip("{}").strip()
    if not text or text[0] in "./" or text.endswith(":"):
        return None
    text = text.rstrip(";").rstrip()
    predicate, _, rest = text.partition(" ") if text.startswith("@") else ("", "", text)
    opcode, _, operands = rest.strip().partition(" ")
    if not _OPCODE.fullmatch(opcode):
        return None
    return Instruction(predicate, opcode, operands.strip().rstrip(";").strip(), notes)


def sass_kernels(text: str, default_name: str = "kernel") -> dict[str, list[Instruction]]:
    """Kernel name -> its instructions. Instructions outside any section header (normalised dumps)
    belong to ``default_name``; instructions of non-code sections are impossible (data is all
    directives), but a non-.text section ends the current kernel anyway."""
    kernels: dict[str, list[Instruction]] = {}
    current: str | None = default_name
    for line in text.splitlines():
        stripped = line.strip()
        header = (_SECTION_BANNER.match(stripped) or _SECTION_DIRECTIVE.match(stripped))
        if header:
            name = header.group(1)
            current = name[len(".text."):] if name.startswith(".text.") else None
            continue
        found = _CUOBJDUMP_FUNCTION.match(stripped)
        if found:
            current = found.group(1)
            continue
        inst = parse_instruction(line)
        if inst is not None and current is not None:
            kernels.setdefault(current, []).append(inst)
    return kernels


_LOCAL_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
_TMA_BASES = {"UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED", "UTMAPF", "UBLKPF"}


def _local_access_bytes(inst: Instruction) -> int:
    return next((_LOCAL_WIDTH[m] for m in inst.modifiers if m in _LOCAL_WIDTH), 4)


def _usetmaxreg_value(inst: Instruction) -> str | None:
    """'+N' for USETMAXREG.TRY_ALLOC/ALLOC, '-N' for .DEALLOC: N is the last operand."""
    last = inst.operands.split(",")[-1].strip()
    if not re.fullmatch(r"0x[0-9a-fA-F]+|\d+", last):
        return None
    sign = "-" if "DEALLOC" in inst.modifiers else "+"
    return f"{sign}{int(last, 0)}"


def sass_counts(instructions: list[Instruction]) -> dict:
    """The per-kernel counts of the module docstring (SASS part)."""
    bases = Counter(i.base for i in instructions)
    opcodes = Counter(i.opcode for i in instructions)

    def bases_matching(pattern: str) -> int:
        rx = re.compile(pattern)
        return sum(n for b, n in bases.items() if rx.fullmatch(b))

    ldl = [i for i in instructions if i.base == "LDL"]
    stl = [i for i in instructions if i.base == "STL"]
    packed = {name: bases[name.upper()] for name in ("ffma2", "fmul2", "fadd2")}
    counts = {
        "instructions": len(instructions),
        "nops": bases["NOP"],
        "utcmma": bases_matching(r"UTC[A-Z]*MMA"),
        "gmma": bases_matching(r"[HQIB]GMMA"),
        "mma_sync": bases_matching(r"[A-Z]MMA"),
        "mufu_ex2": sum(n for op, n in opcodes.items() if op.startswith("MUFU.EX2")),
        "mufu": bases["MUFU"],
        **packed,
        "packed_fp32": sum(packed.values()),
        "ffma": bases["FFMA"],
        "ldtm": bases["LDTM"],
        "sttm": bases["STTM"],
        "utccp": bases["UTCCP"],
        "utcbar": bases["UTCBAR"],
        "tma": sum(bases[b] for b in _TMA_BASES),
        "ldl": len(ldl),
        "stl": len(stl),
        "ldl_bytes": sum(map(_local_access_bytes, ldl)),
        "stl_bytes": sum(map(_local_access_bytes, stl)),
        "spill_marked": sum("SpillRefill" in i.notes for i in instructions),
        "bar": bases["BAR"],
        "syncs": bases["SYNCS"],
        "warpgroup_arrive": sum(n for op, n in opcodes.items() if op.startswith("WARPGROUP.ARRIVE")),
        "bra_u_any": sum(n for op, n in opcodes.items() if op.startswith("BRA.U.ANY")),
        "usetmaxreg": [v for v in (_usetmaxreg_value(i) for i in instructions if i.base == "USETMAXREG")
                       if v is not None],
        "two_cta": any("2CTA" in i.modifiers for i in instructions),
        "opcodes": dict(opcodes.most_common()),
    }
    return counts


def mma_count(stats: dict) -> int:
    """The tensor-core MMAs of the kernel's generation: UTC*MMA (sm_100), else *GMMA (sm_90), else
    warp-level MMA."""
    return stats["utcmma"] or stats["gmma"] or stats["mma_sync"]


# ---------------------------------------------------------------------------------------------
# PTX
# ---------------------------------------------------------------------------------------------

_PTX_MOV_IMM = re.compile(r"^\s*mov\.[bsu]32\s+(%r\d+),\s*(\d+|0x[0-9a-fA-F]+);", re.M)
_PTX_ALLOC = re.compile(r"tcgen05\.alloc\.cta_group::(\d)\S*\s+\[[^\]]*\],\s*([%\w]+);")
_PTX_DEALLOC = re.compile(r"tcgen05\.dealloc\.cta_group::(\d)\S*\s+[%\w]+,\s*([%\w]+);")
_PTX_RELINQUISH = re.compile(r"tcgen05\.relinquish_alloc_permit\.cta_group::(\d)")
_PTX_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\S*\s+(\d+);")
_PTX_MBAR_INIT = re.compile(r"mbarrier\.init\S*\s+\[[^\]]*\],\s*([%\w]+);")


def _ptx_operand_value(ptx: str, operand: str, before: int) -> int | str:
    """An instruction operand as a number: an immediate, or the last `mov %rN, imm` before it;
    otherwise the register name (a value computed at run time)."""
    if re.fullmatch(r"\d+|0x[0-9a-fA-F]+", operand):
        return int(operand, 0)
    value: int | str = operand
    for m in _PTX_MOV_IMM.finditer(ptx, 0, before):
        if m.group(1) == operand:
            value = int(m.group(2), 0)
    return value


def _ptx_triple(ptx: str, directive: str) -> list[int] | None:
    m = re.search(rf"\.{directive}\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", ptx)
    return [int(x) for x in m.groups() if x is not None] if m else None


def ptx_facts(ptx: str) -> dict:
    """What the PTX states about TMEM, register budgets, threads and clusters (module docstring)."""
    allocs = [{"cta_group": int(m.group(1)), "columns": _ptx_operand_value(ptx, m.group(2), m.start())}
              for m in _PTX_ALLOC.finditer(ptx)]
    deallocs = [{"cta_group": int(m.group(1)), "columns": _ptx_operand_value(ptx, m.group(2), m.start())}
                for m in _PTX_DEALLOC.finditer(ptx)]
    relinquish = [int(m.group(1)) for m in _PTX_RELINQUISH.finditer(ptx)]
    groups = sorted({int(g) for g in re.findall(r"tcgen05\.\w+\.cta_group::(\d)", ptx)})
    target = re.search(r"^\s*\.target\s+(\S+)", ptx, re.M)
    maxnreg = re.search(r"\.maxnreg\s+(\d+)", ptx)
    return {
        "target": target.group(1).rstrip(",") if target else None,
        "reqntid": _ptx_triple(ptx, "reqntid"),
        "maxnreg": int(maxnreg.group(1)) if maxnreg else None,
        "cluster": _ptx_triple(ptx, "reqnctapercluster") or _ptx_triple(ptx, "explicitcluster"),
        "setmaxnreg": [("+" if op == "inc" else "-") + n for op, n in _PTX_SETMAXNREG.findall(ptx)],
        "tmem_alloc": allocs,
        "tmem_dealloc": deallocs,
        "tmem_relinquish": relinquish,
        "cta_groups": groups,
        "two_cta": "cta_group::2" in ptx,
        "mbarrier_inits": [_ptx_operand_value(ptx, m.group(1), m.start()) for m in _PTX_MBAR_INIT.finditer(ptx)],
        # A persistent grid's CTAs stride by the grid size through their tiles.
        "grid_stride": "%nctaid.x" in ptx,
        "umma_commits": len(re.findall(r"\btcgen05\.commit\.", ptx)),
    }


# ---------------------------------------------------------------------------------------------
# cubin (ELF64): resources per kernel
# ---------------------------------------------------------------------------------------------

# .nv.info attribute ids (checked against nvdisasm's own names for them, "//----- nvinfo : EIATTR_*").
_ATTR_NAMES = {
    0x05: "max_threads", 0x10: "reqntid", 0x11: "frame_bytes", 0x12: "min_stack_bytes", 0x1B: "maxreg_count",
    0x23: "max_stack_bytes", 0x2F: "regs", 0x38: "num_mbarriers", 0x3D: "cta_per_cluster",
    0x4C: "num_barriers", 0x51: "tcgen05_1cta_used", 0x52: "tcgen05_2cta_used",
}
# Attributes of the global .nv.info, each (symbol index, value) for one function.
_PER_FUNCTION_ATTRS = {"regs", "frame_bytes", "min_stack_bytes", "max_stack_bytes"}


@dataclasses.dataclass
class _Section:
    name: str
    kind: int
    offset: int
    size: int
    link: int
    entsize: int


def _elf_sections(data: bytes) -> list[_Section]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file (cubin)")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + n * entsize) for n in range(count)]
    names_at = headers[names_index][4]

    def name_at(offset: int) -> str:
        end = data.index(b"\0", offset)
        return data[offset:end].decode("utf-8", "replace")

    return [_Section(name_at(names_at + h[0]), h[1], h[4], h[5], h[6], h[9]) for h in headers]


def _nv_info(body: bytes):
    """(attribute id, payload) of each .nv.info record: int for the 1/2-byte forms, bytes else."""
    pos = 0
    while pos + 4 <= len(body):
        form, attr = body[pos], body[pos + 1]
        if form == 0x04:  # size-prefixed payload
            (size,) = struct.unpack_from("<H", body, pos + 2)
            yield attr, bytes(body[pos + 4:pos + 4 + size])
            pos += 4 + size
            continue
        if form == 0x01:  # flag, no value
            yield attr, 1
        elif form == 0x02:  # one byte
            yield attr, body[pos + 2]
        else:  # 0x03: one half-word
            yield attr, struct.unpack_from("<H", body, pos + 2)[0]
        pos += 4


def _words(payload) -> list[int]:
    if isinstance(payload, int):
        return [payload]
    return list(struct.unpack(f"<{len(payload) // 4}I", payload[: len(payload) // 4 * 4]))


def cubin_resources(data: bytes) -> dict[str, dict]:
    """Kernel name -> {regs, frame_bytes, static_smem, reserved_smem, reqntid, ..., ptxas}."""
    sections = _elf_sections(data)
    by_name = {s.name: s for s in sections}
    symtab = by_name.get(".symtab")
    symbols: list[str] = []
    if symtab is not None:
        strings = sections[symtab.link]
        for at in range(symtab.offset, symtab.offset + symtab.size, symtab.entsize or 24):
            (name_offset,) = struct.unpack_from("<I", data, at)
            start = strings.offset + name_offset
            symbols.append(data[start:data.index(b"\0", start)].decode("utf-8", "replace"))
    ptxas = None
    note = by_name.get(".note.nv.tkinfo")
    if note is not None:
        found = re.search(rb"Cuda compilation tools, release [^\0]+", data[note.offset:note.offset + note.size])
        ptxas = found.group(0).decode() if found else None
    reserved = by_name.get(".nv.shared.reserved.0")
    kernels = {}
    for s in sections:
        if s.name.startswith(".text."):
            name = s.name[len(".text."):]
            smem = by_name.get(".nv.shared." + name)
            kernels[name] = {"static_smem": smem.size if smem else 0,
                             "reserved_smem": reserved.size if reserved else 0, "ptxas": ptxas}
    for s in sections:
        body = data[s.offset:s.offset + s.size]
        if s.name == ".nv.info":
            for attr, payload in _nv_info(body):
                key = _ATTR_NAMES.get(attr)
                words = _words(payload)
                if key in _PER_FUNCTION_ATTRS and len(words) == 2 and words[0] < len(symbols):
                    if symbols[words[0]] in kernels:
                        kernels[symbols[words[0]]][key] = words[1]
        elif s.name.startswith(".nv.info.") and s.name[len(".nv.info."):] in kernels:
            res = kernels[s.name[len(".nv.info."):]]
            for attr, payload in _nv_info(body):
                key = _ATTR_NAMES.get(attr)
                if key is None or key in _PER_FUNCTION_ATTRS:
                    continue
                words = _words(payload)
                res[key] = words if key in ("reqntid", "cta_per_cluster") else words[0]
    for res in kernels.values():
        used = [n for n, key in ((1, "tcgen05_1cta_used"), (2, "tcgen05_2cta_used")) if res.pop(key, None)]
        res["tcgen05_cta_used"] = used[0] if len(used) == 1 else (used or None)
    return kernels


# ---------------------------------------------------------------------------------------------
# nvdisasm
# ---------------------------------------------------------------------------------------------

def find_nvdisasm() -> str | None:
    """nvdisasm: $NVDISASM, the nvidia-cuda-nvdisasm wheel (nvidia/cu13/bin), else PATH."""
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    try:
        import nvidia.cu13  # the nvidia-cuda-nvdisasm wheel

        path = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "nvdisasm"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def disassemble(cubin: Path | str) -> str:
    """``nvdisasm -c`` of a cubin (code sections only, one banner per kernel)."""
    tool = find_nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found (pip install nvidia-cuda-nvdisasm, or set $NVDISASM)")
    return subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


# ---------------------------------------------------------------------------------------------
# one kernel's statistics from its files
# ---------------------------------------------------------------------------------------------

def _one_cta_group(groups: list[int]):
    return groups[0] if len(groups) == 1 else (groups or None)


def stats_from_files(sass: str | Path | None = None, cubin: bytes | Path | None = None,
                     ptx: str | Path | None = None, kernel: str | None = None) -> dict:
    """The statistics dict of the module docstring for one kernel. ``sass`` is listing text or a
    file (disassembled from ``cubin`` when None); ``cubin`` bytes or a file; ``ptx`` text or a file.
    ``kernel``: which kernel of a multi-kernel listing (default: the one with most instructions)."""
    if isinstance(cubin, (str, Path)):
        cubin = Path(cubin).read_bytes()
    if isinstance(sass, Path) or (isinstance(sass, str) and "\n" not in sass and Path(sass).is_file()):
        sass = Path(sass).read_text(errors="replace")
    if isinstance(ptx, Path) or (isinstance(ptx, str) and "\n" not in ptx and Path(ptx).is_file()):
        ptx = Path(ptx).read_text(errors="replace")
    if sass is None:
        if cubin is None:
            raise ValueError("stats_from_files needs SASS text or a cubin")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = disassemble(f.name)
    listing = sass_kernels(sass)
    if not listing:
        raise ValueError("no SASS instructions found")
    name = kernel if kernel is not None else max(listing, key=lambda k: len(listing[k]))
    stats: dict = {"kernel": name, "kernels": sorted(listing)}
    target = re.search(r"^\s*\.target\s+(\S+)", sass, re.M)
    stats["target"] = target.group(1) if target else None
    stats.update(sass_counts(listing[name]))
    resources = cubin_resources(cubin) if cubin is not None else {}
    res = resources.get(name) or (next(iter(resources.values())) if len(resources) == 1 else {})
    for key in ("regs", "frame_bytes", "static_smem", "reserved_smem", "reqntid", "max_threads",
                "num_barriers", "num_mbarriers", "tcgen05_cta_used", "ptxas", "maxreg_count"):
        stats[key] = res.get(key)
    if stats["frame_bytes"] is None and res:
        stats["frame_bytes"] = 0
    facts = ptx_facts(ptx) if ptx is not None else None
    stats["ptx"] = facts
    if facts is not None:
        stats["target"] = stats["target"] or facts["target"]
        allocs = facts["tmem_alloc"]
        stats["tmem_columns"] = (sum(a["columns"] for a in allocs) if allocs and all(
            isinstance(a["columns"], int) for a in allocs) else [a["columns"] for a in allocs] or None)
        stats["cta_group"] = _one_cta_group(facts["cta_groups"])
        stats["two_cta_ptx"] = facts["two_cta"]
        stats["setmaxnreg"] = facts["setmaxnreg"]
    else:
        stats.update(tmem_columns=None, cta_group=None, two_cta_ptx=None, setmaxnreg=None)
    stats["mma"] = mma_count(stats)
    return stats


_ARTIFACT = re.compile(r"^(?P<stem>.+?)(?:\.(?P<arch>sm_\w+))?\.(?P<kind>sass|cubin|ptx)$")


def dump_artifacts(folder: Path | str) -> dict[str, dict[str, Path]]:
    """A CUTE_DSL_DUMP_DIR's files grouped per compiled module: stem -> {sass, cubin, ptx} paths."""
    groups: dict[str, dict[str, Path]] = {}
    for f in sorted(Path(folder).iterdir()):
        m = _ARTIFACT.match(f.name)
        if m and f.is_file():
            groups.setdefault(m.group("stem"), {})[m.group("kind")] = f
    return groups


def stats_from_dump_dir(folder: Path | str) -> dict[str, dict]:
    """Statistics of each module dumped in ``folder`` (KEEP=cubin at least, ptx/sass if kept)."""
    out = {}
    for stem, files in dump_artifacts(folder).items():
        if "sass" in files or "cubin" in files:
            out[stem] = stats_from_files(sass=files.get("sass"), cubin=files.get("cubin"), ptx=files.get("ptx"))
    return out


# ---------------------------------------------------------------------------------------------
# the DSL verifier's diagnostics (CUTE_DSL_COMPILER_OPT=warnings), parsed from its stderr report
# ---------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DIAG_HEADLINE = re.compile(
    r"^(?P<severity>warning|error|remark)\[(?:(?P<ns>[\w-]+):)?(?P<code>[^\]]+)\]:\s*(?P<msg>.*)$")
_DIAG_LOCATION = re.compile(r"^\s*-->\s*(?P<loc>\S+?)(?::(?P<line>\d+):(?P<col>\d+))?\s*$")
_DIAG_FUNCTION = re.compile(r"^\s*in function `(?P<fn>[^`(]+)")
_DIAG_LABEL = re.compile(r"^\s*(?P<label>warning|error|remark|suggestion|note):\s*(?P<text>.*)$")


def parse_verifier_output(text: str) -> list[dict]:
    """The compiler diagnostics the DSL printed (to stderr) with CUTE_DSL_COMPILER_OPT=warnings:
    [{severity, code, namespace, message, file, line, function, reason, suggestion}], in order.
    ``code`` is e.g. 'C3' (mbarrier count) or 'W0014' (TMEM load without wait); ``file`` is the
    path of the Python source the DSL attributes it to (its basename is what baselines compare)."""
    diags: list[dict] = []
    label = None
    for raw in _ANSI.sub("", text).splitlines():
        head = _DIAG_HEADLINE.match(raw)
        if head:
            diags.append({"severity": head["severity"], "code": head["code"], "namespace": head["ns"] or "",
                          "message": head["msg"].strip(), "file": None, "line": None, "function": None,
                          "reason": "", "suggestion": ""})
            label = None
            continue
        if not diags:
            continue
        d = diags[-1]
        loc = _DIAG_LOCATION.match(raw)
        if loc and d["file"] is None:
            d["file"], d["line"] = loc["loc"], int(loc["line"]) if loc["line"] else None
            continue
        fn = _DIAG_FUNCTION.match(raw)
        if fn and d["function"] is None:
            d["function"] = fn["fn"].strip()
            continue
        lab = _DIAG_LABEL.match(raw)
        if lab:
            label = {"warning": "reason", "error": "reason", "remark": "reason"}.get(lab["label"], lab["label"])
            if label in d:
                d[label] = (d[label] + " " + lab["text"].strip()).strip()
            continue
        if label in ("reason", "suggestion") and raw.startswith("   ") and raw.strip() and "|" not in raw[:8]:
            d[label] = (d[label] + " " + raw.strip()).strip()
        elif not raw.strip():
            label = None
    return diags


def diagnostic_key(diag: dict) -> str:
    """What a reviewed baseline compares: code, message, source file name and function, not line
    numbers (they move with every edit above them)."""
    where = Path(diag["file"]).name if diag.get("file") else "?"
    return f"{diag['code']} | {diag['message']} | {where} | {diag.get('function') or '?'}"


# ---------------------------------------------------------------------------------------------
# compiling a configuration in a separate interpreter
# ---------------------------------------------------------------------------------------------

# argv: flavour, json list of sys.path entries, json {flavour: driver version}, then either a
# pickled config (base64 file): compile it, print one JSON line; or "--serve": a compile worker
# (_CompileWorker) that takes one request per stdin line and answers each on its first stdout.
_CHILD = r"""
import base64, ctypes, importlib, inspect, json, os, pickle, sys, traceback, types
flavour, paths, versions = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path[:0] = paths
# The kernels (flash_attn4.fa4_kernels) compile without torch, whose import is half of this
# interpreter's start-up: the package's __init__ (the torch layer) is replaced by an empty package
# of the same folder, and torch is made unimportable (tvm_ffi, imported by the DSL, tries it).
_pkg = types.ModuleType("flash_attn4")
_pkg.__path__ = [os.path.join(paths[0], "flash_attn4")]
sys.modules["flash_attn4"] = _pkg
sys.modules["torch"] = None
if flavour in versions:
    # The DSL picks its toolkit flavour at import from cuDriverGetVersion: answer for it.
    real_cdll = ctypes.CDLL
    class _Driver:
        def cuDriverGetVersion(self, out):
            out._obj.value = versions[flavour]
            return 0
    def _cdll(name, *args, **kwargs):
        return _Driver() if str(name).startswith("libcuda.so") else real_cdll(name, *args, **kwargs)
    ctypes.CDLL = _cdll
    try:
        import cutlass
    finally:
        ctypes.CDLL = real_cdll
else:
    import cutlass
ir_module = sys.modules["cutlass._mlir._mlir_libs._cutlass_ir"].__file__.rsplit("/", 1)[-1]

def compile_one(cfg_file):
    with open(cfg_file) as f:
        cfg = pickle.loads(base64.b64decode(f.read()))
    compile_mod = importlib.import_module(type(cfg).__module__.rsplit(".", 1)[0] + ".compile")
    compiler = getattr(compile_mod, "_COMPILERS", {}).get(type(cfg))
    if compiler is None:
        kind = {"ForwardConfig": "forward", "BackwardConfig": "backward", "PreprocessConfig": "backward_preprocess",
                "PostprocessConfig": "backward_postprocess"}.get(type(cfg).__name__)
        compiler = getattr(compile_mod, "compile_" + str(kind))
    kwargs = {"jit_engine": False} if "jit_engine" in inspect.signature(compiler).parameters else {}
    compiler(cfg, **kwargs)
    print(json.dumps({"dsl_ir_module": ir_module}))

def take_environment(env):
    # The DSL reads CUTE_DSL_* (dumps, verifier options, target) into its DSL objects through
    # memoised getters: a new request's environment needs both forgotten. Compiles already kept
    # in its JIT cache would be served without their dump files: forgotten too.
    from cutlass.base_dsl import env_manager
    from cutlass.base_dsl.dsl import DSLSingletonMeta
    os.environ.clear()
    os.environ.update(env)
    for getter in vars(env_manager).values():
        if callable(getattr(getter, "cache_clear", None)):
            getter.cache_clear()
    for dsl in list(DSLSingletonMeta._instances.values()):
        dsl.envar = dsl._env_class(dsl.name)
        dsl.jit_cache.clear()

if sys.argv[4] != "--serve":
    compile_one(sys.argv[4])
    sys.exit(0)
answers = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    request = json.loads(line)
    take_environment(request["env"])
    os.chdir(request["cwd"])
    saved = os.dup(1), os.dup(2)
    logs = [os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr")]
    os.dup2(logs[0], 1)
    os.dup2(logs[1], 2)
    rc = 0
    try:
        compile_one(request["cfg_file"])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, log in zip((1, 2), logs):
            os.dup2(saved[fd - 1], fd)
            os.close(saved[fd - 1])
            os.close(log)
    answers.write(json.dumps({"rc": rc}) + "\n")
    answers.flush()
"""

# Compiles run in worker interpreters that stay up between compiles: a new interpreter per compile
# spent ~1.3 s of each (importing the DSL and the kernels) on top of a 2-25 s compile. "0" here: a
# fresh interpreter per compile, as before (to rule the workers out when something looks odd).
WORKERS_ENV = "FA4_SASS_COMPILE_WORKERS"
# A worker is replaced after this many compiles, so that what the DSL keeps from one compile to the
# next (memory) stays bounded.
WORKER_COMPILES = 32
# A request sets the whole environment of its compile; a worker serves only requests whose
# environment equals the one it started with (what the DSL read at import), except for these: the
# DSL reads its own again per request, and pytest names the running test in its variable.
_PER_COMPILE_ENV = ("CUTE_DSL_ARCH", "CUTE_DSL_DUMP_DIR", "CUTE_DSL_KEEP", "CUTE_DSL_COMPILER_OPT",
                    "PYTEST_CURRENT_TEST")
# Idle workers kept, over all flavours and environments (the least recently used go first).
IDLE_WORKERS = 4


def _child_argv(flavour: str) -> list[str]:
    return [sys.executable, "-c", _CHILD, flavour, json.dumps(_import_paths()), json.dumps(DRIVER_VERSION_FOR_FLAVOUR)]


class _CompileWorker:
    """One worker interpreter (_CHILD --serve): a request per compile, answered with its exit code;
    the compile's stdout and stderr go to files of the request."""

    def __init__(self, flavour: str, env: dict):
        self.log = Path(tempfile.mkdtemp(dir=_session_dir(), prefix="worker_"))
        self.compiles = 0
        with open(self.log / "worker.stderr", "w") as stderr:
            self.proc = subprocess.Popen(_child_argv(flavour) + ["--serve"], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True)

    def compile(self, cfg_file: str, env: dict, timeout: float) -> tuple[int, str, str]:
        out, err = self.log / f"{self.compiles}.stdout", self.log / f"{self.compiles}.stderr"
        self.compiles += 1
        request = dict(cfg_file=cfg_file, env=env, cwd=os.getcwd(), stdout=str(out), stderr=str(err))
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: the read below says so
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired(["compile worker", cfg_file], timeout)
        answer = self.proc.stdout.readline()
        texts = [f.read_text() if f.exists() else "" for f in (out, err)]
        for f in (out, err):
            f.unlink(missing_ok=True)
        if not answer:  # the worker died (a crash in the compiler): report it as the child's exit
            rc = self.proc.wait()
            texts[1] += f"\ncompile worker exited with {rc}:\n" + (self.log / "worker.stderr").read_text()[-4000:]
            return rc or 1, texts[0], texts[1]
        return json.loads(answer)["rc"], texts[0], texts[1]

    def alive(self) -> bool:
        return self.proc.poll() is None and self.compiles < WORKER_COMPILES

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


_IDLE_WORKERS: dict[tuple, list[_CompileWorker]] = {}
_WORKERS_LOCK = threading.Lock()
_WORKERS_PID: int | None = None  # the process whose workers these are (not a forked child's)


def _run_compile(cfg_file: str, flavour: str, env: dict, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of compiling the pickled config in ``cfg_file`` with ``env``: in an
    idle worker of this flavour and fixed environment, a new one if none is idle (callers may
    compile from several threads), or a fresh interpreter where WORKERS_ENV is "0"."""
    global _WORKERS_PID
    if os.environ.get(WORKERS_ENV, "1") == "0":
        proc = subprocess.run(_child_argv(flavour) + [cfg_file], env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr
    if _WORKERS_PID != os.getpid():  # first use, or a forked child: its parent's workers are not its own
        _IDLE_WORKERS.clear()
        _WORKERS_PID = os.getpid()
        atexit.register(_close_workers, os.getpid())
    fixed = {k: v for k, v in env.items() if k not in _PER_COMPILE_ENV}
    key = (flavour, tuple(sorted(fixed.items())))
    with _WORKERS_LOCK:
        dead = _retire_workers()  # idle ones that died since their last compile (killed, out of memory)
        idle = _IDLE_WORKERS.get(key)
        worker = idle.pop() if idle else None
    for w in dead:
        w.close()
    worker = worker or _CompileWorker(flavour, fixed)
    result = worker.compile(cfg_file, env, timeout)
    with _WORKERS_LOCK:
        _IDLE_WORKERS[key] = _IDLE_WORKERS.pop(key, []) + [worker]  # the most recently used key last
        retired = _retire_workers()
    for w in retired:
        w.close()
    return result


def _retire_workers() -> list[_CompileWorker]:
    """Takes out of _IDLE_WORKERS (its lock held) the workers that are done, and the least
    recently used beyond IDLE_WORKERS; the caller closes them."""
    idle = [(key, w, w.alive()) for key, workers in _IDLE_WORKERS.items() for w in workers]
    live = [(key, w) for key, w, alive in idle if alive]
    retired = [(key, w) for key, w, alive in idle if not alive] + live[:max(0, len(live) - IDLE_WORKERS)]
    for key, w in retired:
        _IDLE_WORKERS[key].remove(w)
    for key in [key for key, workers in _IDLE_WORKERS.items() if not workers]:
        del _IDLE_WORKERS[key]
    return [w for _, w in retired]


def _close_workers(pid: int):
    if pid == os.getpid():
        for workers in _IDLE_WORKERS.values():
            for worker in workers:
                worker.close()
        _IDLE_WORKERS.clear()


@dataclasses.dataclass
class CompileResult:
    """What one compile left behind: the dump folder's files per module and the child's output."""

    returncode: int
    stdout: str
    stderr: str
    dump_dir: Path
    flavour: str
    dsl_ir_module: str | None

    @property
    def artifacts(self) -> dict[str, dict[str, Path]]:
        return dump_artifacts(self.dump_dir)

    def check(self, what: str = "compile") -> "CompileResult":
        if self.returncode != 0:
            raise RuntimeError(f"{what} failed (rc {self.returncode}, flavour {self.flavour}):\n{self.stderr[-4000:]}")
        return self


def _import_paths() -> list[str]:
    return [str(ROOT / "torch-ext"), str(ROOT)]


def compile_config(cfg, flavour: str = "auto", out_dir: Path | str | None = None, *, keep: str = "ptx,cubin",
                   compiler_opt: str | None = None, timeout: float = 900,
                   extra_env: dict | None = None) -> CompileResult:
    """Compile ``cfg`` in a worker interpreter with CUTE_DSL_KEEP=``keep`` into ``out_dir`` (a new
    temp folder when None; the caller owns it). ``compiler_opt``: CUTE_DSL_COMPILER_OPT (e.g.
    'warnings', 'remarks{ptx}'). The target is ``cfg.arch`` (CUTE_DSL_ARCH is set from it too)."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="fa4_sass_"))
    out.mkdir(parents=True, exist_ok=True)  # the DSL's SASS dump fails if the folder is missing
    arch = getattr(cfg.arch, "value", str(cfg.arch))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_KEEP")}
    env.update(CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(out), PYTHONWARNINGS="ignore")
    if keep:
        env["CUTE_DSL_KEEP"] = keep
    env.pop("CUTE_DSL_COMPILER_OPT", None)
    if compiler_opt:
        env["CUTE_DSL_COMPILER_OPT"] = compiler_opt
    env.update(extra_env or {})
    with tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False) as f:
        f.write(base64.b64encode(pickle.dumps(cfg)).decode())
        cfg_file = f.name
    try:
        returncode, stdout, stderr = _run_compile(cfg_file, flavour, env, timeout)
    finally:
        os.unlink(cfg_file)
    ir_module = None
    for line in reversed(stdout.splitlines()):
        try:
            ir_module = json.loads(line).get("dsl_ir_module")
            break
        except (ValueError, AttributeError):
            continue
    return CompileResult(returncode, stdout, stderr, out, flavour, ir_module)


def _main_module(result: CompileResult) -> dict[str, Path]:
    """The compiled attention kernel's files (the one module with a cubin; the largest if several)."""
    with_cubin = {stem: files for stem, files in result.artifacts.items() if "cubin" in files}
    if not with_cubin:
        raise RuntimeError(f"no cubin in {result.dump_dir}:\n{result.stderr[-2000:]}")
    return max(with_cubin.values(), key=lambda files: files["cubin"].stat().st_size)


def _config_cache_key(cfg) -> tuple:
    return cfg.key() if hasattr(cfg, "key") else (type(cfg).__name__, repr(cfg))


_SESSION_DIR: Path | None = None
# A folder that several processes (pytest-xdist workers) share, named by the environment: each
# compile result is made once in it, by whichever process asks first, while the others wait for it
# (a lock file per result) and then read it. Without it, compiles are cached per process only.
SHARED_CACHE_ENV = "FA4_SASS_SHARED_CACHE"


def _session_dir() -> Path:
    """One temp folder per process for cached compiles' files, removed at exit."""
    global _SESSION_DIR
    if _SESSION_DIR is None:
        _SESSION_DIR = Path(tempfile.mkdtemp(prefix="fa4_sass_session_"))
        atexit.register(shutil.rmtree, _SESSION_DIR, True)
    return _SESSION_DIR


def _made_once(tag: str, make):
    """``make(folder)``'s JSON-able result for ``tag``: with a shared cache (SHARED_CACHE_ENV), made in
    its own folder there by the first process to ask, and read back by every later one; else made in
    a new folder of this process's session folder. A failed ``make`` leaves no result (the next
    process to ask makes it again)."""
    root = os.environ.get(SHARED_CACHE_ENV)
    if not root:
        return make(Path(tempfile.mkdtemp(dir=_session_dir())))
    import fcntl
    import hashlib

    digest = hashlib.sha256(tag.encode()).hexdigest()[:24]
    result = Path(root) / digest / "result.json"
    with open(Path(root) / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result.exists():
            return json.loads(result.read_text())
        result.parent.mkdir(exist_ok=True)
        value = make(Path(tempfile.mkdtemp(dir=result.parent)))  # a new folder per try
        result.write_text(json.dumps(value))
        return value


@functools.lru_cache(maxsize=None)
def _cached_artifacts(key: tuple, flavour: str, cfg_blob: bytes) -> tuple[str, str, str | None, str | None]:
    def make(out: Path) -> list:
        result = compile_config(pickle.loads(cfg_blob), flavour, out, keep="ptx,cubin").check(f"compile of {key}")
        files = _main_module(result)
        sass = out / (files["cubin"].name.rsplit(".", 2)[0] + ".nvdisasm.sass")
        sass.write_text(disassemble(files["cubin"]))
        ptx = files.get("ptx")
        return [str(files["cubin"]), str(sass), str(ptx) if ptx else None, result.dsl_ir_module]

    return tuple(_made_once(repr(("artifacts", key, flavour)), make))


def kernel_artifacts(cfg, flavour: str = "auto") -> dict:
    """{cubin, sass (nvdisasm -c), ptx: Path, dsl_ir_module: str} of ``cfg``'s kernel compiled
    with ``flavour``: files in a temp folder, compiled once per (cfg.key(), flavour) for the
    process, or for every process sharing SHARED_CACHE_ENV's folder (kernel_stats reads the same
    files). Read them; do not modify them."""
    cubin, sass, ptx, module = _cached_artifacts(_config_cache_key(cfg), flavour, pickle.dumps(cfg))
    return {"cubin": Path(cubin), "sass": Path(sass), "ptx": Path(ptx) if ptx else None, "dsl_ir_module": module}


@functools.lru_cache(maxsize=None)
def _cached_stats(key: tuple, flavour: str, cfg_blob: bytes) -> str:
    files = kernel_artifacts(pickle.loads(cfg_blob), flavour)
    stats = stats_from_files(sass=files["sass"], cubin=files["cubin"], ptx=files["ptx"])
    stats.update(flavour=flavour, dsl_ir_module=files["dsl_ir_module"])
    return json.dumps(stats)


def kernel_stats(cfg, flavour: str = "auto") -> dict:
    """The statistics dict (module docstring) of ``cfg``'s kernel compiled with ``flavour``'s ptxas.
    Cached per (cfg.key(), flavour) for the process (and its compile shared as kernel_artifacts
    says): tests share one compile. A fresh copy each call."""
    return json.loads(_cached_stats(_config_cache_key(cfg), flavour, pickle.dumps(cfg)))


@functools.lru_cache(maxsize=None)
def _cached_diagnostics(key: tuple, flavour: str, options: str, cfg_blob: bytes) -> tuple:
    def make(out: Path) -> list:
        result = compile_config(pickle.loads(cfg_blob), flavour, out, keep="", compiler_opt=options)
        shutil.rmtree(out, ignore_errors=True)  # nothing kept: the diagnostics are in its stderr
        return [json.dumps(d) for d in parse_verifier_output(result.check(f"compile of {key}").stderr)]

    return tuple(_made_once(repr(("diagnostics", key, flavour, options)), make))


def verifier_diagnostics(cfg, flavour: str = "auto", options: str = "warnings") -> list[dict]:
    """The DSL verifier's diagnostics for ``cfg`` with CUTE_DSL_COMPILER_OPT=``options``, as
    ``parse_verifier_output`` returns them. 'warnings' (4.8.1): mbarrier arrive/init count
    mismatches (C3), TMEM loads reaching a release without tcgen05.wait (W0014), ...;
    'remarks{ptx}': ptxas's spill / local-memory remarks. Run them separately: with
    'warnings,remarks{ptx}' 4.8.1 printed the remarks only. Cached per (cfg.key(), flavour,
    options)."""
    blob = pickle.dumps(cfg)
    return [json.loads(d) for d in _cached_diagnostics(_config_cache_key(cfg), flavour, options, blob)]


TMEM_COLUMNS = 512  # tensor memory per SM (sm_100): 128 lanes x 512 32-bit columns


def static_problems(stats: dict, *, allow_spills: bool = False) -> list[str]:
    """What the statistics dict says is wrong or inconsistent, as sentences (empty: nothing):
    local-memory traffic (spills, unless ``allow_spills``); USETMAXREG in SASS not the PTX's
    setmaxnreg list; .reqntid of the cubin not the PTX's; and, where the PTX uses tcgen05, not
    exactly one alloc, relinquish and dealloc of one cta_group, a TMEM allocation that is not a
    power of two in [32, 512] columns, dealloc columns != alloc columns, or 2-CTA disagreeing
    between SASS (.2CTA), PTX (cta_group::2) and the cubin (TCGEN05_2CTA_USED)."""
    problems = []
    if not allow_spills and (stats["ldl"] or stats["stl"] or stats.get("frame_bytes")):
        frame = stats.get("frame_bytes")
        problems.append(f"local memory: {stats['ldl']} LDL / {stats['stl']} STL, stack frame "
                        f"{'?' if frame is None else frame} B")
    ptx = stats.get("ptx")
    if ptx is None:
        return problems
    if sorted(stats["usetmaxreg"]) != sorted(ptx["setmaxnreg"]):
        problems.append(f"USETMAXREG {stats['usetmaxreg']} != PTX setmaxnreg {ptx['setmaxnreg']}")
    if stats.get("reqntid") and ptx["reqntid"] and list(stats["reqntid"]) != list(ptx["reqntid"]):
        problems.append(f".reqntid: cubin {stats['reqntid']} != PTX {ptx['reqntid']}")
    allocs, deallocs, relinquish = ptx["tmem_alloc"], ptx["tmem_dealloc"], ptx["tmem_relinquish"]
    if allocs or deallocs or relinquish:
        if (len(allocs), len(relinquish), len(deallocs)) != (1, 1, 1):
            problems.append(f"TMEM: {len(allocs)} alloc, {len(relinquish)} relinquish, {len(deallocs)} dealloc "
                            "(one each expected)")
        if len(ptx["cta_groups"]) != 1:
            problems.append(f"tcgen05 instructions of several cta_groups: {ptx['cta_groups']}")
        for a in allocs:
            cols = a["columns"]
            if not isinstance(cols, int) or cols < 32 or cols > TMEM_COLUMNS or cols & (cols - 1):
                problems.append(f"TMEM alloc of {cols} columns (a power of two in [32, {TMEM_COLUMNS}] expected)")
        if [a["columns"] for a in allocs] != [d["columns"] for d in deallocs]:
            problems.append(f"TMEM dealloc columns {[d['columns'] for d in deallocs]} != alloc "
                            f"{[a['columns'] for a in allocs]}")
        cubin_2cta = stats.get("tcgen05_cta_used")
        views = {"SASS .2CTA": stats["two_cta"], "PTX cta_group::2": ptx["two_cta"]}
        if cubin_2cta in (1, 2):
            views["cubin TCGEN05_2CTA_USED"] = cubin_2cta == 2
        if len(set(views.values())) > 1:
            problems.append(f"2-CTA disagrees: {views}")
    return problems


def setmaxreg_summary(values: list[str] | None) -> str:
    """'+240 -24x3': each value once, with its multiplicity."""
    counts = Counter(values or [])
    return " ".join(v if n == 1 else f"{v}x{n}" for v, n in sorted(counts.items())) or "-"
