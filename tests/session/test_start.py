"""What a joining member takes from the host before it probes (kafila.session.start)."""

from __future__ import annotations

import pytest

from kafila.session.form import Options, SessionError
from kafila.session.start import in_session_dtype


def test_a_member_probes_in_the_hosts_dtype_whatever_it_was_given() -> None:
    mine = Options(dtype="fp32", name="beta")
    took = in_session_dtype(mine, {"role": "host", "dtype": "bf16"})
    assert (took.dtype, took.name, mine.dtype) == ("bf16", "beta", "fp32")  # a copy; the rest kept
    assert in_session_dtype(mine, {"role": "host"}).dtype == "auto"  # a host that names none
    with pytest.raises(SessionError, match="dtype 'int4'"):
        in_session_dtype(mine, {"dtype": "int4"})


def test_memory_gb_caps_what_a_member_offers_and_never_raises_it(capsys) -> None:
    """--memory-gb 100 on a machine with 23 GB offered 100 GB, and the planner trusted it."""
    from kafila.planner.devices import DeviceReport
    from kafila.session.form import capped

    measured = DeviceReport("laptop", 23 * 10**9, 5e9)
    assert capped(measured, None) == measured
    assert capped(measured, 8 * 10**9).memory_bytes == 8 * 10**9
    assert capped(measured, 100 * 10**9).memory_bytes == 23 * 10**9
    said = capsys.readouterr().err
    assert (
        "laptop: --memory-gb 100 is more than this device has for weights (23.0 GB): offering 23.0 GB" in said
    )
