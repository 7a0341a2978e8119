"""AMQP names (queues, exchanges) as file names: any name RabbitMQ accepts maps to a safe one.

RabbitMQ takes any UTF-8 string of up to 255 bytes as a queue or exchange
name: ``.``, ``..``, ``/``, ``%``, ``!``, spaces and non-ASCII included. A
file name must not be ``.`` or ``..``, hold ``/`` or NUL, or exceed 255
bytes, so a name is never used as a path as it stands. ``file_name`` keeps
up to ``READABLE_CHARS`` of the name's plain characters for whoever lists
the directory and appends a hash of the whole name, so distinct names never
share a file and the result is always short and safe.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse

MAX_NAME_BYTES = 255
READABLE_CHARS = 40
HASH_HEX_CHARS = 16
_PLAIN = re.compile(r"[^A-Za-z0-9_-]")


class BadName(ValueError):
    """Raised when a name is not one RabbitMQ accepts (not UTF-8, or longer than 255 bytes)."""


def check(name: str) -> str:
    """``name`` if RabbitMQ would accept it as a queue or exchange name, else ``BadName``."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadName(f"name {name!r} is not valid UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise BadName(f"name of {size} bytes is longer than {MAX_NAME_BYTES}")
    return name


def file_name(name: str) -> str:
    """A file or directory name for ``name``: plain characters, a dash, a hash; never ``.``/``..``."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=HASH_HEX_CHARS // 2)
    return f"{_PLAIN.sub('_', name)[:READABLE_CHARS]}-{digest.hexdigest()}"


def legacy_file_name(name: str) -> str | None:
    """The name earlier versions used (the percent-quoted name), where it was a usable one."""
    quoted = urllib.parse.quote(name, safe="")
    if quoted in ("", ".", "..") or len(quoted.encode()) > MAX_NAME_BYTES:
        return None
    return quoted
