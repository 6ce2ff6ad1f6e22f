"""Every environment override of flash-attn4, in one place.

Each value is read from ``os.environ`` when the function below is called (never cached at import),
so a change made by a running program takes effect on the next call.

==================================  =========  ===============================================================
variable                            default    effect
==================================  =========  ===============================================================
``FLASH_ATTN4_CACHE_DIR``           (unset)    folder of the on-disk kernel cache; unset: ``$XDG_CACHE_HOME/
                                               flash_attn4``, or ``~/.cache/flash_attn4`` without XDG_CACHE_HOME
``FLASH_ATTN4_DISABLE_DISK_CACHE``  ``0``      ``1``/``true``/``yes``/``on``: never read or write compiled
                                               kernels on disk (the in-process cache stays on)
``FLASH_ATTN4_DISABLE_AOT``         ``0``      ``1``/``true``/``yes``/``on``: ignore the kernels shipped
                                               precompiled with the package (``aot``); lookups go memory
                                               -> disk cache -> compile
``FLASH_ATTN4_AOT_DIR``             (unset)    folder of the precompiled kernel set (``scripts/build_aot.py
                                               --out``); unset: the ``aot`` folder inside the package
``FLASH_ATTN4_CHECK_CU_SEQLENS``    ``0``      ``1``: check the *values* of cu_seqlens (start at 0,
                                               non-decreasing, end at the total) and seqused_k (within
                                               range) on every varlen call, and flash_attn_with_kvcache's
                                               cache_seqlens/cache_batch_idx/cache_leftpad (in range of
                                               the cache, before the append). Costs a device sync per
                                               call; skipped while a CUDA graph is being captured.
                                               Shape, dtype and device are always checked (free).
``FLASH_ATTN4_LOG_LEVEL``           (unset)    level of the ``flash_attn4`` logger (``DEBUG``, ``INFO``,
                                               ``WARNING``, ... or a number; a stderr handler is added
                                               when no handler is configured). Unset: the logger is
                                               left alone, i.e. quiet except for warnings.
``FLASH_ATTN4_SLOW_COMPILE_S``      ``1.0``    a kernel compile taking at least this many seconds is
                                               logged at WARNING (visible by default); faster ones at INFO
``FLASH_ATTN4_SELF_CHECK``          (unset)    first-use self-check of a compiled kernel against a PyTorch
                                               reference (``selfcheck``). Unset (or ``auto``): only on
                                               architectures we have not run ourselves
                                               (``selfcheck.UNVERIFIED_ARCHS``: sm_100 family).
                                               ``1``/``true``/``yes``/``on``: on every architecture.
                                               ``0``/``false``/``no``/``off``: never, at your own risk.
                                               Read when a kernel configuration is first used on a
                                               device; the decision then holds for that configuration
                                               for the process. A failed check raises RuntimeError
                                               (never wrong numbers) on every call until turned off.
==================================  =========  ===============================================================

Where these are read inside ``torch.compile``-d code they would be frozen at trace time, so they are
only read in eager code: the op implementation (which a compiled graph calls for real) and the compile cache.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

LOGGER_NAME = "flash_attn4"

CACHE_DIR = "FLASH_ATTN4_CACHE_DIR"
DISABLE_DISK_CACHE = "FLASH_ATTN4_DISABLE_DISK_CACHE"
DISABLE_AOT = "FLASH_ATTN4_DISABLE_AOT"
AOT_DIR = "FLASH_ATTN4_AOT_DIR"
CHECK_CU_SEQLENS = "FLASH_ATTN4_CHECK_CU_SEQLENS"
LOG_LEVEL = "FLASH_ATTN4_LOG_LEVEL"
SLOW_COMPILE_S = "FLASH_ATTN4_SLOW_COMPILE_S"
SELF_CHECK = "FLASH_ATTN4_SELF_CHECK"

ALL = (CACHE_DIR, DISABLE_DISK_CACHE, DISABLE_AOT, AOT_DIR, CHECK_CU_SEQLENS, LOG_LEVEL, SLOW_COMPILE_S, SELF_CHECK)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {_TRUE + _FALSE[1:]}")


def cache_dir() -> Path:
    """Folder of the on-disk kernel cache (not created here)."""
    explicit = os.environ.get(CACHE_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flash_attn4"


def disk_cache_enabled() -> bool:
    return not _flag(DISABLE_DISK_CACHE)


def aot_disabled() -> bool:
    return _flag(DISABLE_AOT)


def aot_dir() -> Path | None:
    """FLASH_ATTN4_AOT_DIR, or None for the package's own shipped set."""
    explicit = os.environ.get(AOT_DIR, "").strip()
    return Path(explicit).expanduser() if explicit else None


def check_cu_seqlens() -> bool:
    return _flag(CHECK_CU_SEQLENS)


def self_check() -> bool | None:
    """FLASH_ATTN4_SELF_CHECK: True (on everywhere), False (off), None (unset/auto: the default,
    unverified architectures only)."""
    raw = os.environ.get(SELF_CHECK, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{SELF_CHECK}={os.environ[SELF_CHECK]!r}: expected unset, 'auto', one of {_TRUE} (on "
                     f"every architecture) or one of {_FALSE[1:]} (off)")


def slow_compile_seconds() -> float:
    raw = os.environ.get(SLOW_COMPILE_S, "").strip()
    if not raw:
        return 1.0
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{SLOW_COMPILE_S}={raw!r}: expected a number of seconds") from None


def log_level() -> int | None:
    """The requested level of the flash_attn4 logger, or None when not set."""
    raw = os.environ.get(LOG_LEVEL, "").strip()
    if not raw:
        return None
    if raw.lstrip("-").isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL}={raw!r}: expected DEBUG, INFO, WARNING, ERROR or a number")
    return level


def get_logger() -> logging.Logger:
    """The package logger, with FLASH_ATTN4_LOG_LEVEL applied (read now)."""
    logger = logging.getLogger(LOGGER_NAME)
    level = log_level()
    if level is not None:
        if logger.level != level:
            logger.setLevel(level)
        # Python's last-resort handler prints WARNING and above only: asking for a level means
        # wanting to see it, so give the logger a stderr handler unless the application set one up.
        if not logger.handlers and not _has_configured_ancestor(logger):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[flash_attn4 %(levelname)s] %(message)s"))
            logger.addHandler(handler)
    return logger


def _has_configured_ancestor(logger: logging.Logger) -> bool:
    parent = logger.parent
    while parent is not None:
        if parent.handlers:
            return True
        parent = parent.parent
    return False
