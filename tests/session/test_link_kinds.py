"""Every kind of message the session layer sends over a link has a number of its own, above the
link's own kinds: two features that picked the same number would take each other's messages."""

from __future__ import annotations

from kafila.net.framing import FIRST_APP_KIND
from kafila.proto.session import RELAY_KIND
from kafila.session.channel import LINK_KIND
from kafila.session.forming.epochs import CONTROL_KIND
from kafila.session.weights.peers import REPLY_KIND, REQUEST_KIND


def test_link_message_kinds_are_distinct_and_the_applications() -> None:
    kinds = {
        "ring (session.channel)": LINK_KIND,
        "epochs (forming.epochs)": CONTROL_KIND,
        "spare relay (proto.session)": RELAY_KIND,
        "weights requests (weights.peers)": REQUEST_KIND,
        "weights replies (weights.peers)": REPLY_KIND,
    }
    assert len(set(kinds.values())) == len(kinds), kinds
    assert all(FIRST_APP_KIND <= k < 256 for k in kinds.values()), kinds
