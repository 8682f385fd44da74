"""Host and Origin allow-lists: which names a request's ``Host`` may carry and which
browser origins may call the API cross-origin.

Parsed with the other flags (``--allowed-hosts``, ``--allowed-origins``: a bad
entry is refused at start, naming the flag) and applied to every request by
the front's guard (``runtime/front/guard.py``). Pure string and address logic.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Sequence

ANY = "*"
DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` value (``name[:port]``, ``[v6]:port``) as (host, port), the host
    lower-cased without brackets or a trailing dot; None when malformed."""
    value = value.strip()
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    else:
        host, _, port_text = value.partition(":")
    port = None
    if port_text:
        if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
            return None
        port = int(port_text)
    host = host.lower().removesuffix(".")
    return (host, port) if host else None


def canonical_origin(text: str) -> str | None:
    """``scheme://host[:port]`` spelled one way (lower case, default port dropped),
    or None when ``text`` is not an origin (``null``, a path, credentials)."""
    try:
        parts = urllib.parse.urlsplit(text.strip())
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return None
    if (
        not parts.scheme
        or not parts.netloc
        or "@" in parts.netloc
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        return None
    hostport = split_host(parts.netloc)
    if hostport is None:
        return None
    host, port = hostport
    scheme = parts.scheme.lower()
    shown = f"[{host}]" if ":" in host else host
    if port == DEFAULT_PORTS.get(scheme):
        port = None
    return f"{scheme}://{shown}" + ("" if port is None else f":{port}")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _normal(host: str) -> str:
    """A host as compared: an IP address in its one compressed spelling, a name as is."""
    ip = _ip(host)
    return host if ip is None else ip.compressed


def _host_entry(text: str) -> str:
    """One ``--allowed-hosts`` entry, normalized: ``*``, a name (a leading dot: it
    and its subdomains) or an IP address; ValueError naming the flag otherwise."""
    entry = text.strip().lower()
    if entry == ANY:
        return ANY
    name = entry[1:-1] if entry.startswith("[") and entry.endswith("]") else entry
    if _ip(name) is not None:
        return _normal(name)
    name = name.removesuffix(".")
    if name.strip(".") and set(name) <= _HOST_CHARS and ".." not in name:
        return name
    raise ValueError(
        f"--allowed-hosts {text!r}: give a host name (.example.com: it and its subdomains), "
        "an IP address or '*', without scheme or port"
    )


def _origin_entry(text: str) -> str:
    """One ``--allowed-origins`` entry, canonical; ValueError naming the flag otherwise."""
    if text.strip() == ANY:
        return ANY
    origin = canonical_origin(text)
    if origin is None:
        raise ValueError(
            f"--allowed-origins {text!r}: give an origin (scheme://host[:port], e.g. "
            "http://localhost:3000) or '*'"
        )
    return origin


def is_wildcard_address(host: str) -> bool:
    """``--host`` 0.0.0.0 or :: (every interface): the server cannot know its names."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == ""


class HostAllowList:
    """The hosts a request's ``Host`` may name: ``localhost`` and its subdomains,
    loopback addresses, the bind address and ``--allowed-hosts``.

    Bound to every interface (0.0.0.0, ::) with no ``--allowed-hosts``, any
    Host is served: the server cannot know the names clients reach it by.
    """

    def __init__(self, bind_host: str, allowed: Sequence[str]) -> None:
        entries = [_host_entry(e) for e in allowed]
        self.any = ANY in entries or (is_wildcard_address(bind_host) and not entries)
        self.bound_to_all = is_wildcard_address(bind_host)
        names = {"localhost", ".localhost", *entries}
        bound = bind_host.strip().strip("[]").lower().removesuffix(".")
        if bound:
            names.add(_normal(bound))
        self.exact = frozenset(n.lstrip(".") for n in names if n != ANY)
        self.suffixes = tuple(n for n in names if n.startswith("."))

    def allows(self, host: str) -> bool:
        """Whether ``host`` (as :func:`split_host` gives it) may be served."""
        if self.any or _normal(host) in self.exact or host.endswith(self.suffixes):
            return True
        ip = _ip(host)
        return ip is not None and ip.is_loopback


class OriginAllowList:
    """The browser origins (``--allowed-origins``) that may call the API cross-origin."""

    def __init__(self, allowed: Sequence[str]) -> None:
        entries = {_origin_entry(e) for e in allowed}
        self.any = ANY in entries
        self.origins = frozenset(entries - {ANY})

    def allows(self, origin: str | None) -> bool:
        """Whether a canonical origin (None: not an origin, e.g. ``null``) is allowed."""
        return self.any or (origin is not None and origin in self.origins)


def check_flags(
    bind_host: str, allowed_hosts: Sequence[str], allowed_origins: Sequence[str]
) -> None:
    """ValueError naming the flag when an ``--allowed-hosts`` / ``--allowed-origins``
    entry cannot be parsed (checked with the other flags, at start)."""
    HostAllowList(bind_host, allowed_hosts)
    OriginAllowList(allowed_origins)
