"""The commands' shared argparse value types: what each accepts and how it names what it refused."""

import argparse

import pytest

from kafila.cli.argtypes import (
    count,
    member_name,
    non_negative_int,
    port_number,
    positive_int,
    positive_number,
    rendezvous_url,
)


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (positive_int, "1", 1),
        (positive_int, "4096", 4096),
        (non_negative_int, "0", 0),
        (port_number, "0", 0),
        (port_number, "65535", 65535),
        (positive_number, "0.25", 0.25),
        (positive_number, "1e3", 1000.0),
        (member_name, "laptop-2", "laptop-2"),
        (count, "1", 1),
        (count, "4294967295", 2**32 - 1),  # the wire's 32 bits, as a fleet file's
        (rendezvous_url, "ws://127.0.0.1:8470/v1/signal", "ws://127.0.0.1:8470/v1/signal"),
        (rendezvous_url, "rdv.example.org", "ws://rdv.example.org:8470/v1/signal"),
        (rendezvous_url, " 10.0.0.2:9000 ", "ws://10.0.0.2:9000/v1/signal"),
        (rendezvous_url, "[fd00::2]:8470", "ws://[fd00::2]:8470/v1/signal"),
        (rendezvous_url, "http://rdv.example.org:8470", "ws://rdv.example.org:8470/v1/signal"),
        (rendezvous_url, "HTTPS://rdv.example.org/", "wss://rdv.example.org/v1/signal"),  # port 443
        (rendezvous_url, "wss://rdv.example.org/kafila/v1/signal", "wss://rdv.example.org/kafila/v1/signal"),
    ],
)
def test_accepts(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (positive_int, "0", "must be a whole number >= 1, got '0'"),
        (positive_int, "-3", "must be a whole number >= 1, got '-3'"),
        (positive_int, "2.5", "must be a whole number >= 1, got '2.5'"),
        (positive_int, "\u00b2", "must be a whole number >= 1, got '\u00b2'"),  # str.isdigit() says yes
        (positive_int, "\u0663", "must be a whole number >= 1, got '\u0663'"),  # int() would read 3
        (non_negative_int, "-1", "must be a whole number >= 0, got '-1'"),
        (port_number, "65536", "must be 0-65535, got '65536'"),
        (port_number, "http", "must be 0-65535, got 'http'"),
        (positive_number, "0", "must be a finite number > 0, got '0'"),
        (positive_number, "inf", "must be a finite number > 0, got 'inf'"),
        (positive_number, "nan", "must be a finite number > 0, got 'nan'"),
        (positive_number, "many", "must be a finite number > 0, got 'many'"),
        (member_name, "", "must be 1-64 printable characters, got ''"),
        (member_name, "a\nb", "must be 1-64 printable characters, got 'a\\nb'"),
        (member_name, "x" * 300, "must be 1-64 printable characters, got 300 characters"),
        (count, "0", "must be a whole number >= 1, got '0'"),
        (count, "4294967296", "must be at most 4294967295, got '4294967296'"),
        (
            rendezvous_url,
            "ftp://rdv",
            "'ftp://rdv' is not a rendezvous address: give a ws://, wss://, http:// or https:// URL, "
            "or HOST[:PORT]",
        ),
        (rendezvous_url, "rdv:99999", "'rdv:99999' is not a rendezvous address: Port out of range 0-65535"),
        (rendezvous_url, "http://", "'http://' is not a rendezvous address: it names no host"),
        (rendezvous_url, "", "'' is not a rendezvous address: it names no host"),
    ],
)
def test_refuses_naming_the_range(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(text)
    assert str(refused.value) == message
