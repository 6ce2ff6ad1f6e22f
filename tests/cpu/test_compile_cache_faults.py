"""The kernel disk cache under faults, with real CuTe-DSL compiles for sm_90a (no GPU needed):
eight processes compiling one new configuration at once, truncated / corrupt / unrecorded entries,
a read-only folder, a full disk, and a compiling process killed while it holds the entry's lock.
In every case the caller gets a working compiled function (loaded from a verified entry, or compiled
in memory), and the folder never keeps a bad entry. Slow: each case compiles for real.
"""

# No "from __future__ import annotations": the DSL evaluates the kernel's annotations.

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flash_attn4 import compile_cache
from tests.cpu.test_compile_cache import _compile_trivial_kernel

pytest.importorskip("cutlass")
tvm_ffi = pytest.importorskip("tvm_ffi")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# A small real kernel (the child processes import it from this file: the DSL needs its source file).


# The cache tests' trivial kernel (a real CuTe DSL compile, sm_90a on the CPU), under the name the
# child processes import.
compile_scale_kernel = _compile_trivial_kernel


class Cfg:
    def __init__(self, name):
        self.name = name

    def key(self):
        return ("FaultCfg", "name=" + self.name)


# A child process: get_kernel for one configuration; mode "hang" stalls in the compile, "hang_export"
# after the object file was exported to its temp file (both while holding the entry's lock).
CHILD = '''
import json, os, sys, time
sys.path[:0] = [{repo!r}, {torch_ext!r}, {here!r}]
from flash_attn4 import compile_cache
from test_compile_cache_faults import Cfg, compile_scale_kernel
name, mode, marker = sys.argv[1], sys.argv[2], sys.argv[3]

def stall():
    open(marker, "w").close()
    time.sleep(600)

class StallingExport:
    def __init__(self, fn): self.fn = fn
    def export_to_c(self, path, function_name):
        self.fn.export_to_c(path, function_name=function_name)
        stall()

def compile_fn(cfg, *, jit_engine=True):
    if mode == "hang":
        stall()
    fn = compile_scale_kernel(cfg, jit_engine=jit_engine)
    return StallingExport(fn) if mode == "hang_export" else fn

fn = compile_cache.get_kernel("fault", Cfg(name), compile_fn)
print(json.dumps(dict(compile_cache.stats(), type=type(fn).__name__)))
'''


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FLASH_ATTN4_CACHE_DIR", str(d))
    monkeypatch.delenv("FLASH_ATTN4_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compile_cache.clear()
    yield d
    compile_cache.clear()


def fresh_cfg():
    return Cfg(uuid.uuid4().hex[:12])


def get(cfg):
    return compile_cache.get_kernel("fault", cfg, compile_scale_kernel)


def assert_good_entry(cfg):
    """The entry exists, its sidecar records its bytes, and no temp file is left beside it."""
    path = compile_cache.entry_path("fault", cfg.key())
    compile_cache._verify(path)
    assert path.read_bytes()[:4] == b"\x7fELF"
    assert not list(path.parent.glob("*.tmp")), "temporary files left behind"
    return path


def child_env(cache_dir):
    env = dict(os.environ, FLASH_ATTN4_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH="sm_90a")
    env.pop("FLASH_ATTN4_DISABLE_DISK_CACHE", None)
    return env


def start_child(tmp_path, cache_dir, name, mode="normal", marker=None):
    script = tmp_path / "child.py"
    if not script.exists():
        script.write_text(CHILD.format(repo=str(REPO), torch_ext=str(REPO / "torch-ext"), here=str(Path(__file__).parent)))
    return subprocess.Popen([sys.executable, str(script), name, mode, str(marker or tmp_path / "unused")],
                            env=child_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_result(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# ---- concurrency ----


def test_eight_processes_compile_a_new_configuration_once(tmp_path, cache_dir):
    name = uuid.uuid4().hex[:12]
    procs = [start_child(tmp_path, cache_dir, name) for _ in range(8)]
    results = [child_result(p) for p in procs]
    assert sum(r["compiled"] for r in results) == 1, results
    assert sum(r["disk_hits"] for r in results) == 7, results
    assert sum(r["disk_writes"] for r in results) == 1 and not any(r["disk_errors"] for r in results)
    assert {r["type"] for r in results} == {"Function"}  # every process runs a loaded entry
    assert_good_entry(Cfg(name))


# ---- damaged entries ----


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):
    path.write_bytes(os.urandom(path.stat().st_size))


def _flip_one_bit(path):  # still a valid ELF file that links: only the recorded sha256 catches it
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _no_sidecar(path):
    path.with_suffix(".json").unlink()


def _garbage_sidecar(path):
    path.with_suffix(".json").write_text("{not json")


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _garbage, _flip_one_bit, _no_sidecar, _garbage_sidecar, _empty])
def test_damaged_entry_is_replaced(cache_dir, damage):
    cfg = fresh_cfg()
    get(cfg)
    path = assert_good_entry(cfg)
    good = path.read_bytes()
    damage(path)
    compile_cache.clear()  # a new process
    fn = get(cfg)
    assert isinstance(fn, tvm_ffi.Function)
    stats = compile_cache.stats()
    assert stats["disk_errors"] == 1 and stats["compiled"] == 1 and stats["disk_hits"] == 0, stats
    assert_good_entry(cfg)
    assert len(path.read_bytes()) == len(good)
    compile_cache.clear()
    get(cfg)
    assert compile_cache.stats()["disk_hits"] == 1 and compile_cache.stats()["compiled"] == 0


