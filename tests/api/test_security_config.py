"""The API's security configuration from flags, key files and the environment, and the refusal to
serve other machines without a key (kafila.api.security)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kafila.api.security import (
    ApiSecurity,
    ApiSecurityError,
    add_api_security_flags,
    check_exposure,
    security_from_args,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_api_security_flags(parser)
    return parser.parse_args(argv)


def test_keys_come_from_the_file_flag_then_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha-0123456789abcdef\n\n beta-0123456789abcdef \n")
    got = security_from_args(parse("--api-key-file", str(keys), "--allow-origin", "https://a.example"), {})
    assert got.keys == ("alpha-0123456789abcdef", "beta-0123456789abcdef")
    assert got.allowed_origins == ("https://a.example",) and not got.insecure
    from_env_file = security_from_args(parse(), {"KAFILA_API_KEY_FILE": str(keys)})
    assert from_env_file.keys == got.keys
    assert security_from_args(parse(), {"KAFILA_API_KEY": "gamma-0123456789abcdef"}).keys == (
        "gamma-0123456789abcdef",
    )
    assert security_from_args(parse("--insecure-no-key"), {}) == ApiSecurity(insecure=True)


def test_bad_keys_and_files_are_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ApiSecurityError, match="holds no key"):
        security_from_args(parse("--api-key-file", str(empty)), {})
    with pytest.raises(ApiSecurityError, match="cannot read it"):
        security_from_args(parse("--api-key-file", str(tmp_path / "absent")), {})
    with pytest.raises(ApiSecurityError, match="at least 16 characters"):
        security_from_args(parse(), {"KAFILA_API_KEY": "short"})
    with pytest.raises(ApiSecurityError, match="scheme://host"):
        ApiSecurity(allowed_origins=("app.example",))


def test_a_non_loopback_api_without_a_key_refuses_to_start_unless_told() -> None:
    with pytest.raises(ApiSecurityError, match="--insecure-no-key"):
        check_exposure("0.0.0.0", 11434, ApiSecurity())
    with pytest.raises(ApiSecurityError):
        check_exposure("192.168.1.5", 11434, ApiSecurity())
    check_exposure("0.0.0.0", 11434, ApiSecurity(("k" * 16,)))
    check_exposure("0.0.0.0", 11434, ApiSecurity(insecure=True))
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_exposure(loopback, 11434, ApiSecurity())


def test_keys_are_compared_whole() -> None:
    sec = ApiSecurity(("alpha-0123456789abcdef", "beta-0123456789abcdef"))
    assert sec.key_matches("beta-0123456789abcdef")
    assert not sec.key_matches("alpha-0123456789abcde") and not sec.key_matches("")


def refusal(security: ApiSecurity, headers: dict[str, str], path: str = "/v1/models") -> str | None:
    """The guard's answer to a GET with `headers` (None: let through)."""
    from kafila.api.security import ApiGuard

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    found = ApiGuard(lambda *a: None, security)._refusal(scope)  # type: ignore[arg-type]
    return None if found is None else found.code


def test_hosts_a_rebinding_page_cannot_name_and_origins_that_are_not_this_api() -> None:
    open_ = ApiSecurity(allowed_hosts=("Kafila.LAN",), allowed_origins=("https://app.example",))
    for host in (
        "127.0.0.1:11434",
        "[::1]:11434",
        "192.168.1.5",
        "localhost:11434",
        "kafila.lan:8080",
        "ui.localhost",
    ):
        assert refusal(open_, {"Host": host}) is None, host
    for host in ("attacker.example", "attacker.example:11434", "127.0.0.1.nip.io", ""):
        assert refusal(open_, {"Host": host}) == "host_not_allowed", host
    assert refusal(open_, {}) == "host_not_allowed"  # HTTP/1.0 without a Host
    assert refusal(open_, {}, "/healthz") is None
    same = {"Host": "127.0.0.1:11434", "Origin": "http://127.0.0.1:11434"}
    assert refusal(open_, same) is None
    for origin in ("null", "http://127.0.0.1:9999", "https://127.0.0.1:11434", "https://evil.example"):
        assert refusal(open_, same | {"Origin": origin}) == "origin_not_allowed", origin
    assert refusal(open_, same | {"Origin": "https://app.example"}) is None
    assert refusal(ApiSecurity(allowed_origins=("*",)), same | {"Origin": "https://any.example"}) is None
