"""Who may use a member's API: API keys, the Host and Origin a request may carry, JSON bodies.

`ApiSecurity` is the configuration (the flags `--api-key-file`, `--allow-origin`, `--allow-host`,
`--insecure-no-key` and the variables KAFILA_API_KEY_FILE / KAFILA_API_KEY fill it, through
`add_api_security_flags` and `security_from_args`); `ApiGuard` is the ASGI middleware that
enforces it in front of the API app (and of the forming app before it):

- Host: an IP literal (any: DNS rebinding needs a name the attacker controls), `localhost`, or a
  name given with `--allow-host`; anything else is a 421 (but `GET /healthz`, which a monitor may
  call by any name and which tells nothing), so a page whose name was rebound to this member's
  address cannot read its answers.
- Origin: a browser sends one on cross-origin requests; one that is not this API's own origin
  (`http://` + the Host) nor allowed with `--allow-origin` is a 403 before anything runs. Allowed
  origins get CORS answers, preflights included (Starlette's CORSMiddleware).
- Key: with keys, every request but `GET /` (the member page, which holds no data) and
  `/healthz` needs `Authorization: Bearer <key>`, compared in constant time; else a 401.
- POST bodies must say they are JSON (`application/json` or `...+json`): a 415 otherwise, so a
  form or a `text/plain` fetch (which a browser sends cross-origin without a preflight) never runs.

Errors are in the route family's shape (kafila.api.errors.render): OpenAI's error object under
/v1, Ollama's `{"error": ...}` under /api. Forwarding from a member to the head never crosses
HTTP (it travels over the ring's authenticated QUIC link), so it needs no key.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kafila.api.errors import ApiError, render

OPEN_PATHS = frozenset({"/", "/healthz"})  # GET without a key: the member page and the health check
OPEN_PREFIX = "/_kafila/"  # GET without a key: the member page's static files (kafila.api.page.ASSET_PATH)
MIN_KEY_CHARS = 16
KEY_FILE_ENV = "KAFILA_API_KEY_FILE"
KEY_ENV = "KAFILA_API_KEY"
JSON_TYPES = ("application/json",)


class ApiSecurityError(ValueError):
    """A key file or flag that cannot configure the API (the message names it)."""


@dataclass(frozen=True)
class ApiSecurity:
    keys: tuple[str, ...] = ()  # any of them opens the API; none: no key asked
    allowed_hosts: tuple[str, ...] = ()  # names besides IP literals and localhost accepted in Host
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed cross-origin (CORS)
    insecure: bool = False  # serve a non-loopback address without a key, on purpose

    def __post_init__(self) -> None:
        for key in self.keys:
            if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
                raise ApiSecurityError(
                    f"an API key must be at least {MIN_KEY_CHARS} characters without spaces, got "
                    f"{len(key)} characters (make one with: python -c 'import secrets; "
                    "print(secrets.token_urlsafe(32))')"
                )
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ApiSecurityError(
                    f"--allow-origin {origin!r}: an origin is scheme://host[:port], e.g. https://app.example"
                )

    def key_matches(self, given: str) -> bool:
        """Whether `given` is one of the keys; every key is compared, each in constant time."""
        found = False
        for key in self.keys:
            found |= hmac.compare_digest(given.encode(), key.encode())
        return found


NO_SECURITY = ApiSecurity()


def is_loopback(host: str) -> bool:
    """Whether an --api host is this machine alone (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, port: int, security: ApiSecurity) -> None:
    """Refuse (ApiSecurityError) to serve a non-loopback address without a key, unless told so."""
    if security.keys or security.insecure or is_loopback(host):
        return
    raise ApiSecurityError(
        f"the API on {host}:{port} would be open to other machines with no key: give one with "
        f"--api-key-file FILE (or {KEY_FILE_ENV} / {KEY_ENV}), or serve 127.0.0.1, or pass "
        "--insecure-no-key to serve it open on purpose"
    )


# ------------------------------------------------------------------ flags


