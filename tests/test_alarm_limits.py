"""Memory watermarks and disk free limits are read as RabbitMQ reads them, and bad ones are refused."""

from __future__ import annotations

import pytest

from alarms.errors import AlarmError, InvalidLimit
from alarms.limits import (DEFAULT_DISK_FREE_LIMIT_BYTES, DEFAULT_MEMORY_WATERMARK, MEMORY_POLL_INTERVAL_MS,
                           DiskLimit, MemoryLimit, parse_disk_free_limit, parse_memory_watermark, parse_size)

KIB, MIB, GIB, TIB = 1024, 1024 ** 2, 1024 ** 3, 1024 ** 4


def test_defaults_are_rabbitmqs_except_the_faster_memory_poll():
    assert DEFAULT_MEMORY_WATERMARK == 0.6
    assert DEFAULT_DISK_FREE_LIMIT_BYTES == 50_000_000
    assert MEMORY_POLL_INTERVAL_MS == 100


@pytest.mark.parametrize("text, size", [
    ("2048", 2048), (2048, 2048), ("0", 0), ("10B", 10),
    ("1kB", 1000), ("1KB", 1000), ("1kb", 1000), ("1Kb", 1000), ("1k", 1000), ("1K", 1000),
    ("50MB", 50_000_000), ("50mb", 50_000_000), ("50Mb", 50_000_000), ("50M", 50_000_000),
    ("2GB", 2_000_000_000), ("2G", 2_000_000_000), ("3TB", 3 * 10 ** 12), ("3T", 3 * 10 ** 12),
    ("1KiB", KIB), ("1kiB", KIB), ("1kib", KIB), ("1KIB", KIB), ("1Ki", KIB), ("1ki", KIB),
    ("70MiB", 73_400_320), ("70mib", 73_400_320), ("70MIB", 73_400_320), ("70Mi", 73_400_320),
    ("1GiB", GIB), ("1gib", GIB), ("1Gi", GIB), ("2TiB", 2 * TIB), ("2Ti", 2 * TIB),
    (" 50MB ", 50_000_000),
])
def test_sizes_in_every_spelling_rabbitmq_accepts(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text, reason", [
    ("1.5GiB", "whole number"), ("5furlongs", "unknown unit 'furlongs'"), ("50 MB", "right after the number"),
    ("12 parsecs", "unknown unit 'parsecs'"), ("mB", "expected a whole number"), ("-5MB", "expected a whole number"),
    ("", "expected a whole number"), ("5mIB", "unknown unit 'mIB'"), (-1, "must not be negative"),
])
def test_bad_sizes_are_refused_with_the_reason(text, reason):
    with pytest.raises(InvalidLimit, match=reason):
        parse_size(text)


@pytest.mark.parametrize("value, limit", [
    ("0.4", MemoryLimit(relative=0.4)), (0.6, MemoryLimit(relative=0.6)), (".5", MemoryLimit(relative=0.5)),
    ("0", MemoryLimit(relative=0.0)), ("1", MemoryLimit(relative=1.0)), (1, MemoryLimit(relative=1.0)),
    ("1.0", MemoryLimit(relative=1.0)), ("relative 0.3", MemoryLimit(relative=0.3)),
    ("{relative, 0.3}", MemoryLimit(relative=0.3)),
    ("512MiB", MemoryLimit(absolute_bytes=512 * MIB)), ("50MB", MemoryLimit(absolute_bytes=50_000_000)),
    ("1GB", MemoryLimit(absolute_bytes=1_000_000_000)), ("2048", MemoryLimit(absolute_bytes=2048)),
    (2048, MemoryLimit(absolute_bytes=2048)), ("absolute 1GiB", MemoryLimit(absolute_bytes=GIB)),
    ("absolute:1GiB", MemoryLimit(absolute_bytes=GIB)), ('{absolute, "1024MiB"}', MemoryLimit(absolute_bytes=GIB)),
    ("ABSOLUTE 2048", MemoryLimit(absolute_bytes=2048)),
])
def test_memory_watermarks_relative_or_absolute(value, limit):
    assert parse_memory_watermark(value) == (limit, [])


@pytest.mark.parametrize("value, shown", [("1.5", "1.5"), (1.5, "1.5"), ("1.01", "1.01"), ("relative 3.0", "3.0")])
def test_a_fraction_above_one_is_clamped_with_rabbitmqs_warning(value, shown):
    limit, warnings = parse_memory_watermark(value)
    assert limit == MemoryLimit(relative=1.0)
    assert warnings == [f"Memory high watermark of {shown} is above the allowed maximum, falling back to 1.0"]


