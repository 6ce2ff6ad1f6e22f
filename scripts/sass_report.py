#!/usr/bin/env python3
"""What a kernel configuration compiles to, without a GPU: MMAs, exponentials, spills, registers,
shared and tensor memory, register budgets, 2-CTA; and what the DSL's verifier says about it.

    python scripts/sass_report.py bwd d=128 d=128,causal=true d=128,tile_m=80
    python scripts/sass_report.py fwd d=64,causal=true,exp2_emulated_eighths=2 --arch sm_90a
    python scripts/sass_report.py bwd d=64 d=128 --dump before/   # normalised SASS, one file each
    python scripts/sass_report.py bwd_post d=128 d=64,varlen=true     # the backward's dQ postprocessing
    python scripts/sass_report.py fwd d=128 d=128,causal=true --arch sm_100a --flavour both
    python scripts/sass_report.py fwd d=128 --arch sm_100a --direct tile_m=128   # bypass dispatch
    python scripts/sass_report.py fwd d=128 --arch sm_100a --verify      # + CUTE_DSL_COMPILER_OPT=warnings
    python scripts/sass_report.py fwd d=192,dv=128 --json                # the full statistics dicts
    python scripts/sass_report.py dumps /tmp/anchors/cu13/main           # existing KEEP dumps (upstream's)
    python scripts/sass_report.py set --arch sm_100a --flavour both --verify   # the CI kernel set of an arch
    python scripts/sass_report.py fwd d=128 --arch sm_100a --flavour both --anchors /tmp/anchors   # vs upstream

A spec is ``d=<head_dim>[,dv=<head_dim_v>]`` plus Forward/BackwardConfig fields (``causal=true``,
``tile_m=80``, ...), ``dtype=float16`` and, forward, ``qhead_per_kvhead=<n>`` (GQA ratio, which
dispatch turns into packing); ``bwd_pre`` reads only dv, ``bwd_post`` compiles the postprocessing
kernel of the backward the spec names. The base configuration is the one dispatch picks for those head dims
and mask flags, so a spec names only what differs. Where dispatch has no rule for the arch yet
(sm_100a before its tile table exists), or with ``--direct``, the config is built directly:
``ForwardConfig(arch, dtype, head_dim, head_dim_v, <flags>, <fields>)`` with the class defaults
for every field the spec does not name (say so with the fields, e.g. tile_m=128,tile_n=128).

Each spec compiles in its own process (the DSL reads its dump settings and picks its toolkit at
import), with CUTE_DSL_KEEP=ptx,cubin, and the cubin is disassembled with nvdisasm -c
(pip install nvidia-cuda-nvdisasm). ``--flavour cu12|cu13|auto|both`` picks the ptxas the DSL
embeds: cu12 = CUDA 12.9 (plain ``pip install nvidia-cutlass-dsl`` on a 12.x driver), cu13 = 13.4
(the ``[cu13]`` extra, CUDA-13 drivers, our H200 bundle); auto = what the DSL picks here (without a
driver: the newest installed). Both flavours must be installed for cu12/cu13 to differ.

Per kernel it prints: SASS instructions; tensor-core MMAs (UTC*MMA on sm_100, HGMMA on sm_90);
MUFU.EX2; packed FP32 FFMA2/FMUL2/FADD2; LDTM/STTM; LDL/STL (local memory: spills) and the stack
frame; registers; static shared memory (dynamic shared memory is a launch value); TMEM columns and
cta_group (the PTX's tcgen05.alloc); 2-CTA (.2CTA opcodes in SASS, cta_group::2 in PTX);
USETMAXREG (SASS) next to setmaxnreg (PTX); .reqntid; and, on sm_90, WARPGROUP.ARRIVE and
BRA.U.ANY (uniformity loops); then sass_stats_lib.static_problems' verdict (spills, USETMAXREG vs
setmaxnreg, one TMEM alloc/relinquish/dealloc of one cta_group within 512 columns, 2-CTA agreeing
between SASS, PTX and cubin). The keys are documented in scripts/sass_stats_lib.py.

``set`` reports every configuration ``python -m fa4_kernels.compile --arch ARCH`` compiles
(fa4_kernels.compile.kernel_set and backward_kernel_set); an arch whose set is empty is an error
(exit 1), as is any configuration that fails to compile.

``--dump DIR`` writes each kernel's SASS with addresses, labels and constant-bank offsets removed,
so that two dumps diff cleanly: a refactor that should not change the code must leave them equal.
File names: ``<kind>_<spec>.sass`` (``_<flavour>`` appended when several flavours run).

``--anchors DIR`` (compile_anchor.py's ``--out``) adds upstream's numbers for the same problem
class (fwd_d128, fwd_d128_causal, fwd_d192_dv128, ..._varlen, ..._local256_0, ..._gqa32_8 for
pack_gqa=4) from the anchors.json of the flavour our compile used: instruction count ratio, and
instructions per MMA where the tile shapes differ. The anchors are made in their own venv:
``/tmp/sm100venv/bin/python ../shared/sm100/compile_anchor.py --out /tmp/anchors`` (see there).

``--verify`` compiles once more with CUTE_DSL_COMPILER_OPT=warnings (``--verify-options`` to
change it, e.g. 'remarks{ptx}' for ptxas spill remarks; 4.8.1 shows only the remarks when both are
given in one string) and lists the verifier's diagnostics: C3 (mbarrier arrive count vs init
count), W0014 (TMEM load reaching a release without tcgen05.wait), ... The exit status is 1 if any
spec failed to compile, and with ``--strict`` also if any kernel's static checks found a problem.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import sass_stats_lib as lib  # noqa: E402  (standard library only at import)

MASK_FLAGS = ("causal", "local", "has_softcap", "varlen", "has_seqused_k")


def find_nvdisasm() -> str | None:
    """nvdisasm from $NVDISASM, the nvidia-cuda-nvdisasm wheel, else PATH; None if none has it."""
    return lib.find_nvdisasm()


def _ensure_import_path() -> None:
    for path in (str(ROOT / "torch-ext"), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)


def build_config(kind: str, arch: str, spec: str, direct: bool = False):
    """The configuration a spec names (module docstring): dispatch's for its problem class plus
    the spec's fields, or, with ``direct`` or where dispatch has no rule for ``arch`` yet, the
    config class built from the spec alone. ``bwd_pre``: the backward's preprocessing kernel for
    dv; ``bwd_post``: the postprocessing kernel of the backward the spec names. Returns (config,
    how) with how 'dispatch' or 'direct'."""
    _ensure_import_path()
    from flash_attn4.fa4_kernels import config as config_mod
    from flash_attn4.fa4_kernels.arch import Arch

    dtype = "bfloat16"
    found = re.search(r"(?:^|,)dtype=(\w+)", spec)
    if found:
        dtype = found.group(1)
        spec = re.sub(r"(?:^|,)dtype=\w+", "", spec)
    fields = config_mod.parse_overrides(spec)
    d = fields.pop("d")
    dv = fields.pop("dv", d)
    arch_value = Arch.parse(arch) if hasattr(Arch, "parse") else Arch(arch)
    if kind == "bwd_pre":
        return _with_fallback(
            lambda dispatch: dispatch.preprocess_config(arch_value, dtype, dv),
            lambda: config_mod.PreprocessConfig(arch=arch_value, dtype=dtype, head_dim_v=dv), kind, spec, direct)
    flags = {k: fields.pop(k, False) for k in MASK_FLAGS}
    if kind == "fwd":
        sink, qhead_per_kvhead = fields.pop("has_sink", False), fields.pop("qhead_per_kvhead", 1)
        # Problem-class fields dispatch takes itself: its schedule and grid depend on them (split-KV
        # partials leave without tma_store_o, a paged cache runs one CTA per tile).
        problem = {k: fields.pop(k) for k in ("page_size", "split_kv", "has_seqused_q") if k in fields}

        def forward_directly():
            if qhead_per_kvhead != 1 and "pack_gqa" not in fields:
                print(f"# {kind} {spec}: qhead_per_kvhead={qhead_per_kvhead} ignored by a direct config; "
                      "name pack_gqa=<n> to pack", file=sys.stderr)
            return config_mod.ForwardConfig(arch=arch_value, dtype=dtype, head_dim=d, head_dim_v=dv, has_sink=sink,
                                            **flags, **problem, **fields)

        return _with_fallback(
            lambda dispatch: dispatch.forward_config(arch_value, dtype, d, dv, qhead_per_kvhead=qhead_per_kvhead,
                                                     has_sink=sink, **flags, **problem).replace(**fields),
            forward_directly, kind, spec, direct)
    deterministic = fields.pop("deterministic", False)
    cfg, how = _with_fallback(
        lambda dispatch: dispatch.backward_config(arch_value, dtype, d, dv, deterministic=deterministic,
                                                  **flags).replace(**fields),
        lambda: config_mod.BackwardConfig(arch=arch_value, dtype=dtype, head_dim=d, head_dim_v=dv,
                                          deterministic=deterministic, **flags, **fields), kind, spec, direct)
    return (cfg.postprocess(), how) if kind == "bwd_post" else (cfg, how)


def _with_fallback(from_dispatch, built_directly, kind: str, spec: str, direct: bool):
    """(config, how): dispatch's unless ``direct`` or dispatch has no rule for the arch yet."""
    if not direct:
        try:
            from flash_attn4 import dispatch

            return from_dispatch(dispatch), "dispatch"
        except NotImplementedError as exc:
            print(f"# {kind} {spec}: dispatch has no rule ({exc}); config built directly", file=sys.stderr)
    return built_directly(), "direct"