def load_keys(path: str | Path) -> tuple[str, ...]:
    """Keys from a file: one a line; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiSecurityError(f"--api-key-file {path}: cannot read it ({exc})") from None
    keys = tuple(s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#"))
    if not keys:
        raise ApiSecurityError(f"--api-key-file {path}: holds no key (one a line)")
    return keys


def add_api_security_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        help="file of API keys (one a line): every API request but GET / and /healthz then needs "
        f"'Authorization: Bearer KEY' (default: ${KEY_FILE_ENV}, or the key in ${KEY_ENV})",
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (https://app.example) allowed to call the API cross-origin; repeatable "
        "(default: only pages the API serves itself)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients use to reach the API (IP addresses and localhost always work); repeatable",
    )
    parser.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="serve a non-loopback --api without a key (anyone who reaches it uses the session)",
    )


def security_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ApiSecurity:
    """The API's security from the flags of `add_api_security_flags` and the environment."""
    env = os.environ if environ is None else environ
    keys: Sequence[str] = ()
    key_file = args.api_key_file or env.get(KEY_FILE_ENV)
    if key_file:
        keys = load_keys(key_file)
    elif env.get(KEY_ENV, "").strip():
        keys = (env[KEY_ENV].strip(),)
    return ApiSecurity(tuple(keys), tuple(args.allow_host), tuple(args.allow_origin), args.insecure_no_key)


# ------------------------------------------------------------------ enforcement


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def shows_key(security: ApiSecurity, headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers (lower-case names, as ASGI's) carry `Authorization: Bearer KEY`
    with one of the keys; any headers do where no key is configured."""
    if not security.keys:
        return True
    given = _header({"headers": headers}, b"authorization") or ""
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip()) and security.key_matches(token.strip())


def _host_name(host: str) -> str:
    """ "[::1]:8000" -> "::1", "Example.org:80" -> "example.org"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class ApiGuard:
    """ASGI middleware enforcing an `ApiSecurity` in front of `app` (see the module doc)."""

    def __init__(self, app: ASGIApp, security: ApiSecurity) -> None:
        self.security = security
        self.hosts = frozenset(h.lower() for h in security.allowed_hosts)
        inner: ASGIApp = _KeyGuard(app, security)
        if security.allowed_origins:
            inner = CORSMiddleware(
                inner,
                allow_origins=list(security.allowed_origins),
                allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type"],
                max_age=600,
            )
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await render(Request(scope), refusal)(scope, receive, send)
            return
        await self.inner(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        host = _header(scope, b"host")
        name = _host_name(host) if host else ""
        local = name == "localhost" or name.endswith(".localhost")
        health = scope["path"] == "/healthz" and scope["method"] in ("GET", "HEAD")  # monitors by any name
        if not (local or health or _ip_literal(name) or name in self.hosts):
            shown = (host or "")[:80]
            return ApiError(
                421,
                "host_not_allowed",
                f"Host {shown!r} is not an address of this API; use its IP address or localhost, or "
                "name the host with --allow-host",
            )
        origin = _header(scope, b"origin")
        if origin is None or origin.lower() == f"http://{host}".lower():
            return None
        allowed = self.security.allowed_origins
        if "*" in allowed or origin in allowed:
            return None
        return ApiError(
            403,
            "origin_not_allowed",
            f"cross-origin request from {origin[:80]!r} refused; allow it with --allow-origin {origin[:80]}",
        )


class _KeyGuard:
    """The key and content-type checks (inside CORS, so preflights need no key, and a refusal to
    an allowed origin still carries its CORS headers so the page can read why)."""

    def __init__(self, app: ASGIApp, security: ApiSecurity) -> None:
        self.app, self.security = app, security

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                response = render(Request(scope), refusal)
                if refusal.status == 401:
                    response.headers["WWW-Authenticate"] = 'Bearer realm="kafila"'
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        method, path = scope["method"], scope["path"]
        # the page's own scripts and styles hold no data: a browser loads them before it has a key
        open_path = (path in OPEN_PATHS or path.startswith(OPEN_PREFIX)) and method in ("GET", "HEAD")
        if self.security.keys and not open_path:
            given = _header(scope, b"authorization") or ""
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                why = "no API key given" if not given else "the Authorization header is not 'Bearer KEY'"
                return ApiError(401, "missing_api_key", f"{why}: send 'Authorization: Bearer KEY'")
            if not self.security.key_matches(token.strip()):
                return ApiError(401, "invalid_api_key", "the API key given is not one of this member's")
        if method == "POST":
            kind = (_header(scope, b"content-type") or "").partition(";")[0].strip().lower()
            if kind not in JSON_TYPES and not kind.endswith("+json"):
                shown = kind or "none"
                return ApiError(
                    415,
                    "unsupported_media_type",
                    f"{path} takes a JSON body: send 'Content-Type: application/json' (got {shown}; "
                    "with curl: -H 'Content-Type: application/json')",
                )
        return None
