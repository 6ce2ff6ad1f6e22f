"""Compile cache: memory cache, disk round trip (paths, atomic files, fingerprint, locking), settings read
at call time, and one real CuTe-DSL export -> load round trip (compiled for sm_90a without a GPU)."""

# No "from __future__ import annotations": the DSL evaluates the kernel annotations at compile time
# and the trivial kernel below imports cutlass locally.

import json
import logging
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from flash_attn4 import compile_cache, settings

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Cfg:
    name: str
    head_dim: int = 64

    def key(self):
        return ("Cfg", f"name={self.name}", f"head_dim={self.head_dim}")


class FakeCompiled:
    """Stands in for a DSL compiled function: exportable to a file, callable only if it was compiled
    with a JIT engine (or loaded from a file)."""

    def __init__(self, tag: str, runnable: bool = True):
        self.tag, self.runnable = tag, runnable

    def __call__(self):
        assert self.runnable, "called a kernel compiled without a JIT engine"
        return self.tag

    def export_to_c(self, path, function_name):
        Path(path).write_text(json.dumps({"tag": self.tag, "fn": function_name}))


def fake_load(path):
    data = json.loads(Path(path).read_text())
    assert data["fn"] == compile_cache.EXPORT_NAME
    return FakeCompiled("loaded:" + data["tag"])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "fa4-cache"
    monkeypatch.setenv("FLASH_ATTN4_CACHE_DIR", str(d))
    monkeypatch.delenv("FLASH_ATTN4_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.setattr(compile_cache, "_load", fake_load)
    compile_cache.clear()
    yield d
    compile_cache.clear()


def counting_compiler(log, engines=None):
    def compile_fn(cfg, *, jit_engine=True):
        log.append(cfg)
        if engines is not None:
            engines.append(jit_engine)
        return FakeCompiled(cfg.name, runnable=jit_engine)
    return compile_fn


def test_memory_cache_compiles_once(cache_dir):
    log = []
    cfg = Cfg(uuid.uuid4().hex)
    fns = [compile_cache.get_kernel("t", cfg, counting_compiler(log)) for _ in range(5)]
    assert len(log) == 1 and all(f is fns[0] for f in fns)
    assert compile_cache.stats()["compiled"] == 1 and compile_cache.stats()["memory_hits"] == 4
    compile_cache.get_kernel("t", Cfg(cfg.name, head_dim=128), counting_compiler(log))
    assert len(log) == 2  # another key compiles


def test_disk_round_trip(cache_dir):
    log, engines = [], []
    cfg = Cfg(uuid.uuid4().hex)
    fn = compile_cache.get_kernel("t", cfg, counting_compiler(log, engines))
    assert engines == [False]  # compiled for export only: the first process runs the written entry too
    assert fn() == "loaded:" + cfg.name
    path = compile_cache.entry_path("t", cfg.key())
    assert path.parent.parent == cache_dir and path.parent.name == compile_cache.source_fingerprint()
    assert path.exists() and path.suffix == ".o"
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["key"] == list(cfg.key())
    assert not list(path.parent.glob("*.tmp")), "temporary files left behind"
    assert compile_cache.stats()["disk_writes"] == 1

    compile_cache.clear()  # a new process: nothing in memory
    fn2 = compile_cache.get_kernel("t", cfg, counting_compiler(log))
    assert fn2() == "loaded:" + cfg.name
    assert len(log) == 1
    assert compile_cache.stats() == {"compiled": 0, "memory_hits": 0, "aot_hits": 0, "aot_errors": 0,
                                     "disk_hits": 1, "disk_writes": 0, "disk_errors": 0}


def test_entry_path_depends_on_kind_key_and_fingerprint(cache_dir):
    key = Cfg("a").key()
    assert compile_cache.entry_path("fwd", key) != compile_cache.entry_path("bwd", key)
    assert compile_cache.entry_path("fwd", key) != compile_cache.entry_path("fwd", Cfg("b").key())
    assert compile_cache.entry_path("fwd", key, "f1").parent.name == "f1"


def test_disable_disk_cache_is_read_at_call_time(cache_dir, monkeypatch):
    log = []
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "1")
    assert compile_cache.get_kernel("t", Cfg("off"), counting_compiler(log))() == "off"  # a JIT engine
    assert not cache_dir.exists() or not any(cache_dir.rglob("*.o"))
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "0")
    compile_cache.get_kernel("t", Cfg("on"), counting_compiler(log))
    assert [p.name for p in cache_dir.rglob("*.o")] == [compile_cache.entry_path("t", Cfg("on").key()).name]


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASH_ATTN4_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == tmp_path / "xdg" / "flash_attn4"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert settings.cache_dir() == tmp_path / "home" / ".cache" / "flash_attn4"
    monkeypatch.setenv("FLASH_ATTN4_CACHE_DIR", str(tmp_path / "mine"))
    assert settings.cache_dir() == tmp_path / "mine"