@pytest.mark.parametrize("value, reason", [
    ("lots", "invalid memory watermark 'lots': expected a fraction of RAM"),
    ("-0.2", "invalid memory watermark '-0.2'"), ("nan", "invalid memory watermark 'nan'"),
    (float("nan"), "invalid memory watermark 'nan'"), (float("inf"), "invalid memory watermark 'inf'"),
    ("1e400", "invalid memory watermark '1e400'"), (-0.5, "invalid memory watermark '-0.5'"),
    ("", "invalid memory watermark ''"), ("absolute", "invalid memory watermark 'absolute'"),
    ("absolute 1.5GB", "whole number"), ("12 parsecs", "unknown unit 'parsecs'"),
    ("mem_relative:0.5", "mem_relative is a disk free limit form"), (True, "invalid memory watermark True"),
])
def test_invalid_watermarks_are_refused_not_replaced(value, reason):
    with pytest.raises(InvalidLimit, match=reason) as info:
        parse_memory_watermark(value)
    assert "\n" not in str(info.value)                  # one line, for the command line's exit-2 message
    assert isinstance(info.value, AlarmError) and isinstance(info.value, ValueError)


def test_memory_limit_in_bytes_truncates_and_never_exceeds_the_ram():
    assert MemoryLimit(relative=0.5).bytes_for(1001) == 500
    assert MemoryLimit(relative=0.6).bytes_for(25_276_514_304) == 15_165_908_582
    assert MemoryLimit(relative=0.0).bytes_for(GIB) == 0
    assert MemoryLimit(absolute_bytes=10 * GIB).bytes_for(GIB) == GIB
    assert MemoryLimit(absolute_bytes=MIB).bytes_for(GIB) == MIB


def test_a_limit_holds_exactly_one_form():
    with pytest.raises(InvalidLimit, match="either"):
        MemoryLimit()
    with pytest.raises(InvalidLimit, match="either"):
        MemoryLimit(relative=0.5, absolute_bytes=10)
    with pytest.raises(InvalidLimit, match="from 0 to 1.0"):
        MemoryLimit(relative=1.5)
    with pytest.raises(InvalidLimit, match="either"):
        DiskLimit(absolute_bytes=1, mem_relative=1.0)


@pytest.mark.parametrize("value, limit", [
    ("50MB", DiskLimit(absolute_bytes=50_000_000)), ("70MiB", DiskLimit(absolute_bytes=73_400_320)),
    ("2GB", DiskLimit(absolute_bytes=2_000_000_000)), ("2048", DiskLimit(absolute_bytes=2048)),
    (2048, DiskLimit(absolute_bytes=2048)), ("1", DiskLimit(absolute_bytes=1)),
    ("1000000TB", DiskLimit(absolute_bytes=10 ** 18)), ("absolute 1GB", DiskLimit(absolute_bytes=10 ** 9)),
    ("1.5", DiskLimit(mem_relative=1.5)), (1.5, DiskLimit(mem_relative=1.5)),
    ("mem_relative:1.5", DiskLimit(mem_relative=1.5)), ("mem_relative 2", DiskLimit(mem_relative=2.0)),
    ("{mem_relative, 1.0}", DiskLimit(mem_relative=1.0)),
])
def test_disk_free_limits_absolute_or_relative_to_ram(value, limit):
    assert parse_disk_free_limit(value) == limit


def test_disk_limit_in_bytes_rounds_a_multiple_of_ram():
    assert parse_disk_free_limit("mem_relative:1.5").bytes_for(1001) == 1502      # round(1501.5), as RabbitMQ
    assert parse_disk_free_limit("1.5").bytes_for(8 * GIB) == 12 * GIB
    assert parse_disk_free_limit("50MB").bytes_for(1) == 50_000_000               # absolute ignores the RAM


@pytest.mark.parametrize("value, reason", [
    ("5 furlongs", "unknown unit 'furlongs'"), ("-1MB", "invalid disk free limit '-1MB'"),
    ("mem_relative:x", "invalid disk free limit 'mem_relative:x'"), ("mem_relative:-1", "mem_relative:-1"),
    ("1.5.5", "invalid disk free limit '1.5.5'"), ("relative 0.5", "expected a size"),
    (float("inf"), "invalid disk free limit 'inf'"), ("1.5GB", "whole number"),
])
def test_invalid_disk_free_limits_are_refused(value, reason):
    with pytest.raises(InvalidLimit, match=reason):
        parse_disk_free_limit(value)
