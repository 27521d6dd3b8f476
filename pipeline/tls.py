"""The TLS options of a Redis URL, checked before connecting.

`rediss://host:port/0?ssl_ca_certs=ca.pem&ssl_certfile=client.pem&ssl_keyfile=client.key&ssl_cert_reqs=required`
hands its `ssl_*` query parameters to redis-py's SSLConnection. Unchecked, a
misspelt option is a TypeError traceback, a missing file an error that names no
file, and an option on a `redis://` URL a TypeError at the first command.
"""
from __future__ import annotations

import inspect
import os
from urllib.parse import parse_qs, urlsplit

from redis.connection import SSLConnection

#: Every keyword SSLConnection takes: ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs, ...
OPTIONS = tuple(p for p in inspect.signature(SSLConnection.__init__).parameters if p.startswith("ssl_"))
#: Options naming a file (or, ssl_ca_path, a directory) that must exist before connecting.
PATH_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")
CERT_REQS = ("none", "optional", "required")


def check_tls_options(url: str) -> None:
    """Raise ValueError naming the first TLS option of `url` that cannot work."""
    parts = urlsplit(url)
    for name, values in parse_qs(parts.query).items():
        if not name.startswith("ssl_"):
            continue
        value = values[0]
        if name not in OPTIONS:
            raise ValueError(f"unknown TLS option {name!r}: use {', '.join(OPTIONS)}")
        if parts.scheme != "rediss":
            raise ValueError(f"TLS option {name} needs a rediss:// URL, not {parts.scheme}://")
        if name in PATH_OPTIONS and not os.path.exists(value):
            raise ValueError(f"{name}: no such file {value!r}")
        if name == "ssl_cert_reqs" and value.lower() not in CERT_REQS:
            raise ValueError(f"ssl_cert_reqs={value!r}: use {', '.join(CERT_REQS)}")
