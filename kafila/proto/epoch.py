"""Plan epochs on a ring channel: stamp what is sent, drop what another epoch sent (pure, no I/O).

A session's ring runs one plan at a time; each re-plan counts the epoch up (1: the plan the session
formed with). A channel belongs to one epoch: `EpochGate.stamp` writes the epoch into every record
(kafila.proto.tensor's prefix), and `EpochGate.admit` reads a received record's prefix first and
hands back a `Stale` verdict, the body never decoded, for a record of any other epoch: a frame
still in flight from the ring before a re-plan is dropped, never computed. Records that are not
valid raise `FrameError` naming what is wrong, whatever their epoch.

The gate counts what it drops per epoch; `Stale.first` is set on the first record of an epoch, so
its owner logs one event per peer and stale epoch, never one per frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kafila.proto import tensor as t


@dataclass(frozen=True)
class Stale:
    """A record of another epoch, dropped undecoded."""

    epoch: int  # the record's epoch
    kind: int  # the record's message kind (as sent; not checked)
    size: int  # bytes of the whole record
    first: bool  # the first record of `epoch` this gate dropped

    def describe(self, own: int) -> str:
        """For people: "a frame of epoch 1 (kind 1, 4106 bytes) on a channel of epoch 2"."""
        frame = f"a frame of epoch {self.epoch} (kind {self.kind}, {self.size} bytes)"
        return f"{frame} on a channel of epoch {own}"


@dataclass
class EpochGate:
    """Stamps and filters the records of one channel of plan epoch `epoch`."""

    epoch: int
    dropped: dict[int, int] = field(default_factory=dict)  # stale epoch -> records dropped

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not 1 <= self.epoch <= t.MAX_EPOCH:
            raise ValueError(f"a plan epoch is 1..{t.MAX_EPOCH}, got {self.epoch!r}")

    def stamp(self, msg: t.Message) -> bytes:
        """`msg` as a record of this epoch."""
        return t.encode(msg, self.epoch)

    def admit(self, record: bytes | memoryview) -> t.Message | Stale:
        """The message a record of this epoch carries, or `Stale` for one of another epoch.
        FrameError: not a valid record (a stale one is checked only as far as its prefix)."""
        head = t.header(record)
        if head.epoch == self.epoch:
            return t.decode(record)
        count = self.dropped.get(head.epoch, 0)
        self.dropped[head.epoch] = count + 1
        return Stale(head.epoch, head.kind, len(record), first=count == 0)

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())
