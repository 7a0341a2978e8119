"""Memory watermark and disk free limit, read as RabbitMQ reads them (pure).

Theory of operation
-------------------
A limit is parsed once, into a frozen value that remembers how it was given,
and turned into bytes against the host's total memory whenever asked, so a
limit relative to RAM follows the RAM the watchdog measures.

Memory (``vm_memory_high_watermark``)::

    "0.6", 0.6, "relative 0.4"    fraction of total RAM: trunc(f * total)
    "0", "1"                      0 and 1 are fractions (0 means always alarmed)
    "1.5"                         clamped to 1.0, with RabbitMQ's warning
    "512MiB", "absolute 1GiB"     absolute size: min(n, total)
    "2048"                        a whole number above 1 is bytes

Disk (``disk_free_limit``)::

    "50MB", "70MiB", "2048"       absolute bytes
    "mem_relative:1.5", "1.5"     multiple of total RAM: round(f * total)

Sizes are whole numbers with an optional unit, spelled in the cases RabbitMQ
accepts: single letters and ``kB``/``MB``/``GB``/``TB`` are powers of 1000 (as
RabbitMQ since 3.13), ``Ki``/``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024.
A value that does not parse raises :class:`InvalidLimit` with a one-line
reason; the command line exits 2 with it rather than fall back to a default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from alarms.errors import InvalidLimit

DEFAULT_MEMORY_WATERMARK = 0.6
MAX_MEMORY_WATERMARK = 1.0
DEFAULT_DISK_FREE_LIMIT_BYTES = 50_000_000
MEMORY_POLL_INTERVAL_MS = 100


def _spellings(bytes_per_unit: int, *names: str) -> dict[str, int]:
    return {name: bytes_per_unit for name in names}


_UNIT_BYTES: dict[str, int] = {
    "": 1, "B": 1,
    **_spellings(1000, "k", "K", "kB", "KB", "kb", "Kb"),
    **_spellings(1000 ** 2, "m", "M", "MB", "mb", "Mb"),
    **_spellings(1000 ** 3, "g", "G", "GB", "gb", "Gb"),
    **_spellings(1000 ** 4, "t", "T", "TB", "tb", "Tb"),
    **_spellings(1000 ** 5, "p", "P", "PB", "pb", "Pb"),
    **_spellings(1024, "Ki", "ki", "kiB", "KiB", "kib", "KIB"),
    **_spellings(1024 ** 2, "Mi", "MiB", "mib", "MIB"),
    **_spellings(1024 ** 3, "Gi", "GiB", "gib", "GIB"),
    **_spellings(1024 ** 4, "Ti", "TiB", "tib", "TIB"),
    **_spellings(1024 ** 5, "Pi", "PiB", "pib", "PIB"),
}
_SIZE = re.compile(r"(\d+)([A-Za-z]*)")
_LOOSE_SIZE = re.compile(r"(\d*\.?\d+)(\s*)([A-Za-z]+)")     # what a size was probably meant to be
_DECIMAL = re.compile(r"\+?(\d+\.\d*|\.\d+|\d+[eE][-+]?\d+|\d+\.\d*[eE][-+]?\d+)")
_WHOLE = re.compile(r"\d+")
# "absolute 1GiB", "absolute:1GiB", '{absolute, "1GiB"}', and the same for relative / mem_relative
_KEYWORD = re.compile(r"\{?\s*(absolute|relative|mem_relative)\s*[\s,:]\s*\"?([^\"}]*?)\"?\s*\}?", re.IGNORECASE)
_UNITS_HINT = "(use kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
_MEMORY_FORMS = "a fraction of RAM from 0 to 1.0 such as 0.6, or a size such as 512MiB or 'absolute 1GiB'"
_DISK_FORMS = "a size such as 50MB or 70MiB, or a multiple of RAM such as mem_relative:1.5"


def parse_size(text) -> int:
    """Bytes in "50MB", "70MiB", "1GiB", "2048"; a non-negative int is taken as is."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidLimit(f"invalid size {text}: must not be negative")
        return text
    m = _SIZE.fullmatch(str(text).strip())
    if m is None:
        loose = _LOOSE_SIZE.fullmatch(str(text).strip())
        if loose is not None and loose.group(3) not in _UNIT_BYTES:
            reason = f"unknown unit {loose.group(3)!r} {_UNITS_HINT}"
        elif loose is not None and "." in loose.group(1):
            reason = "a size is a whole number, such as 1536MiB rather than 1.5GiB"
        elif loose is not None:
            reason = "write the unit right after the number, such as 50MB"
        else:
            reason = "expected a whole number of bytes with an optional unit, such as 50MB or 512MiB"
        raise InvalidLimit(f"invalid size {str(text)!r}: {reason}")
    if m.group(2) not in _UNIT_BYTES:
        raise InvalidLimit(f"invalid size {str(text)!r}: unknown unit {m.group(2)!r} {_UNITS_HINT}")
    return int(m.group(1)) * _UNIT_BYTES[m.group(2)]


