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

from collections.abc import Sequence

from kafila.engine.stage import Stage
from kafila.obs.log import get_logger
from kafila.session.channel import Channel
from kafila.session.ring.head import RingHead
from kafila.session.ring.info import RingInfo
from kafila.session.ring.member import RingMember

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
) -> RingHead:
    """The head `member` becomes for the next epoch (`member.epoch` set by the caller after), on
    `stage` (blocks and head) and these channels; `member` is paused and must not be used again.
    Its clients' requests are the head's from now on; the head's loops start, sending once the
    state is "serving" again (`go`)."""
    if info.order[0] != member.name:
        raise ValueError(f"the ring {info.order} has {info.order[0]} as head, not {member.name}")
    member._retire(next_ch, prev_ch)
    head = RingHead(
        stage, member.model, info, next_ch, prev_ch, eos_ids, concurrency, chunk, member.traces, lanes, queue
    )
    head.ids, head.origins = member.ids, member.origins  # its requests keep their ids and origins
    head.on_broken, head.recovers, head.on_ended = member.on_broken, member.recovers, member.on_ended
    head.ending, head.spares, head.ended_reason = member.ending, member.spares, member.ended_reason
    head.state, head.change = member.state, member.change
    held = member.handed_over()
    for msg, gen in held:
        head.adopt(msg, gen)
    log.info("head_moved_here", member=member.name, requests=len(held))
    head.start()
    return head