def compile_sass(kind: str, arch: str, spec: str, flavour: str = "auto", direct: bool = False) -> str:
    """nvdisasm -c of the spec's kernel: its module with a cubin, the largest if several
    (sass_stats_lib.kernel_artifacts, compiled once per configuration and flavour for the process)."""
    cfg, _ = build_config(kind, arch, spec, direct)
    if find_nvdisasm() is None:
        sys.exit("sass_report: nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    try:
        return lib.kernel_artifacts(cfg, flavour)["sass"].read_text()
    except RuntimeError as exc:
        raise RuntimeError(f"{kind} {spec}: {exc}") from exc


def report_config(cfg, flavour: str = "auto") -> tuple[dict, str]:
    """(statistics dict, nvdisasm -c text) of a configuration's kernel, from one compile."""
    with tempfile.TemporaryDirectory() as dump:
        result = lib.compile_config(cfg, flavour, dump, keep="ptx,cubin")
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        modules = [files for files in result.artifacts.values() if "cubin" in files]
        if len(modules) != 1:
            raise RuntimeError(f"expected one cubin, found {len(modules)}")
        if find_nvdisasm() is None:
            sys.exit("sass_report: nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
        sass = lib.disassemble(modules[0]["cubin"])
        stats = lib.stats_from_files(sass=sass, cubin=modules[0]["cubin"], ptx=modules[0].get("ptx"))
    stats.update(flavour=flavour, dsl_ir_module=result.dsl_ir_module)
    return stats, sass


def compile_report(kind: str, arch: str, spec: str, flavour: str = "auto", direct: bool = False) -> tuple[dict, str]:
    """(statistics dict, nvdisasm -c text) of the spec's kernel, from one compile."""
    cfg, how = build_config(kind, arch, spec, direct)
    stats, sass = report_config(cfg, flavour)
    stats["config"] = how
    return stats, sass


def kernel_set_jobs(arch: str) -> list[tuple[str, str, object]]:
    """(kind, label, config) for every configuration ``python -m fa4_kernels.compile --arch`` compiles."""
    _ensure_import_path()
    from flash_attn4.fa4_kernels import compile as compile_mod
    from flash_attn4.fa4_kernels.arch import Arch

    arch_value = Arch.parse(arch)
    configs = list(compile_mod.kernel_set(arch_value))
    configs += list(getattr(compile_mod, "backward_kernel_set", lambda a: [])(arch_value))
    kinds = {"ForwardConfig": "fwd", "BackwardConfig": "bwd", "PreprocessConfig": "bwd_pre",
             "PostprocessConfig": "bwd_post"}
    return [(kinds.get(type(c).__name__, type(c).__name__), config_label(c), c) for c in configs]


def config_label(cfg) -> str:
    """'dtype=bfloat16,head_dim=128,...': every field but the arch that is not at its default (the
    fields without one included), so distinct configurations get distinct labels and dump names."""
    import dataclasses

    parts = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name != "arch" and (f.default is dataclasses.MISSING or value != f.default):
            parts.append(f"{f.name}={value}")
    return ",".join(parts)


def normalised(sass: str) -> str:
    lines = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-f]+\*/", "", line)  # addresses
        line = re.sub(r"\.L_x_\d+", "L", line)  # labels
        line = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[]", line)  # kernel-parameter offsets
        line = line.strip()
        if line and not line.startswith("."):
            lines.append(line)
    return "\n".join(lines) + "\n"


def summary(sass: str) -> dict:
    """The few sm_90 counts this script printed first (kept as they were: tests read them)."""
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    count = lambda prefix: sum(op.startswith(prefix) for op in ops)  # noqa: E731
    return {"instructions": len(ops), "STL (spill stores)": count("STL"), "LDL (spill loads)": count("LDL"),
            "HGMMA": count("HGMMA"), "MUFU.EX2": count("MUFU.EX2"), "FFMA": count("FFMA"),
            # one per WGMMA group is the norm; more mean ptxas fenced register operands itself (C7519)
            "WARPGROUP.ARRIVE": count("WARPGROUP.ARRIVE"),
            # loops that make a value uniform for a TMA or WGMMA operand ptxas could not prove uniform
            "BRA.U.ANY (uniformity loops)": count("BRA.U.ANY")}


def _ptxas_short(stats: dict) -> str:
    if stats.get("ptxas"):
        m = re.search(r"release ([\d.]+)", stats["ptxas"])
        return f"ptxas {m.group(1)}" if m else stats["ptxas"]
    module = stats.get("dsl_ir_module") or ""
    m = re.search(r"\.(cu\d+)\.", module)
    return f"{m.group(1)} ptxas (not recorded in the cubin)" if m else "ptxas ?"


def format_stats(stats: dict) -> list[str]:
    """Human-readable lines for one kernel."""
    mma_name = "UTC*MMA" if stats["utcmma"] else "HGMMA" if stats["gmma"] else "MMA"
    ptx = stats.get("ptx") or {}
    sass_regs, ptx_regs = lib.setmaxreg_summary(stats["usetmaxreg"]), lib.setmaxreg_summary(stats.get("setmaxnreg"))
    match = "" if ptx.get("setmaxnreg") is None else (
        "equal" if sorted(stats["usetmaxreg"]) == sorted(ptx["setmaxnreg"]) else "DIFFER")
    allocs = ptx.get("tmem_alloc") or []
    tmem = ("-" if not allocs else ", ".join(f"{a['columns']} (cta_group::{a['cta_group']})" for a in allocs)
            + f"; dealloc {len(ptx.get('tmem_dealloc', []))}, relinquish {len(ptx.get('tmem_relinquish', []))}")
    two_cta = "yes" if stats["two_cta"] or stats.get("two_cta_ptx") else "no"
    if stats.get("two_cta_ptx") is not None and stats["two_cta"] != stats["two_cta_ptx"]:
        two_cta += f" (SASS .2CTA {stats['two_cta']}, PTX cta_group::2 {stats['two_cta_ptx']}: DIFFER)"
    reqntid = "x".join(map(str, (ptx.get("reqntid") or stats.get("reqntid") or ["?"])))
    lines = [
        f"  instructions {stats['instructions']}, {mma_name} {stats['mma']}, MUFU.EX2 {stats['mufu_ex2']}, "
        f"FFMA2/FMUL2/FADD2 {stats['ffma2']}/{stats['fmul2']}/{stats['fadd2']}, "
        f"LDTM/STTM {stats['ldtm']}/{stats['sttm']}",
        f"  LDL/STL {stats['ldl']}/{stats['stl']} (stack frame {stats.get('frame_bytes')} B), "
        f"regs {stats.get('regs')}, static smem {stats.get('static_smem')} B, .reqntid {reqntid}",
        f"  TMEM {tmem}; 2-CTA {two_cta}",
        f"  USETMAXREG {sass_regs} | PTX setmaxnreg {ptx_regs}" + (f" ({match})" if match else ""),
    ]
    problems = lib.static_problems(stats)
    lines.append("  static checks: " + ("ok" if not problems else "; ".join(problems)))
    if stats["gmma"] or stats.get("target", "") == "sm_90a":
        lines.append(f"  WARPGROUP.ARRIVE {stats['warpgroup_arrive']}, BRA.U.ANY {stats['bra_u_any']}, "
                     f"FFMA {stats['ffma']}")
    return lines


def format_diagnostics(diags: list[dict]) -> list[str]:
    if not diags:
        return ["  verifier: no diagnostics"]
    out = [f"  verifier: {len(diags)} diagnostic(s)"]
    for d in diags:
        where = f"{Path(d['file']).name}:{d['line']}" if d.get("file") else "?"
        out.append(f"    {d['severity']}[{d['code']}] {d['message']}  ({where} in {d.get('function') or '?'})")
    return out


def _spec_file_name(kind: str, spec: str, flavour: str | None) -> str:
    stem = f"{kind}_{re.sub(r'[^A-Za-z0-9]+', '_', spec)}"
    return f"{stem}_{flavour}.sass" if flavour else f"{stem}.sass"


def anchor_name(kind: str, cfg) -> str:
    """compile_anchor.py's name for the problem class of ``cfg`` (its shapes: batch 2, seqlen 4096,
    16 heads, GQA 32/8, local window (256, 0)); the name may have no anchor."""
    name = f"{kind}_d{cfg.head_dim}" + (f"_dv{cfg.head_dim_v}" if cfg.head_dim_v != cfg.head_dim else "")
    for flag, suffix in (("causal", "_causal"), ("varlen", "_varlen"), ("local", "_local256_0")):
        if getattr(cfg, flag, False):
            name += suffix
    if getattr(cfg, "pack_gqa", 1) == 4:
        name += "_gqa32_8"
    return name


def anchor_comparison(anchor_dir: Path, kind: str, cfg, stats: dict) -> dict | None:
    """Upstream's numbers for the same problem class, from compile_anchor.py's ``anchors.json``
    of the flavour our compile used, with our/upstream ratios; None where there is no anchor."""
    module = stats.get("dsl_ir_module") or ""
    flavour = next((f for f in ("cu12", "cu13") if f".{f}." in module), None)
    table = anchor_dir / (flavour or "") / "anchors.json"
    if flavour is None or not table.exists():
        return None
    data = json.loads(table.read_text())
    if data.get("arch") != stats.get("target"):
        return None  # upstream's sm_100a kernels say nothing about an sm_90a one
    name = anchor_name(kind, cfg)
    rec = next((r for r in data["configs"] if r["config"] == name), None)
    if rec is None or rec.get("status") != "ok":
        return None
    up = rec["sass"]
    up_mma = up["utcmma"] or up["gmma"]
    out = {"config": name, "flavour": flavour, "instructions": up["instructions"], "mma": up_mma,
           "instructions_ratio": stats["instructions"] / up["instructions"]}
    if up_mma and stats["mma"]:
        # where the tiles differ: instructions per MMA the SASS issues
        out["per_mma_ratio"] = (stats["instructions"] / stats["mma"]) / (up["instructions"] / up_mma)
    return out


def format_anchor(cmp: dict | None) -> list[str]:
    if cmp is None:
        return ["  upstream anchor: none for this arch / problem class / flavour"]
    line = (f"  upstream {cmp['config']} [{cmp['flavour']}]: instructions {cmp['instructions']} "
            f"(ours {cmp['instructions_ratio']:.3f}x), MMA {cmp['mma']}")
    if "per_mma_ratio" in cmp:
        line += f", instructions per MMA ours {cmp['per_mma_ratio']:.3f}x"
    return [line]


def report_dumps(paths: list[str], as_json: bool) -> int:
    """Statistics of existing CUTE_DSL_KEEP dumps (X.sass / X.<arch>.cubin / X.<arch>.ptx)."""
    rows = []
    for path in map(Path, paths):
        for stem, stats in lib.stats_from_dump_dir(path).items():
            stats["file"] = str(path / stem)
            rows.append(stats)
    if as_json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    for stats in rows:
        print(f"{stats['file']} [{stats.get('target')}, {_ptxas_short(stats)}]")
        print("\n".join(format_stats(stats)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring for the spec syntax and every option.")
    p.add_argument("kind", choices=("fwd", "bwd", "bwd_pre", "bwd_post", "set", "dumps"),
                   help="'set': the arch's CI kernel set (fa4_kernels.compile); 'dumps': existing KEEP folders")
    p.add_argument("specs", nargs="*", help="d=128,causal=true,... (see the module docstring), or folders")
    p.add_argument("--arch", default="sm_90a", help="sm_90a, sm_100a or sm_103a")
    p.add_argument("--flavour", default="auto", choices=("auto", "cu12", "cu13", "both"),
                   help="the DSL's embedded ptxas: cu12 (12.9), cu13 (13.4), auto (the DSL's pick), both")
    p.add_argument("--direct", action="store_true", help="build the config from the spec, not dispatch")
    p.add_argument("--dump", type=Path, help="write each kernel's normalised SASS into this folder")
    p.add_argument("--verify", action="store_true", help="also list the DSL verifier's diagnostics")
    p.add_argument("--verify-options", default="warnings", help="CUTE_DSL_COMPILER_OPT for --verify")
    p.add_argument("--json", action="store_true", help="print the statistics dicts as JSON")
    p.add_argument("--anchors", type=Path, metavar="DIR",
                   help="compare with upstream's numbers in compile_anchor.py's --out DIR (same ptxas flavour)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a kernel's static checks find a problem")
    p.add_argument("-v", "--verbose", action="store_true", help="the end of a failed compile's traceback")
    args = p.parse_args(argv)
    if args.kind == "dumps":
        return report_dumps(args.specs, args.json)
    if args.kind not in ("set", "dumps") and not args.specs:
        p.error(f"{args.kind} needs at least one spec (d=128,...)")
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    flavours = ["cu12", "cu13"] if args.flavour == "both" else [args.flavour]
    failures, rows = 0, []
    if args.kind == "set":
        jobs = [(kind, label, cfg, "kernel set", _spec_file_name(kind, label, None)[:-5])
                for kind, label, cfg in kernel_set_jobs(args.arch)]
        if not jobs:
            print(f"sass_report: no kernels in the {args.arch} kernel set", file=sys.stderr)
            return 1
    else:
        jobs = []
        for spec in args.specs:
            try:
                cfg, how = build_config(args.kind, args.arch, spec, args.direct)
            except Exception as exc:  # a spec that names no valid configuration
                failures += 1
                print(f"{args.kind} {spec} [{args.arch}]: INVALID: {type(exc).__name__}: {exc}", flush=True,
                      file=sys.stderr if args.json else sys.stdout)
                continue
            jobs.append((args.kind, spec, cfg, how, _spec_file_name(args.kind, spec, None)[:-5]))
    for kind, label, cfg, how, stem in jobs:
        for flavour in flavours:
            try:
                stats, sass = report_config(cfg, flavour)
            except Exception as exc:  # report every failing config, then fail
                failures += 1
                lines = [ln for ln in str(exc).splitlines() if ln.strip()] or [repr(exc)]
                detail = "\n".join(lines[-40:]) if args.verbose else lines[-1]
                print(f"{kind} {label} [{args.arch}, {flavour}]: FAILED: {detail}", flush=True,
                      file=sys.stderr if args.json else sys.stdout)
                continue
            stats.update(spec=f"{kind} {label}", config=how)
            if args.strict and lib.static_problems(stats):
                failures += 1
            if args.verify:
                stats["diagnostics"] = lib.verifier_diagnostics(cfg, flavour, args.verify_options)
            if args.anchors:
                stats["anchor"] = anchor_comparison(args.anchors, kind, cfg, stats) if kind in ("fwd", "bwd") else None
            if args.json:
                rows.append(stats)
            else:
                where = f"[{args.arch}, {flavour}, {_ptxas_short(stats)}, config {how}]"
                if stats.get("target") == "sm_90a":  # the line this script always printed for sm_90a first
                    print(f"{kind} {label}: " + ", ".join(f"{k} {v}" for k, v in summary(sass).items()))
                    print(f"  {where}")
                else:
                    print(f"{kind} {label} {where}:")
                lines = format_stats(stats)
                lines += format_diagnostics(stats["diagnostics"]) if args.verify else []
                lines += format_anchor(stats["anchor"]) if args.anchors else []
                print("\n".join(lines), flush=True)
            if args.dump:
                name = f"{stem}_{flavour}.sass" if len(flavours) > 1 else f"{stem}.sass"
                (args.dump / name).write_text(normalised(sass))
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
