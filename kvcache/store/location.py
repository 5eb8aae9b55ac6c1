"""Where a prefix store lives, as a user writes it: a directory path or a Redis URL.

One parser for every entry point (`open_store`, the command line), so an unknown scheme is an
error everywhere instead of a directory named `http:`, and one redaction rule, so a password in a
URL is never printed (status lines, warnings, errors).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from ..errors import CacheInputError

#: URL schemes of a Redis server (`redis-py`'s `from_url` takes these); `+cluster` asks for a
#: Redis Cluster client (the URL names any one node).
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def redact(where: str) -> str:
    """`where` with any password (and user name) in a URL replaced by `***`."""
    match = _SCHEME.match(where)
    if match is None:
        return where
    try:
        parts = urlsplit(where)
    except ValueError:
        return f"{match.group(1)}://***"
    if parts.username is None and parts.password is None:
        if not re.search(r"(?i)password=", parts.query):
            return where
        return urlunsplit(parts._replace(query=re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)))
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit(parts._replace(netloc=f"***@{host}", query=query))


def kind_of_location(where: object) -> str:
    """"redis" or "directory" for a store location; `CacheInputError` for anything else (an unknown
    URL scheme, an empty string, not a str)."""
    if not isinstance(where, str) or not where:
        raise CacheInputError(f"a prefix store location is a directory path or a Redis URL, got {where!r}")
    match = _SCHEME.match(where)
    if match is None:
        return "directory"
    scheme = match.group(1).lower()
    if scheme in REDIS_SCHEMES:
        return "redis"
    raise CacheInputError(
        f"unknown prefix store URL scheme {scheme!r} in {redact(where)!r}: a store is a directory path or a URL "
        f"of {', '.join(s + '://' for s in REDIS_SCHEMES)}"
    )
