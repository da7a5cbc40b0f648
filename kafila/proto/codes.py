"""Session codes that can be read aloud: "4-k7m2-tiger-lamp-ocean" (pure, no I/O).

A code has two parts:
- public part "4-k7m2": a digit 2-9 and four Crockford base32 characters (2^23 values). The
  rendezvous generates it, routes joins by it and never learns anything else.
- secret part "tiger-lamp-ocean": `SECRET_WORDS` words from a 256-word list (8 bits each), made
  by the host and shared with members out of band. It never reaches the rendezvous; members prove
  it to each other (kafila.net) from `SessionCode.secret_material()`.

Parsing forgives case, spaces or typographic dashes (en, em, minus) for hyphens, the quotes and
full stop of a code copied out of a sentence, and the Crockford look-alikes (o->0, i/l->1); a word
not in the list is answered with the nearest ones.
A joiner proves the secret part to the rendezvous without sending it (`join_key`, `join_proof`):
the host registers `join_key(code, salt)` (the verifier) when it opens the session, and a join
carries an HMAC of a fresh server nonce under the same key, derived by the joiner from the code.
docs/rendezvous.md derives the online guessing bound and says what the verifier gives away.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import math
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kafila.proto.errors import ProtocolError

CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
_LOOKALIKE = str.maketrans({"o": "0", "i": "1", "l": "1"})
PUBLIC_LEAD = "23456789"
PUBLIC_CHARS = 4
SECRET_WORDS = 3

_WORD_TEXT = """
acorn actor adobe agent alarm album alley amber angel ankle apple april apron arena arrow aspen
atlas attic award bacon badge bagel baker banjo barn basil basin beach beard bench berry bingo birch
bison blade blank blaze bloom board bonus boot bread brick brook brush cabin camel canoe cargo cedar
chalk chess chief cider clock cloud coast cobra cocoa comet coral coyote crane crater crayon crown
daisy dancer delta denim desert dinner doctor donkey dragon dream drum eagle easel echo elbow ember
engine falcon fence ferry fiddle flame flute forest fossil fox galaxy garden garlic gecko ginger
globe gold grape gravel guitar hammer harbor hazel helmet hermit honey hotel husky igloo iris island
ivory jacket jaguar jelly jewel jigsaw jungle kayak kettle kiwi koala ladder lagoon lamp lava lemon
lilac lily linen lion lizard locket lotus magnet mango maple marble meadow melon mirror mitten
monkey moose mosaic motor muffin nectar needle nickel noodle nutmeg oasis ocean olive onion orbit
orchid otter owl oyster paddle palace panda paper parrot pasta peach pebble pencil pepper piano
pickle pillow pilot pine planet plum pocket poem pony poppy potato puzzle quartz quill rabbit radar
radish raft rain raven ribbon river robin rocket rose ruby saddle sailor salmon sand satin scarf
shadow shell silver sketch sled snow sofa spider spoon spruce squid star stone storm sugar summer
sunset swan table tango teapot temple tiger timber toast tomato topaz tower trail tulip tundra
turtle valley velvet violet waffle walnut wagon walrus water whale willow window winter wizard wolf
yacht yogurt zebra zephyr
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
_WORD_SET = frozenset(WORDS)

PUBLIC_SPACE = len(PUBLIC_LEAD) * len(CROCKFORD) ** PUBLIC_CHARS
PUBLIC_BITS = math.log2(PUBLIC_SPACE)
SECRET_BITS = SECRET_WORDS * math.log2(len(WORDS))
_PUBLIC_RE = re.compile(rf"^[{PUBLIC_LEAD}]-[{CROCKFORD}]{{{PUBLIC_CHARS}}}$")

RandomBelow = Callable[[int], int]  # n -> uniform integer in [0, n)


@dataclass(frozen=True, slots=True)
class SessionCode:
    public: str
    secret: str

    def __str__(self) -> str:
        return f"{self.public}-{self.secret}"

    def secret_material(self) -> bytes:
        """Bytes that bind the secret to this session, for the members' authentication."""
        return f"kafila-code-v1|{self.public}|{self.secret}".encode()


def new_public(rand_below: RandomBelow = secrets.randbelow) -> str:
    lead = PUBLIC_LEAD[rand_below(len(PUBLIC_LEAD))]
    tail = "".join(CROCKFORD[rand_below(len(CROCKFORD))] for _ in range(PUBLIC_CHARS))
    return f"{lead}-{tail}"


def new_secret(rand_below: RandomBelow = secrets.randbelow, words: int = SECRET_WORDS) -> str:
    return "-".join(WORDS[rand_below(len(WORDS))] for _ in range(words))


