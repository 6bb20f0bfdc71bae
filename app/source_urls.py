"""Stream source URLs as a server takes them from clients: checked, normalised, and shown
without credentials.

``check_url`` refuses what FFmpeg and a camera could read differently from the check (a
control character or whitespace anywhere, an ``@`` inside the user name, a fragment, a zone
in an IPv6 literal, a character a URL may not hold, a host that is not plain ASCII) and gives
back the one spelling that is then opened, listed and logged: scheme and host in lower case,
the port without leading zeros, the rest as sent. ``redact`` is the only way a source is shown:
``rtsp://user:pass@cam/live`` becomes ``rtsp://***@cam/live``.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from typing import NamedTuple

from app.errors import InvalidParameter

MAX_SOURCE_CHARS = 2048
REDACTED = "***"

_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)(?P<path>[^?#]*)"
                  r"(?P<query>\?[^#]*)?(?P<fragment>#.*)?", re.DOTALL)
# RFC 3986: what a user name, password, path and query may hold unencoded (pct-encoding apart).
_UNRESERVED_SUBDELIMS = r"\-A-Za-z0-9._~!$&'()*+,;="
_USERINFO = re.compile(rf"(?:[{_UNRESERVED_SUBDELIMS}:]|%[0-9A-Fa-f]{{2}})*")
_PATH = re.compile(rf"(?:[{_UNRESERVED_SUBDELIMS}:@/]|%[0-9A-Fa-f]{{2}})*")
_QUERY = re.compile(rf"\?(?:[{_UNRESERVED_SUBDELIMS}:@/?]|%[0-9A-Fa-f]{{2}})*")
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_ALLOWED = re.compile(rf"[{_UNRESERVED_SUBDELIMS}:@/?%\[\]]")


class SourceUrl(NamedTuple):
    scheme: str
    userinfo: str | None  # None: no "@" at all
    host: str  # lower case; an IPv6 literal without its brackets
    port: int | None
    rest: str  # path and query, as sent

    def __str__(self) -> str:
        return self.build(self.userinfo)

    def build(self, userinfo: str | None) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port is not None else ""
        user = f"{userinfo}@" if userinfo is not None else ""
        return f"{self.scheme}://{user}{host}{port}{self.rest}"

    @property
    def shown(self) -> str:
        """The URL without its credentials."""
        return self.build(REDACTED if self.userinfo is not None else None)

    @property
    def request_target(self) -> str:
        """The URL as a request line names it (no credentials)."""
        return self.build(None)


def check_characters(source: str) -> None:
    """``InvalidParameter`` naming the first control character, whitespace or invisible format
    character in ``source`` (where FFmpeg, a camera and this check could disagree)."""
    for position, char in enumerate(source):
        category = unicodedata.category(char)
        if char.isspace() or category in ("Cc", "Cf", "Zs", "Zl", "Zp", "Cs", "Co", "Cn"):
            name = unicodedata.name(char, {"\r": "CARRIAGE RETURN", "\n": "LINE FEED", "\t": "CHARACTER TABULATION",
                                           "\x00": "NULL", "\x7f": "DELETE"}.get(char, "control character"))
            raise InvalidParameter(f"source holds U+{ord(char):04X} ({name}) at position {position}: a source may "
                                   "hold no control character, whitespace or invisible character "
                                   "(percent-encode it in a URL)")


def parse_url(source: str) -> SourceUrl:
    """The parts of a stream URL, each checked (see the module docstring); ``InvalidParameter``
    naming what is wrong, never echoing credentials."""
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidParameter(f"source must be at most {MAX_SOURCE_CHARS} characters")
    check_characters(source)
    match = _URL.fullmatch(source)
    if match is None:
        raise InvalidParameter("source is not a URL of the form scheme://host[:port]/path")
    if match["fragment"] is not None:
        raise InvalidParameter("a source URL may not hold a fragment ('#'): it would not reach the camera; "
                               "percent-encode a '#' that is part of the path as %23")
    for position, char in enumerate(source):
        if not char.isascii():
            raise InvalidParameter(f"source holds the non-ASCII character U+{ord(char):04X} at position {position}: "
                                   "percent-encode it in a path, write an international host name in its "
                                   "xn-- (IDNA) form")
        if not _ALLOWED.fullmatch(char):
            raise InvalidParameter(f"source holds {char!r} at position {position}, which a URL may not hold "
                                   "unencoded; percent-encode it")
    userinfo, at, hostport = match["authority"].rpartition("@")
    if at and "@" in userinfo:
        raise InvalidParameter("source has more than one '@' before its host: percent-encode an '@' in a user "
                               "name or password as %40")
    if at and not _USERINFO.fullmatch(userinfo):
        raise InvalidParameter("the user name or password of the source holds a character it may not hold "
                               "unencoded (or a bad %-escape); percent-encode it")
    host, port = _host_port(hostport)
    path, query = match["path"], match["query"] or ""
    if path and not path.startswith("/"):
        raise InvalidParameter("the path of a source URL must start with '/'")
    if not _PATH.fullmatch(path) or (query and not _QUERY.fullmatch(query)):
        raise InvalidParameter("the path or query of the source holds a bad %-escape or a character it may not "
                               "hold unencoded; percent-encode it")
    return SourceUrl(match["scheme"].lower(), userinfo if at else None, host, port, path + query)


def _host_port(hostport: str) -> tuple[str, int | None]:
    if hostport.startswith("["):
        literal, bracket, port_part = hostport[1:].partition("]")
        if not bracket:
            raise InvalidParameter("the IPv6 host of the source has no closing ']'")
        if "%" in literal:
            raise InvalidParameter("an IPv6 zone ('%25...') in a source host is not supported: the server, not the "
                                   "client, chooses its interfaces")
        try:
            host = ipaddress.IPv6Address(literal).compressed
        except ValueError:
            raise InvalidParameter("the host of the source is not a valid IPv6 address") from None
        if port_part and not port_part.startswith(":"):
            raise InvalidParameter("the source has characters after its IPv6 host that are not a port")
        return host, _port(port_part[1:] if port_part else None)
    host, colon, port_text = hostport.partition(":")
    if "[" in hostport or "]" in hostport:
        raise InvalidParameter("the host of the source holds '[' or ']' outside an IPv6 literal")
    if not host:
        raise InvalidParameter("the source URL names no host")
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidParameter("the host of the source is not a valid host name or IPv4 address (letters, digits, "
                               "'-', '_' and dots; an IPv6 address in [brackets])")
    return host.lower(), _port(port_text if colon else None)


def _port(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or len(text) > 10 or not 0 < int(text) < 65536:
        raise InvalidParameter("the port of the source must be a number from 1 to 65535")
    return int(text)


def redact(source: str) -> str:
    """``source`` fit to show (lists, events, logs, errors): a URL's user name and password
    become ``***``; anything else unchanged. Never raises."""
    match = _URL.match(source)
    if match is None or "@" not in match["authority"]:
        return source
    _userinfo, _, hostport = match["authority"].rpartition("@")
    return f"{match['scheme']}://{REDACTED}@{hostport}{source[match.end('authority'):]}"
