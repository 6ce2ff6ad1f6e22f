#!/usr/bin/env python3
"""What a kernel configuration compiles to, without a GPU: spilled registers, WGMMAs, exponentials.

    python scripts/sass_report.py bwd d=128 d=128,causal=true d=128,tile_m=80
    python scripts/sass_report.py fwd d=64,causal=true,exp2_emulated_eighths=2 --arch sm_90a
    python scripts/sass_report.py bwd d=64 d=128 --dump before/   # normalised SASS, one file each
    python scripts/sass_report.py bwd_post d=128 d=64,varlen=true     # the backward's dQ postprocessing

A spec is ``d=<head_dim>[,dv=<head_dim_v>]`` plus Forward/BackwardConfig fields (``causal=true``,
``tile_m=80``, ...); ``bwd_pre`` reads only dv, ``bwd_post`` compiles the postprocessing kernel of the
backward the spec names. The base configuration is the one dispatch picks for those head dims and mask
flags, so a spec names only what differs. Each spec compiles in its own process (the DSL reads its
dump settings at import) and is disassembled with nvdisasm (pip install nvidia-cuda-nvdisasm).

``--dump DIR`` writes each kernel's SASS with addresses, labels and constant-bank offsets removed,
so that two dumps diff cleanly: a refactor that should not change the code must leave them equal.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Compiles one configuration (argv: kind, arch, spec) in a fresh process.
_COMPILE = r"""
import sys
sys.path.insert(0, sys.argv[4])
from flash_attn4 import dispatch
from flash_attn4.fa4_kernels.arch import Arch
from flash_attn4.fa4_kernels import compile as kc
from flash_attn4.fa4_kernels.config import parse_overrides

kind, arch, spec = sys.argv[1:4]
fields = parse_overrides(spec)
d = fields.pop("d")
dv = fields.pop("dv", d)
flags = {k: fields.pop(k, False) for k in ("causal", "local", "has_softcap", "varlen", "has_seqused_k")}
arch = Arch(arch)
if kind == "fwd":
    cfg = dispatch.forward_config(arch, "bfloat16", d, dv, has_sink=fields.pop("has_sink", False), **flags)
    kc.compile_forward(cfg.replace(**fields))
elif kind == "bwd_pre":
    kc.compile_backward_preprocess(dispatch.preprocess_config(arch, "bfloat16", dv))
else:
    cfg = dispatch.backward_config(arch, "bfloat16", d, dv, deterministic=fields.pop("deterministic", False),
                                   **flags)
    cfg = cfg.replace(**fields)
    if kind == "bwd":
        kc.compile_backward(cfg)
    else:
        kc.compile_backward_postprocess(cfg.postprocess())
"""


def find_nvdisasm() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH; None if neither has it."""
    try:
        import nvidia.cu13  # the nvidia-cuda-nvdisasm wheel

        path = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "nvdisasm"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def compile_sass(kind: str, arch: str, spec: str) -> str:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, CUTE_DSL_DUMP_DIR=dump, CUTE_DSL_KEEP="cubin", CUTE_DSL_ARCH=arch)
        proc = subprocess.run([sys.executable, "-c", _COMPILE, kind, arch, spec, str(ROOT / "torch-ext")],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} {spec}: compile failed\n{proc.stderr[-3000:]}")
        cubins = glob.glob(os.path.join(dump, "*.cubin"))
        if len(cubins) != 1:
            raise RuntimeError(f"{kind} {spec}: expected one cubin, found {len(cubins)}")
        nvdisasm = find_nvdisasm()
        if nvdisasm is None:
            sys.exit("sass_report: nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
        return subprocess.run([nvdisasm, "-c", cubins[0]], capture_output=True, text=True, check=True).stdout


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
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    count = lambda prefix: sum(op.startswith(prefix) for op in ops)  # noqa: E731
    return {"instructions": len(ops), "STL (spill stores)": count("STL"), "LDL (spill loads)": count("LDL"),
            "HGMMA": count("HGMMA"), "MUFU.EX2": count("MUFU.EX2"), "FFMA": count("FFMA"),
            # one per WGMMA group is the norm; more mean ptxas fenced register operands itself (C7519)
            "WARPGROUP.ARRIVE": count("WARPGROUP.ARRIVE"),
            # loops that make a value uniform for a TMA or WGMMA operand ptxas could not prove uniform
            "BRA.U.ANY (uniformity loops)": count("BRA.U.ANY")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("fwd", "bwd", "bwd_pre", "bwd_post"))
    p.add_argument("specs", nargs="+", help="d=128,causal=true,... (see the module docstring)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--dump", type=Path, help="write each kernel's normalised SASS into this folder")
    args = p.parse_args(argv)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    for spec in args.specs:
        sass = compile_sass(args.kind, args.arch, spec)
        print(f"{args.kind} {spec}: " + ", ".join(f"{k} {v}" for k, v in summary(sass).items()), flush=True)
        if args.dump:
            (args.dump / f"{args.kind}_{re.sub(r'[^A-Za-z0-9]+', '_', spec)}.sass").write_text(normalised(sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