@dataclass(frozen=True)
class MemoryLimit:
    """The memory high watermark: exactly one of a fraction of RAM or an absolute size."""

    relative: float | None = None
    absolute_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.relative is None) == (self.absolute_bytes is None):
            raise InvalidLimit("invalid memory watermark: give either a fraction of RAM or an absolute size")
        if self.relative is not None and not 0.0 <= self.relative <= MAX_MEMORY_WATERMARK:
            raise InvalidLimit(f"invalid memory watermark {self.relative}: a fraction must be from 0 to 1.0")
        if self.absolute_bytes is not None and self.absolute_bytes < 0:
            raise InvalidLimit(f"invalid memory watermark {self.absolute_bytes}: must not be negative")

    def bytes_for(self, total_bytes: int) -> int:
        """The limit in bytes on a host with ``total_bytes`` of RAM (never more than the RAM)."""
        if self.absolute_bytes is not None:
            return min(self.absolute_bytes, total_bytes)
        return math.trunc(self.relative * total_bytes)

    def __str__(self) -> str:
        return f"absolute {self.absolute_bytes}" if self.absolute_bytes is not None else f"{self.relative}"


def parse_memory_watermark(value) -> tuple[MemoryLimit, list[str]]:
    """The watermark in ``value`` and the warnings to log (RabbitMQ's wording when a fraction is clamped)."""
    if isinstance(value, bool):
        raise InvalidLimit(f"invalid memory watermark {value!r}: expected {_MEMORY_FORMS}")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, float):
        return _relative_watermark(value, repr(value))
    text = str(value).strip()
    keyword = _KEYWORD.fullmatch(text)
    if keyword is not None:
        kind, rest = keyword.group(1).lower(), keyword.group(2).strip()
        if kind == "absolute":
            return MemoryLimit(absolute_bytes=_size_in(rest, text, "memory watermark")), []
        if kind == "relative":
            return _relative_watermark(_fraction_in(rest, text, "memory watermark", _MEMORY_FORMS), text)
        raise InvalidLimit(f"invalid memory watermark {text!r}: mem_relative is a disk free limit form; "
                           f"expected {_MEMORY_FORMS}")
    if _WHOLE.fullmatch(text):
        number = int(text)
        if number <= MAX_MEMORY_WATERMARK:
            return MemoryLimit(relative=float(number)), []
        return MemoryLimit(absolute_bytes=number), []
    if _DECIMAL.fullmatch(text):
        return _relative_watermark(float(text), text)
    if _LOOSE_SIZE.fullmatch(text):
        return MemoryLimit(absolute_bytes=_size_in(text, text, "memory watermark")), []
    raise InvalidLimit(f"invalid memory watermark {text!r}: expected {_MEMORY_FORMS}")