def test_flag_parsing(monkeypatch):
    for raw, want in [("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)]:
        monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", raw)
        assert settings.check_cu_seqlens() is want
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "maybe")
    with pytest.raises(ValueError, match="FLASH_ATTN4_CHECK_CU_SEQLENS"):
        settings.check_cu_seqlens()


def test_log_level_setting(monkeypatch):
    logger = logging.getLogger(settings.LOGGER_NAME)
    old_level, old_handlers = logger.level, list(logger.handlers)
    try:
        monkeypatch.setenv("FLASH_ATTN4_LOG_LEVEL", "debug")
        assert settings.get_logger().level == logging.DEBUG
        monkeypatch.setenv("FLASH_ATTN4_LOG_LEVEL", "30")
        assert settings.get_logger().level == logging.WARNING
        monkeypatch.setenv("FLASH_ATTN4_LOG_LEVEL", "loud")
        with pytest.raises(ValueError, match="FLASH_ATTN4_LOG_LEVEL"):
            settings.get_logger()
    finally:
        logger.setLevel(old_level)
        logger.handlers[:] = old_handlers


def test_slow_compile_is_logged_at_warning(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("FLASH_ATTN4_SLOW_COMPILE_S", "0")
    with caplog.at_level(logging.DEBUG, logger="flash_attn4"):
        compile_cache.get_kernel("t", Cfg("slow"), counting_compiler([]))
    lines = [r for r in caplog.records if "compiling t kernel" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "name=slow" in lines[0].getMessage() and " took " in lines[0].getMessage()
    monkeypatch.setenv("FLASH_ATTN4_SLOW_COMPILE_S", "1000")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="flash_attn4"):
        compile_cache.get_kernel("t", Cfg("fast"), counting_compiler([]))
    assert [r.levelno for r in caplog.records if "compiling t kernel" in r.getMessage()] == [logging.INFO]


def test_corrupt_entry_is_replaced(cache_dir, caplog):
    log = []
    cfg = Cfg(uuid.uuid4().hex)
    path = compile_cache.entry_path("t", cfg.key())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF garbage")
    with caplog.at_level(logging.WARNING, logger="flash_attn4"):
        fn = compile_cache.get_kernel("t", cfg, counting_compiler(log))
    assert fn() == "loaded:" + cfg.name and len(log) == 1
    assert any("could not load cached kernel" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["tag"] == cfg.name  # rewritten with a good entry
    assert compile_cache.stats()["disk_errors"] == 1


def test_export_failure_is_not_fatal(cache_dir, caplog):
    class Unexportable(FakeCompiled):
        def export_to_c(self, path, function_name):
            Path(path).write_text("partial")
            raise RuntimeError("export broke")

    engines = []

    def compile_fn(cfg, *, jit_engine=True):
        engines.append(jit_engine)
        return Unexportable(cfg.name, runnable=jit_engine)

    cfg = Cfg(uuid.uuid4().hex)
    with caplog.at_level(logging.WARNING, logger="flash_attn4"):
        fn = compile_cache.get_kernel("t", cfg, compile_fn)
    assert fn() == cfg.name and engines == [False, True]  # compiled again, with an engine
    path = compile_cache.entry_path("t", cfg.key())
    assert not path.exists() and not list(path.parent.glob("*.tmp"))
    assert any("could not write or load kernel cache entry" in r.getMessage() for r in caplog.records)
    assert compile_cache.stats()["disk_errors"] == 1 and compile_cache.stats()["disk_writes"] == 0

    # The process's later kernels compile once, with an engine, instead of failing the same way.
    other = Cfg(uuid.uuid4().hex)
    engines.clear()
    assert compile_cache.get_kernel("t", other, compile_fn)() == other.name and engines == [True]
    assert not compile_cache.entry_path("t", other.key()).exists()
    compile_cache.clear()  # a fresh start tries the disk again
    compile_cache.get_kernel("t", Cfg(uuid.uuid4().hex), compile_fn)
    assert engines[1:] == [False, True]


def test_entry_that_does_not_load_after_writing_is_removed(cache_dir, monkeypatch, caplog):
    def broken_load(path):
        raise RuntimeError("JITLink failed")

    monkeypatch.setattr(compile_cache, "_load", broken_load)
    log, engines = [], []
    cfg = Cfg(uuid.uuid4().hex)
    with caplog.at_level(logging.WARNING, logger="flash_attn4"):
        fn = compile_cache.get_kernel("t", cfg, counting_compiler(log, engines))
    assert fn() == cfg.name and engines == [False, True]
    assert not compile_cache.entry_path("t", cfg.key()).exists()  # no entry that cannot be loaded
    assert any("JITLink failed" in r.getMessage() for r in caplog.records)


def test_unwritable_cache_dir_falls_back_to_memory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLASH_ATTN4_CACHE_DIR", str(blocker / "sub"))
    monkeypatch.delenv("FLASH_ATTN4_DISABLE_DISK_CACHE", raising=False)
    compile_cache.clear()
    with caplog.at_level(logging.WARNING, logger="flash_attn4"):
        fn = compile_cache.get_kernel("t", Cfg("nowhere"), counting_compiler([]))
    assert fn() == "nowhere"
    assert any("disk cache unavailable" in r.getMessage() for r in caplog.records)
    compile_cache.clear()


def test_write_atomic_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "x.o"

    def bad(tmp):
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        compile_cache.write_atomic(target, bad)
    assert list(tmp_path.iterdir()) == []
    compile_cache.write_atomic(target, lambda tmp: Path(tmp).write_text("whole"))
    assert target.read_text() == "whole" and [p.name for p in tmp_path.iterdir()] == ["x.o"]


def test_fingerprint_tracks_sources(tmp_path):
    root = tmp_path / "kernels"
    (root / "sm90").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sm90" / "fwd.py").write_text("y = 2\n")
    first = compile_cache.source_fingerprint(root)
    assert compile_cache.source_fingerprint(root) == first
    (root / "sm90" / "fwd.py").write_text("y = 3\n")
    second = compile_cache.source_fingerprint(root)
    assert second != first
    (root / "notes.txt").write_text("not python")
    assert compile_cache.source_fingerprint(root) == second
    (root / "b.py").write_text("")
    assert compile_cache.source_fingerprint(root) != second


def test_default_fingerprint_covers_the_kernel_package():
    root = compile_cache._kernels_root()
    assert (root / "config.py").exists() and (root / "arch.py").exists()
    assert compile_cache.source_fingerprint() == compile_cache.source_fingerprint(root)


CHILD = """
import json, sys, time
from pathlib import Path
sys.path[:0] = [{repo!r}, {torch_ext!r}]
from flash_attn4 import compile_cache

class Compiled:
    def __init__(self, tag): self.tag = tag
    def export_to_c(self, path, function_name): Path(path).write_text(json.dumps({{"tag": self.tag}}))

def compile_fn(cfg, *, jit_engine=True):
    with open({marks!r}, "a") as f:
        f.write("compiled\\n")
    time.sleep(0.5)  # a slow compile, so the other processes arrive while it runs
    return Compiled("c")

compile_cache._load = lambda path: Compiled("loaded:" + json.loads(Path(path).read_text())["tag"])

class Cfg:
    def key(self): return ("Cfg", "shared")

fn = compile_cache.get_kernel("t", Cfg(), compile_fn)
print(fn.tag)
"""


def test_concurrent_processes_compile_once(tmp_path):
    marks = tmp_path / "marks.txt"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO), torch_ext=str(REPO / "torch-ext"), marks=str(marks)))
    env = dict(os.environ, FLASH_ATTN4_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("FLASH_ATTN4_DISABLE_DISK_CACHE", None)
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    tags = sorted(out.strip() for out, _ in results)
    assert marks.read_text().splitlines() == ["compiled"], "more than one process compiled"
    assert tags == ["loaded:c"] * 4  # the compiling process, too, runs the entry it wrote


# ---- the real mechanism: CuTe DSL export_to_c -> cutlass.runtime.load_module, no GPU needed ----


def _compile_trivial_kernel(cfg, *, jit_engine=True):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    @cute.kernel
    def scale_kernel(x: cute.Tensor, y: cute.Tensor, alpha: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < x.shape[0]:
            y[i] = (x[i].to(cutlass.Float32) * alpha).to(y.element_type)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, alpha: cutlass.Float32, stream):
        scale_kernel(x, y, alpha).launch(grid=[(x.shape[0] + 127) // 128, 1, 1], block=[128, 1, 1],
                                         stream=stream)

    n = cute.sym_int()
    x = make_fake_compact_tensor(cutlass.BFloat16, (n,), assumed_align=16)
    y = make_fake_compact_tensor(cutlass.BFloat16, (n,), assumed_align=16)
    return cute.compile(launch, x, y, cutlass.Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--enable-tvm-ffi --gpu-arch sm_90a", no_jit_engine=not jit_engine)


def test_real_dsl_export_and_load(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    tvm_ffi = pytest.importorskip("tvm_ffi")
    monkeypatch.setenv("FLASH_ATTN4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASH_ATTN4_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compile_cache.clear()
    try:
        cfg = Cfg("trivial-" + uuid.uuid4().hex[:8])
        fn = compile_cache.get_kernel("test", cfg, _compile_trivial_kernel)
        assert isinstance(fn, tvm_ffi.Function)  # compiled without an engine, then loaded from the entry
        path = compile_cache.entry_path("test", cfg.key())
        assert path.exists() and path.stat().st_size > 0
        assert path.read_bytes()[:4] == b"\x7fELF"
        compile_cache.clear()
        loaded = compile_cache.get_kernel("test", cfg, lambda c: pytest.fail("recompiled instead of loading"))
        assert isinstance(loaded, tvm_ffi.Function)
        assert compile_cache.stats()["disk_hits"] == 1
        # Running it needs a GPU (tests/gpu); here the load itself is what is checked.
    finally:
        compile_cache.clear()
