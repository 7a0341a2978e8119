"""An AMQP URI, as RabbitMQ's clients read it: ``amqp://user:pass@host:port/vhost``.

    amqp://                              guest:guest on localhost:5672, vhost /
    amqp://alice:s3cret@broker:5673/     vhost /  (an empty path is the default vhost, as pika reads it)
    amqp://alice:s3cret@broker/prod      vhost prod
    amqp://host/%2f                      vhost /  (percent-encoded, as every part may be)
    amqp://[::1]:5672                    an IPv6 literal in brackets

The user, password and vhost are percent-decoded. Only ``amqp`` is taken:
this load generator speaks no TLS, and a URI it cannot follow is refused
before anything starts (``InvalidLoadConfig``, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from pipeline.loadgen.config import InvalidLoadConfig

DEFAULT_PORT = 5672


@dataclass(frozen=True)
class BrokerAddress:
    host: str = "localhost"
    port: int = DEFAULT_PORT
    user: str = "guest"
    password: str = "guest"
    vhost: str = "/"

    def uri(self) -> str:
        """The URI again, with the password left out (for logs and run directories)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        vhost = "%2f" if self.vhost == "/" else self.vhost
        return f"amqp://{self.user}@{host}:{self.port}/{vhost}"


def parse_amqp_uri(text: str) -> BrokerAddress:
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise InvalidLoadConfig(f"--uri {text!r} is not an AMQP URI: {exc}") from None
    if parts.scheme == "amqps":
        raise InvalidLoadConfig(f"--uri {text!r}: amqps (TLS) is not spoken by this load generator; use amqp://")
    if parts.scheme != "amqp":
        raise InvalidLoadConfig(f"--uri {text!r} is not an AMQP URI (amqp://user:pass@host:port/vhost)")
    if parts.query or parts.fragment:
        raise InvalidLoadConfig(f"--uri {text!r}: query parameters are not taken; give the other options as flags")
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if "/" in path:
        raise InvalidLoadConfig(f"--uri {text!r}: a vhost named with '/' is written %2f")
    return BrokerAddress(host=parts.hostname or "localhost", port=port or DEFAULT_PORT,
                         user=unquote(parts.username) if parts.username is not None else "guest",
                         password=unquote(parts.password) if parts.password is not None else "guest",
                         vhost=unquote(path) or "/")