def _relative_watermark(fraction: float, text: str) -> tuple[MemoryLimit, list[str]]:
    if not math.isfinite(fraction) or fraction < 0:
        raise InvalidLimit(f"invalid memory watermark {text!r}: expected {_MEMORY_FORMS}")
    if fraction > MAX_MEMORY_WATERMARK:
        warning = (f"Memory high watermark of {fraction} is above the allowed maximum, falling back to "
                   f"{MAX_MEMORY_WATERMARK}")
        return MemoryLimit(relative=MAX_MEMORY_WATERMARK), [warning]
    return MemoryLimit(relative=fraction), []


@dataclass(frozen=True)
class DiskLimit:
    """The disk free limit: exactly one of an absolute size or a multiple of total RAM."""

    absolute_bytes: int | None = None
    mem_relative: float | None = None

    def __post_init__(self) -> None:
        if (self.absolute_bytes is None) == (self.mem_relative is None):
            raise InvalidLimit("invalid disk free limit: give either an absolute size or mem_relative")
        if self.mem_relative is not None and not (math.isfinite(self.mem_relative) and self.mem_relative >= 0):
            raise InvalidLimit(f"invalid disk free limit mem_relative {self.mem_relative}: must be 0 or more")
        if self.absolute_bytes is not None and self.absolute_bytes < 0:
            raise InvalidLimit(f"invalid disk free limit {self.absolute_bytes}: must not be negative")

    def bytes_for(self, total_memory_bytes: int) -> int:
        """The limit in bytes on a host with ``total_memory_bytes`` of RAM."""
        if self.absolute_bytes is not None:
            return self.absolute_bytes
        return round(self.mem_relative * total_memory_bytes)

    def __str__(self) -> str:
        return f"{self.absolute_bytes}" if self.absolute_bytes is not None else f"mem_relative:{self.mem_relative}"


def parse_disk_free_limit(value) -> DiskLimit:
    """The disk free limit in ``value``: "50MB", "70MiB", 2048, "mem_relative:1.5" or a bare fraction "1.5"."""
    if isinstance(value, bool):
        raise InvalidLimit(f"invalid disk free limit {value!r}: expected {_DISK_FORMS}")
    if isinstance(value, float):
        return DiskLimit(mem_relative=_fraction_in(repr(value), repr(value), "disk free limit", _DISK_FORMS))
    text = str(value).strip()
    keyword = _KEYWORD.fullmatch(text)
    if keyword is not None:
        kind, rest = keyword.group(1).lower(), keyword.group(2).strip()
        if kind == "mem_relative":
            return DiskLimit(mem_relative=_fraction_in(rest, text, "disk free limit", _DISK_FORMS))
        if kind == "absolute":
            return DiskLimit(absolute_bytes=_size_in(rest, text, "disk free limit"))
        raise InvalidLimit(f"invalid disk free limit {text!r}: expected {_DISK_FORMS}")
    if _DECIMAL.fullmatch(text):
        return DiskLimit(mem_relative=_fraction_in(text, text, "disk free limit", _DISK_FORMS))
    if _WHOLE.fullmatch(text) or _LOOSE_SIZE.fullmatch(text):
        return DiskLimit(absolute_bytes=_size_in(text, text, "disk free limit"))
    raise InvalidLimit(f"invalid disk free limit {text!r}: expected {_DISK_FORMS}")


def _size_in(part: str, text: str, what: str) -> int:
    try:
        return parse_size(part)
    except InvalidLimit as exc:
        reason = str(exc).split(": ", 1)[1]
        raise InvalidLimit(f"invalid {what} {text!r}: {reason}") from None


def _fraction_in(part: str, text: str, what: str, forms: str) -> float:
    if not _DECIMAL.fullmatch(part) and not _WHOLE.fullmatch(part):
        raise InvalidLimit(f"invalid {what} {text!r}: expected {forms}")
    fraction = float(part)
    if not math.isfinite(fraction):
        raise InvalidLimit(f"invalid {what} {text!r}: expected {forms}")
    return fraction
