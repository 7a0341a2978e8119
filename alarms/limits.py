"""Memory watermark and disk free limit, parsed as RabbitMQ reads them (pure).

Memory: a fraction of total RAM ("0.6"; above 1.0 it is clamped to 1.0 with
RabbitMQ's warning) or an absolute size with units ("512MiB", "50MB",
"absolute 1GiB"); 0 means always alarmed. Disk: an absolute size ("50MB",
"70MiB") or a multiple of total RAM ("mem_relative:1.5", or a bare "1.5").
Bad values are refused with a one-line reason; the command line exits 2 on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from alarms.errors import InvalidLimit

DEFAULT_MEMORY_WATERMARK = 0.6
MAX_MEMORY_WATERMARK = 1.0
DEFAULT_DISK_FREE_LIMIT_BYTES = 50_000_000
MEMORY_POLL_INTERVAL_MS = 100

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text) -> int:
    """Bytes in "50MB", "70MiB", "2048", "1.5GiB" (kB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise InvalidLimit(f"invalid size {text!r}: expected a number with an optional unit such as MB or MiB")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise InvalidLimit(f"invalid size {text!r}: unknown unit {m.group(2)!r} (use kB, MB, GB, KiB, MiB, GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class MemoryLimit:
    relative: float | None = None
    absolute_bytes: int | None = None

    def bytes_for(self, total_bytes: int) -> int:
        if self.absolute_bytes is not None:
            return min(self.absolute_bytes, total_bytes)
        return int(self.relative * total_bytes)

    def __str__(self) -> str:
        return f"{self.absolute_bytes} bytes" if self.absolute_bytes is not None else f"{self.relative}"


def parse_memory_watermark(value) -> tuple[MemoryLimit, list[str]]:
    """The limit and any warnings (RabbitMQ's wording for a clamped value)."""
    text = str(value).strip()
    if text.lower().startswith("absolute"):
        return MemoryLimit(absolute_bytes=parse_size(text[len("absolute"):].strip(" :"))), []
    try:
        fraction = float(text)
    except ValueError:
        return MemoryLimit(absolute_bytes=parse_size(text)), []
    if re.fullmatch(r"\d+", text) and fraction > MAX_MEMORY_WATERMARK:
        return MemoryLimit(absolute_bytes=int(text)), []
    if fraction != fraction or fraction < 0:
        raise InvalidLimit(f"invalid memory watermark {text!r}: expected a fraction of RAM between 0 and 1.0 "
                           "or an absolute size such as 512MiB")
    if fraction > MAX_MEMORY_WATERMARK:
        return (MemoryLimit(relative=MAX_MEMORY_WATERMARK),
                [f"Memory high watermark of {fraction} is above the allowed maximum, falling back to "
                 f"{MAX_MEMORY_WATERMARK}"])
    return MemoryLimit(relative=fraction), []


@dataclass(frozen=True)
class DiskLimit:
    absolute_bytes: int | None = None
    mem_relative: float | None = None

    def bytes_for(self, total_memory_bytes: int) -> int:
        if self.absolute_bytes is not None:
            return self.absolute_bytes
        return round(self.mem_relative * total_memory_bytes)

    def __str__(self) -> str:
        return f"{self.absolute_bytes} bytes" if self.absolute_bytes is not None else f"{self.mem_relative} x RAM"


def parse_disk_free_limit(value) -> DiskLimit:
    text = str(value).strip()
    low = text.lower()
    for prefix in ("mem_relative:", "mem_relative ", "{mem_relative,"):
        if low.startswith(prefix):
            text = text[len(prefix):].strip(" }")
            return DiskLimit(mem_relative=_fraction(text, value))
    if re.fullmatch(r"\d+\.\d+", text):
        return DiskLimit(mem_relative=_fraction(text, value))
    return DiskLimit(absolute_bytes=parse_size(text))


def _fraction(text: str, original) -> float:
    try:
        f = float(text)
    except ValueError:
        raise InvalidLimit(f"invalid disk free limit {original!r}: expected a size such as 50MB or a "
                           "multiple of RAM such as mem_relative:1.5") from None
    if f < 0:
        raise InvalidLimit(f"invalid disk free limit {original!r}: must not be negative")
    return f
