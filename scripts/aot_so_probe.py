"""Probe (GPU): can a shipped kernel run without importing the DSL? docs/AOT.md, "Cold start".

Links every exported object of an AOT folder into a shared library (``cc -shared``), then, in a fresh
process with an empty disk cache, loads the kernel of a shipped configuration with
``tvm_ffi.load_module`` after preloading the DSL's runtime library (the flavour the DSL itself would
pick for this driver) and runs the first forward: prints the time from ``import flash_attn4`` to the
result, its error against SDPA in float32, and whether ``cutlass`` was imported. The same child with
the DSL's loader gives the number to compare with.

    python scripts/build_aot.py --arch sm_90a --out /tmp/fa4_aot -j 16
    python scripts/aot_so_probe.py /tmp/fa4_aot
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import ctypes, importlib.util, json, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch
torch.cuda.init()
q = torch.randn(2, 512, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
torch.cuda.synchronize()
start = time.perf_counter()
import flash_attn4
from flash_attn4 import compile_cache

def runtime_library():
    # the DSL's rule (cutlass/_mlir/_mlir_libs/__init__.py): the newest cu{N} flavour installed
    # whose major N the driver supports; found without importing cutlass
    origin = Path(importlib.util.find_spec("cutlass").origin)
    root = next(p for p in origin.parents if p.name == "nvidia_cutlass_dsl")
    version = ctypes.c_int(0)
    ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    flavours = sorted((int(p.name[2:]) for p in root.glob("cu[0-9]*")
                       if (p / "lib" / "libcute_dsl_runtime.so").is_file()), reverse=True)
    major = next(n for n in flavours if version.value // 1000 >= n)
    return root / f"cu{major}" / "lib" / "libcute_dsl_runtime.so"

if sys.argv[3] == "so":
    import tvm_ffi
    for lib in (runtime_library(), tvm_ffi.libinfo.find_libtvm_ffi()):
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    def load(path):
        return tvm_ffi.load_module(str(Path(path).with_suffix(".so")))[compile_cache.EXPORT_NAME]
    compile_cache._load = load
def refuse(*args, **kwargs):
    raise AssertionError("the DSL compiler ran")
compile_cache._timed_compile = refuse
out = flash_attn4.flash_attn_func(q, k, v, causal=True)
out = out[0] if isinstance(out, tuple) else out
torch.cuda.synchronize()
total = time.perf_counter() - start
ref = torch.nn.functional.scaled_dot_product_attention(
    q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), is_causal=True,
    enable_gqa=True).transpose(1, 2)
print(json.dumps({"mode": sys.argv[3], "total_s": round(total, 4), "max_err": (out.float() - ref).abs().max().item(),
                  "cutlass_imported": "cutlass" in sys.modules, "stats": compile_cache.stats()}))
"""


def link_all(aot_dir: Path) -> int:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc/gcc) on PATH")
    objects = sorted(aot_dir.glob("*/*.o"))
    t0 = time.perf_counter()
    for obj in objects:
        subprocess.run([cc, "-shared", "-o", str(obj.with_suffix(".so")), str(obj)], check=True)
    print(f"linked {len(objects)} objects in {time.perf_counter() - t0:.2f} s; "
          f"{sum(o.stat().st_size for o in objects) / 2**20:.1f} MiB .o, "
          f"{sum(o.with_suffix('.so').stat().st_size for o in objects) / 2**20:.1f} MiB .so")
    return len(objects)


def main() -> int:
    aot_dir = Path(sys.argv[1])
    link_all(aot_dir)
    ok = True
    for mode in ("so", "dsl", "so", "dsl"):
        with tempfile.TemporaryDirectory() as cache:
            env = {k: v for k, v in os.environ.items() if k != "FLASH_ATTN4_DISABLE_AOT"}
            env.update(FLASH_ATTN4_CACHE_DIR=cache, FLASH_ATTN4_AOT_DIR=str(aot_dir))
            done = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "torch-ext"), str(REPO), mode],
                                  capture_output=True, text=True, env=env, timeout=120)
        if done.returncode != 0:
            print(f"{mode}: FAILED\n{done.stderr[-3000:]}")
            ok = False
            continue
        print(done.stdout.strip().splitlines()[-1])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
