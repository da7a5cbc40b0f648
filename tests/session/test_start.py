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
