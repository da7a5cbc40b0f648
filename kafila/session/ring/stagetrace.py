"""What one member measures of its own stage, per request, and the hop figures it reports.

`StageTally` collects, per request, the stage's compute for every decode step and prefill chunk it
ran (the microseconds the model thread measured, the same figure the frame carries on to the head)
and, when the request ends here, takes from the member's two channels the bytes and messages they
counted for it. It returns a `StageRecord` (kafila.obs.trace). `hop_report` / `read_hop_report`
turn a record's hops into the JSON a `free` notice carries around the ring to the head, which
then records every hop of the request as counted on the links (kafila.session.ring.head). The
edge the stage sends on is counted into kafila_hop_bytes_total as each frame leaves, not when a
request ends.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from kafila.obs import metrics
from kafila.obs.trace import HopTrace, StageRecord
from kafila.planner.plan import Edge
from kafila.proto import tensor as t
from kafila.session.channel import Channel
from kafila.session.ring.info import RingInfo


@dataclass
class _Measured:
    decode_us: list[int] = field(default_factory=list)
    prefill_us: list[int] = field(default_factory=list)
    wait_us: list[int] = field(default_factory=list)  # per decode step: arrival to compute


class StageTally:
    """Per-request compute of the stage at ring position `index`, and its hops' counted bytes."""

    def __init__(self, info: RingInfo, index: int, next_ch: Channel | None, prev_ch: Channel | None) -> None:
        self.info, self.index = info, index
        self.name = info.order[index]
        self.next, self.prev = next_ch, prev_ch
        self._open: dict[int, _Measured] = {}
        if next_ch is not None:  # the edge this stage sends on: its bytes counted as each frame leaves
            hop = f"{self.name}->{info.order[(index + 1) % len(info.order)]}"
            next_ch.counters.on_hidden = partial(self._sent, hop, next_ch)

    def _sent(self, hop: str, ch: Channel, nbytes: int, requests: int) -> None:
        rtt_ms = ch.rtt_ms
        rtt_s = None if rtt_ms is None else rtt_ms / 1000
        metrics.observe_hop_frame(hop, ch.path, nbytes, requests, rtt_s, self.info.session)

    def add(self, rid: int, us: int, prefill: bool, waited_us: int | None = None) -> None:
        m = self._open.setdefault(rid, _Measured())
        (m.prefill_us if prefill else m.decode_us).append(us)
        metrics.observe_step(self.name, self.index, us / 1e6, prefill, self.info.session)  # as it ran
        if waited_us is not None and not prefill:
            m.wait_us.append(waited_us)

    def computed(self, frame: t.Hidden, us: int, waited_us: int | None = None) -> None:
        """A frame went through this stage in `us` (the batch it ran in): one step of each request;
        `waited_us`: how long it waited here before that batch started."""
        prefill = bool(frame.flags & t.Flag.PREFILL)
        for rid in dict.fromkeys(e.request_id for e in frame.entries):
            self.add(rid, us, prefill, waited_us)

    def finish(self, rid: int) -> StageRecord | None:
        """The record of request `rid` at this stage (None when it never ran here); forgets it."""
        m = self._open.pop(rid, None)
        hop_in, hop_out = self._hops(rid)
        if m is None:
            return None
        return StageRecord(
            session=self.info.session,
            member=self.name,
            index=self.index,
            blocks=self.info.blocks[self.name],
            head=self.index == 0,
            request_id=rid,
            predicted_ms=self.info.predicted_ms.get(self.name, 0.0),
            decode_ms=statistics.median(m.decode_us) / 1e3 if m.decode_us else 0.0,
            decode_steps=len(m.decode_us),
            prefill_ms=tuple(us / 1e3 for us in m.prefill_us),
            wait_ms=statistics.median(m.wait_us) / 1e3 if m.wait_us else 0.0,
            hop_in=hop_in,
            hop_out=hop_out,
            epoch=self.info.epoch,
        )

    def discard(self, rid: int) -> None:
        """Forget a request that ends without a record (cancelled: its last frame is back)."""
        self._open.pop(rid, None)
        self._hops(rid)

    def _hops(self, rid: int) -> tuple[HopTrace | None, HopTrace | None]:
        if self.next is None or self.prev is None:
            return None, None
        order = self.info.order
        out = self.next.counters.take(rid)
        inn = out if self.prev.counters is self.next.counters else self.prev.counters.take(rid)
        before, after = order[self.index - 1], order[(self.index + 1) % len(order)]
        return (
            self._hop(before, self.name, self.prev, inn.bytes_received, inn.messages_received),
            self._hop(self.name, after, self.next, out.bytes_sent, out.messages_sent),
        )

    def _hop(self, src: str, dst: str, ch: Channel, n: int, messages: int) -> HopTrace:
        edge = f"{src}->{dst}"
        return HopTrace(src, dst, ch.path, n, messages, ch.rtt_ms, self.info.edge_rtt_ms.get(edge))


def planned_rtt_ms(edges: Iterable[Edge]) -> dict[str, float]:
    """`RingInfo.edge_rtt_ms` from a plan's edges: the round trip it priced ("a->b": ms)."""
    return {f"{e.src}->{e.dst}": 2e3 * e.latency_s for e in edges if e.latency_s is not None}


def hop_report(rec: StageRecord) -> dict[str, Any]:
    """What a member adds to a passing `free` notice for one request."""
    return {
        "member": rec.member,
        "request_id": rec.request_id,
        "hop_in": asdict(rec.hop_in) if rec.hop_in else None,
        "hop_out": asdict(rec.hop_out) if rec.hop_out else None,
    }


def read_hop_report(d: Any) -> tuple[int, str, HopTrace | None, HopTrace | None]:
    """(request id, member, hop in, hop out) of a report; ValueError when it is malformed."""
    try:
        rid, member = int(d["request_id"]), str(d["member"])
        hops = tuple(None if d[k] is None else HopTrace(**d[k]) for k in ("hop_in", "hop_out"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed hop report {d!r}: {exc}") from exc
    for h in hops:
        if h is not None and not (isinstance(h.bytes, int) and isinstance(h.messages, int)):
            raise ValueError(f"malformed hop report {d!r}: bytes and messages must be integers")
    return rid, member, hops[0], hops[1]
