"""A member that becomes the head: the head's member was lost and the new plan puts the head here.

The member's role gives way to a `RingHead` on the next epoch's stage (which now holds the head's
tensors) and channels, with what the session knows of the member kept: its name, request ids and
their origins, its traces, its model thread, its state and the runtime's hooks. The requests of the
member's own clients, which it had forwarded to the lost head, become the new head's local ones: each
is prefilled again with its prompt and the tokens its client has had, and its stream goes on. The
other members send theirs the same way (`RingMember.carried`), marked carried, which the new head
takes also while the ring re-plans. Requests whose clients were connected to the lost head's own API
are lost with it: their connections went with its process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kafila.engine.stage import Stage
from kafila.obs.log import get_logger
from kafila.session.channel import Channel
from kafila.session.ring.head import RingHead
from kafila.session.ring.info import RingInfo
from kafila.session.ring.member import RingMember
from kafila.session.ring.origins import first_origins

log = get_logger("kafila.session.ring.promote")


def promoted(
    member: RingMember,
    stage: Stage,
    info: RingInfo,
    next_ch: Channel | None,
    prev_ch: Channel | None,
    lanes: int,
    eos_ids: Sequence[int],
    concurrency: int,
    chunk: int,
    queue: int | None,
    origins: Mapping[str, int] | None = None,
) -> RingHead:
    """The head `member` becomes for the next epoch (`member.epoch` set by the caller after), on
    `stage` (blocks and head) and these channels; `member` is paused and must not be used again.
    Its clients' requests are the head's from now on; the head's loops start, sending once the
    state is "serving" again (`go`). `origins`: every member's request origin tag, the host's
    (None: a ring made without a host, tagged by the ring the member served in, first_origins);
    the head names whoever asked by them, and numbers its own requests on from the member's count
    under the member's tag, so no id the member gave is given again."""
    if info.order[0] != member.name:
        raise ValueError(f"the ring {info.order} has {info.order[0]} as head, not {member.name}")
    origins = first_origins(member.info.order) if origins is None else origins
    if origins.get(member.name) != member.origin:
        raise ValueError(
            f"member {member.name} numbers its requests under origin tag {member.origin}, "
            f"the host's origins give it {origins.get(member.name)}"
        )
    member._retire(next_ch, prev_ch)
    head = RingHead(
        stage, member.model, info, next_ch, prev_ch, eos_ids, concurrency, chunk, member.traces, lanes, queue,
        origins, member.draft,
    )  # fmt: skip
    head.ids = member.ids  # its own tag, its count going on
    head.on_broken, head.recovers, head.on_ended = member.on_broken, member.recovers, member.on_ended
    head.ending, head.spares, head.ended_reason = member.ending, member.spares, member.ended_reason
    head.state, head.change = member.state, member.change
    held = member.handed_over()
    for msg, gen in held:
        head.adopt(msg, gen)
    log.info("head_moved_here", member=member.name, requests=len(held))
    head.start()
    return head
