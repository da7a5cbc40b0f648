"""The tracked tree says what holds now: no reference to a work session or a tracker issue by number
(a reader cannot know what it was) in docs, code, comments, tests or output. History lives in git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A work session or an issue named by its number, alone, as a range or with a "#" (the examples are in the
# test below, built from parts); not a session code, whose second part has a letter, nor "sessions of 5".
HISTORY = re.compile(r"(?<![-\w])(?:sessions?|issues?)\s+#?\d+(?!\d|-[a-z0-9]*[a-z])", re.I)
# Who did it (an engineer's tag: the letter E and a number), and notes outside the repository that
# a reader cannot open.
AUTHORS = re.compile(r"\bE\d{1,2}(?:'s)?(?=[\s),.;:])")
OUTSIDE = re.compile(r"shared/(?:paper|notes)/|\b(?:facts|anchors)\.md\b")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(
        b"\0"
    )
    files = []
    for name in names:
        path = ROOT / name.decode()
        if not name or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" not in head:
            files.append(path)
    return files


def test_the_pattern_finds_work_history_and_spares_session_codes() -> None:
    # built from parts, so that this file holds no reference itself
    history = ["Session " + "35 ran", "sessions " + "23-32", "(issue " + "49)", "issue #" + "50"]
    history.append("Sessions " + "26 and 27")
    fine = ["session " + "4-k7m2 has", "session " + "4-7km2 expired", "sessions of 5", "a session code"]
    assert all(HISTORY.search(t) for t in history)
    assert not any(HISTORY.search(t) for t in fine)
    assert AUTHORS.search("(E" + "3's probe)") and not AUTHORS.search("1E5 steps, E2E tests")
    assert OUTSIDE.search("see shared/" + "notes/x") and not OUTSIDE.search("docs/architecture.md")


def test_no_tracked_file_refers_to_a_work_session_an_issue_an_author_or_notes_outside_it() -> None:
    hits = []
    for path in tracked_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in (HISTORY, AUTHORS, OUTSIDE):
                if m := pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, f"{len(hits)} work-history references:\n" + "\n".join(hits[:50])