def new_code(public: str, rand_below: RandomBelow = secrets.randbelow) -> SessionCode:
    """The full code a host shows, from the public part the rendezvous gave it."""
    return SessionCode(parse_public(public), new_secret(rand_below))


def _tokens(text: str) -> list[str]:
    """The parts of a code as typed or pasted: without the quotes, brackets and full stop a code
    copied out of a sentence brings along, split at hyphens also as chat apps and word processors
    rewrite them (U+2010-2015: en and em dash among them, U+2212 minus)."""
    text = text.strip().strip("\"'`\u2018\u2019\u201c\u201d()[]<>.,;:!?").lower()
    return [t for t in re.split(r"[\s\-_\u2010-\u2015\u2212]+", text) if t]


def parse_public(text: str) -> str:
    """Normalize a public part ("4 K7M2" -> "4-k7m2"); ProtocolError if it cannot be one."""
    tokens = _tokens(text)
    public = f"{tokens[0]}-{tokens[1].translate(_LOOKALIKE)}" if len(tokens) == 2 else ""
    if not _PUBLIC_RE.match(public):
        why = _public_problem(tokens)
        raise ProtocolError(f"session code public part {text!r} should look like '4-k7m2'{why}", "bad_code")
    return public


def _public_problem(tokens: list[str]) -> str:
    """What makes the parts of a public part not one, for the error (empty if not one thing)."""
    if len(tokens) != 2:
        return ""
    lead, tail = tokens[0], tokens[1].translate(_LOOKALIKE)
    if len(lead) != 1 or lead not in PUBLIC_LEAD:
        return f": it starts with one digit 2-9, not {lead!r}"
    if len(tail) != PUBLIC_CHARS:
        return f": {PUBLIC_CHARS} characters follow the digit, not {len(tail)} ({tokens[1]!r})"
    bad = sorted({c for c in tail if c not in CROCKFORD})
    return (
        f": {', '.join(map(repr, bad))} cannot be in it (0-9 and the letters but i, l, o, u)" if bad else ""
    )


def parse_code(text: str, words: int = SECRET_WORDS) -> SessionCode:
    """Split and normalize a full code as a person typed it."""
    tokens = _tokens(text)
    if not tokens:
        raise ProtocolError("session code is empty; it looks like '4-k7m2-tiger-lamp-ocean'", "bad_code")
    if len(tokens) != 2 + words:
        raise ProtocolError(
            f"session code has {len(tokens)} parts, expected {2 + words} like '4-k7m2-tiger-lamp-ocean'",
            "bad_code",
        )
    public = parse_public("-".join(tokens[:2]))
    unknown = [w for w in tokens[2:] if w not in _WORD_SET]
    if unknown:
        near = [f"{w!r}: did you mean {' or '.join(map(repr, m))}?" for w in unknown if (m := _near(w))]
        hint = f" ({'; '.join(near)})" if near else ""
        raise ProtocolError(f"session code words {unknown} are not in the word list{hint}", "bad_code")
    return SessionCode(public, "-".join(tokens[2:]))


def _near(word: str) -> list[str]:
    """Words of the list a mistyped `word` may have meant (at most two)."""
    return difflib.get_close_matches(word, WORDS, n=2, cutoff=0.75)


# scrypt parameters of the join key: 16 MiB and about 50 ms a derivation, paid once by the host and
# once by each joiner, and by anyone holding a verifier (the rendezvous) for each secret it tests
JOIN_KDF_N, JOIN_KDF_R, JOIN_KDF_P = 2**14, 8, 1
JOIN_SALT_BYTES = 16
JOIN_NONCE_BYTES = 16
JOIN_KEY_BYTES = 32


def join_key(code: SessionCode, salt: bytes) -> bytes:
    """The key a join proves the secret part with: scrypt of the code (public and secret parts) under
    the session's random salt. The rendezvous holds it as the session's verifier; it does not
    authenticate ring links (those run SPAKE2 on the secret itself, kafila.net.auth)."""
    return hashlib.scrypt(
        b"kafila-join-v2|" + code.secret_material(),
        salt=salt,
        n=JOIN_KDF_N,
        r=JOIN_KDF_R,
        p=JOIN_KDF_P,
        dklen=JOIN_KEY_BYTES,
    )


def join_proof(key: bytes, public: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the rendezvous's fresh nonce and the session's public part under `key`."""
    return hmac.new(key, b"kafila-join-proof-v2|" + public.encode() + b"|" + nonce, hashlib.sha256).digest()


def proof_matches(key: bytes, public: str, nonce: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(join_proof(key, public, nonce), proof)