# ---- read-only or full folder ----


@pytest.fixture
def read_only(monkeypatch):
    """Make a folder read-only: chmod, and (since root ignores modes) creating files under it fails
    with EROFS, as on a read-only mount."""
    made = []

    def apply(folder: Path):
        folder = folder.resolve()
        real_open, real_mkstemp = os.open, compile_cache.tempfile.mkstemp

        def inside(p):
            return str(Path(p).resolve()).startswith(str(folder) + os.sep)

        def guarded_open(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and inside(path):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_open(path, flags, *args, **kwargs)

        def guarded_mkstemp(*args, dir=None, **kwargs):
            if dir is not None and inside(Path(dir) / "x"):
                raise OSError(errno.EROFS, "Read-only file system", str(dir))
            return real_mkstemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(compile_cache.os, "open", guarded_open)
        monkeypatch.setattr(compile_cache.tempfile, "mkstemp", guarded_mkstemp)
        for p in [folder, *folder.rglob("*")]:
            if p.is_dir():
                p.chmod(0o555)
                made.append(p)

    yield apply
    for p in made:
        p.chmod(0o755)


def test_read_only_folder_still_serves_its_entries(cache_dir, read_only):
    cfg = fresh_cfg()
    get(cfg)
    (path := assert_good_entry(cfg)).with_suffix(".lock").unlink()  # no lock file to reuse
    read_only(cache_dir)
    compile_cache.clear()
    assert isinstance(get(cfg), tvm_ffi.Function)
    assert compile_cache.stats()["disk_hits"] == 1 and compile_cache.stats()["compiled"] == 0
    assert path.exists()


def test_read_only_folder_compiles_in_memory(cache_dir, read_only):
    get(fresh_cfg())  # the fingerprint folder exists
    read_only(cache_dir)
    compile_cache.clear()
    cfg = fresh_cfg()
    fn = get(cfg)
    assert callable(fn)
    assert not compile_cache.entry_path("fault", cfg.key()).exists()
    assert compile_cache.stats()["disk_errors"] == 1 and compile_cache.stats()["disk_writes"] == 0


@pytest.mark.parametrize("where", ["object", "sidecar"])
def test_full_disk(cache_dir, monkeypatch, where):
    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_export = compile_cache._export
    if where == "sidecar":
        monkeypatch.setattr(compile_cache, "write_atomic", enospc)
    else:
        class HalfWritten:  # the object file half written, then the disk is full
            def __init__(self, fn):
                self.fn = fn

            def export_to_c(self, path, function_name):
                self.fn.export_to_c(path, function_name=function_name)
                _truncate(Path(path))
                enospc()

        monkeypatch.setattr(compile_cache, "_export", lambda fn, path, key: real_export(HalfWritten(fn), path, key))
    cfg = fresh_cfg()
    assert callable(get(cfg))
    path = compile_cache.entry_path("fault", cfg.key())
    assert not path.exists() and not path.with_suffix(".json").exists() and not list(path.parent.glob("*.tmp"))
    assert compile_cache.stats()["disk_errors"] == 1
    monkeypatch.undo()  # space again: a new process writes the entry
    monkeypatch.setenv("FLASH_ATTN4_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compile_cache.clear()
    assert isinstance(get(cfg), tvm_ffi.Function)
    assert_good_entry(cfg)


# ---- a compiler killed mid-compile ----


def lock_is_held(lock: Path) -> bool:
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize("mode", ["hang", "hang_export"])
def test_compiler_killed_while_holding_the_lock(tmp_path, cache_dir, mode):
    name, marker = uuid.uuid4().hex[:12], tmp_path / "stalled"
    victim = start_child(tmp_path, cache_dir, name, mode, marker)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert victim.poll() is None, victim.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the child never reached its compile"
        time.sleep(0.1)
    cfg = Cfg(name)
    path = compile_cache.entry_path("fault", cfg.key())
    assert lock_is_held(path.with_suffix(".lock"))
    if mode == "hang_export":
        assert list(path.parent.glob(path.name + ".*.tmp")), "the export's temp file is not there"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    assert not path.exists()
    result = child_result(start_child(tmp_path, cache_dir, name))
    assert result["compiled"] == 1 and result["disk_writes"] == 1 and result["type"] == "Function", result
    assert_good_entry(cfg)  # the killed writer's temp file is gone too
