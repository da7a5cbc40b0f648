"""Request identity (kafila.session.ring.origins): the host gives each member id one origin tag and
never gives it again, so across any run of losses, members coming back under their old names,
newcomers and spares, no two members' request ids ever meet, and each id names its member."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import session as sm
from kafila.proto.session import MAX_ORIGIN
from kafila.session.ring.origins import PER_ORIGIN, OriginBook, OriginsSpent, RequestIds, origin_of

NAMES = ["host", "a", "b", "c", "d", "e"]
# a session's changes: a member joins (a name lost before comes back), or a member is lost
CHANGES = st.lists(st.tuples(st.sampled_from(["join", "lose"]), st.sampled_from(NAMES[1:])), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 5), CHANGES)
def test_no_two_members_share_a_tag_across_any_run_of_changes(
    formed: int, changes: list[tuple[str, str]]
) -> None:
    book, next_id = OriginBook(), 1  # member ids as the rendezvous gives them: 1, 2, ... never again
    ids: dict[str, int] = {}  # the host's: name -> the member id it has now
    present: set[str] = set()
    for name in NAMES[:formed]:
        ids[name], next_id = next_id, next_id + 1
        present.add(name)
    sent = [(dict(ids), book.named(ids))]  # the forming plan's ids and origins
    for what, name in changes:
        if what == "join" and name not in present:  # a newcomer, or a lost name back with a new id
            ids[name], next_id = next_id, next_id + 1
            book.tag(ids[name])  # admitted (planned in or kept as a spare)
            present.add(name)
        elif what == "lose" and name in present:
            present.discard(name)
        else:
            continue
        sent.append((dict(ids), book.named(ids)))  # the next epoch's
    for ids_then, origins in sent:  # every message the host sent parses: distinct tags, in range
        msg = sm.PlanMessage({}, ids_then, TERMS, origins=origins)
        assert sm.PlanMessage.parse(msg.body()).origins == origins
    tags = list(book.tags.values())
    assert len(set(tags)) == len(tags) == next_id - 1  # one per member id, none given twice
    assert all(1 <= t <= MAX_ORIGIN for t in tags)
    for ids_then, origins in sent:  # a name's tag is its member id's: new only when it came back
        assert origins == {name: book.tags[member] for name, member in ids_then.items()}
    # every member id's requests: distinct from every other's, and naming their member
    seen: dict[int, int] = {}
    for member, tag in book.tags.items():
        ids_of = RequestIds(tag)
        for _ in range(3):
            rid = ids_of.next()
            assert origin_of(rid) == tag and 0 < rid < 1 << 32
            assert seen.setdefault(rid, member) == member


TERMS = sm.SessionTerms("m", 64, 8, sm.SESSION_DTYPES[0], 512, 1, sm.DIVISIONS[0])


def test_a_member_back_under_its_name_gets_a_new_tag_not_a_survivors() -> None:
    """The defect's case: ring host, a, b, c (tags 1 to 4); b is lost and comes back as member
    id 5, at ring index 2 again; the newcomer is no survivor's first index any more than its tag."""
    book = OriginBook()
    ids = {"host": 1, "a": 2, "b": 3, "c": 4}
    assert book.named(ids) == {"host": 1, "a": 2, "b": 3, "c": 4}
    ids["b"] = 5
    assert book.named(ids) == {"host": 1, "a": 2, "b": 5, "c": 4}
    assert book.tag(3) == 3  # the old b's tag stays its own: its old requests still name it


def test_tags_run_out_only_after_every_one_was_given() -> None:
    book = OriginBook({m: m for m in range(1, MAX_ORIGIN)})
    assert book.tag(10_000) == MAX_ORIGIN
    with pytest.raises(OriginsSpent, match=f"member id 10001 cannot be admitted: all {MAX_ORIGIN}"):
        book.tag(10_001)
    assert book.tag(10_000) == MAX_ORIGIN  # one given before is still its own


def test_a_members_count_wraps_without_ever_giving_id_0_or_leaving_its_tag() -> None:
    ids = RequestIds(0)  # a ring made without a host: the head's first index
    ids._n = itertools.count(PER_ORIGIN - 2)  # (skip to its wrap)
    got = [ids.next() for _ in range(4)]
    assert got == [PER_ORIGIN - 1, PER_ORIGIN, 1, 2] and 0 not in got
    top = RequestIds(MAX_ORIGIN)
    assert origin_of(top.next()) == MAX_ORIGIN and top.next() < 1 << 32
    with pytest.raises(ValueError, match=f"origin tag {MAX_ORIGIN + 1} is outside 0 to {MAX_ORIGIN}"):
        RequestIds(MAX_ORIGIN + 1)


# a session's life as its host sees it: a member id joins (admitted, so tagged, or refused at its
# link: no tag), a member leaves, the host publishes an epoch (the tags of every name it knows),
# or the host is lost and the first member takes over from the last epoch it heard
LIFE = st.lists(st.sampled_from(["admit", "refuse", "publish", "take over"]), max_size=60)


@settings(max_examples=300, deadline=None)
@given(LIFE)
def test_a_member_that_takes_over_never_gives_a_tag_the_lost_host_gave(life: list[str]) -> None:
    """The lost host may have tagged members after its last epoch (a spare admitted, a newcomer
    being planned in): the successor's book starts above the highest member id it heard of, which
    bounds every tag given before, so no tag is given twice however many times the role passes."""
    book, next_id = OriginBook(), 1
    names: dict[str, int] = {}  # every name the coordinator knows -> its latest member id
    published: dict[str, int] = {}
    given: dict[int, int] = {}  # every tag given so far, by any coordinator -> its member id
    for step in life:
        if step in ("admit", "refuse"):
            member, next_id = next_id, next_id + 1
            if step == "admit":
                tag = book.tag(member)
                assert given.setdefault(tag, member) == member, f"tag {tag} given twice"
                names[f"m{member}"] = member
        elif step == "publish":
            published = book.named(names)
        else:  # it knows the members of the last epoch, and heard every id given (member_joined)
            names = {n: names[n] for n in published}
            book = OriginBook({names[n]: t for n, t in published.items()}, floor=next_id - 1)
    assert all(1 <= t <= MAX_ORIGIN for t in given)


def test_a_successor_heard_of_members_the_host_tagged_after_its_last_epoch() -> None:
    host = OriginBook()
    epoch = host.named({"host": 1, "a": 2, "b": 3})  # published: tags 1, 2, 3
    assert host.tag(4) == 4  # a spare admitted after that epoch, which nobody published
    successor = OriginBook({2: epoch["a"], 3: epoch["b"]}, floor=4)
    assert successor.tag(5) == 5 and successor.tag(2) == 2  # a newcomer: not the spare's tag 4
    assert OriginBook({2: 2}).tag(5) == 3  # without the floor, a tag given before
