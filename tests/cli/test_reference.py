"""The documentation cannot drift from the code: the generated reference pages are current, and every
`kafila` flag, metric and fleet-file key the docs and README name exists."""

from __future__ import annotations

import re
import tomllib

from kafila.cli import reference

ROOT = reference.ROOT
PROSE = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A command as written in prose: `kafila host --model M`, `kafila-ops fleet up FLEET`.
COMMAND = re.compile(r"\bkafila(?:-ops)?(?: [a-z][a-z-]*)+[^`\n]*")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Ends what a command's flags are read from: a pipe between commands, a chain, a comment.
COMMAND_END = re.compile(r" \| |&&|;| #| \(|, then |\) ")
METRIC = re.compile(r"\bkafila_[a-z0-9_]*[a-z0-9]\b")
# Names that start like a metric but are not one: signaling and link message keys, a converter file.
NOT_METRICS = {"kafila_link", "kafila_session", "kafila_source"}


def commands_in(text: str) -> list[tuple[str, list[str]]]:
    """(command path, flags) for every `kafila ...` command the text names; the path is the longest
    run of words that the parsers know as (sub)commands ("host/join": both, paths joined by "/")."""
    known = reference.documented_flags()
    found = []
    for match in COMMAND.finditer(text.replace("\\|", "|")):
        line = COMMAND_END.split(match.group(0))[0]
        words = line.split()
        paths = [words[0]]
        for word in words[1:]:
            longer = [f"{p} {w}" for p in paths for w in word.split("/")]
            if not all(p in known for p in longer):
                break
            paths = longer
        found.append(("/".join(paths), FLAG.findall(line)))
    return found


def accepted(path: str) -> set[str]:
    known = reference.documented_flags()
    return set().union(*(known[p] | known[p.split()[0]] for p in path.split("/")))


def test_the_generated_reference_pages_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in reference.pages().items() if p.read_text() != text]
    assert not stale, f"stale: {stale}; run `python3 -m kafila.cli.reference`"


def test_every_flag_the_docs_name_exists_on_its_command() -> None:
    wrong = []
    for page in PROSE:
        for path, flags in commands_in(page.read_text()):
            wrong += [f"{page.relative_to(ROOT)}: {path} {f}" for f in flags if f not in accepted(path)]
    assert not wrong, "flags the docs name that the parsers do not have:\n" + "\n".join(wrong)


def test_the_flag_check_catches_a_flag_that_does_not_exist() -> None:
    known = reference.documented_flags()
    (path, flags), *_ = commands_in("`kafila host --model M --no-such-flag`")
    assert path == "kafila host" and flags == ["--model", "--no-such-flag"]
    assert "--model" in known[path] and "--no-such-flag" not in known[path]
    (path, flags), *_ = commands_in("kafila-ops fleet up fleets/a.toml --wait 60 # then --bogus")
    assert path == "kafila-ops fleet" and flags == ["--wait"]
    (path, flags), *_ = commands_in("`kafila host/join --trace FILE --code-file F`")
    assert path == "kafila host/kafila join" and "--trace" in accepted(path)
    assert "--code-file" in known["kafila host"] and "--code-file" not in known["kafila join"]


def test_every_metric_the_docs_name_exists() -> None:
    names = reference.metric_names()
    wrong = []
    configs = [*sorted((ROOT / "grafana").rglob("*.json")), *sorted((ROOT / "prometheus").rglob("*.yml"))]
    for page in [*PROSE, *configs]:
        for name in set(METRIC.findall(page.read_text())) - NOT_METRICS:
            if name not in names:
                wrong.append(f"{page.relative_to(ROOT)}: {name}")
    assert not wrong, "metrics named that no registry exports:\n" + "\n".join(sorted(wrong))
    assert "kafila_requests_total" in names and "kafila_requests" not in names  # as scraped


def test_the_fleet_page_describes_exactly_the_keys_the_parsers_accept() -> None:
    schema = reference.fleet_schema()
    described = {table: set(keys) for table, keys in reference.FLEET_KEYS.items()}
    assert described == schema


def test_every_fleet_file_example_in_the_docs_uses_known_keys() -> None:
    schema = reference.fleet_schema()
    wrong, seen = [], 0
    for page in PROSE:
        for block in re.findall(r"```toml\n(.*?)```", page.read_text(), re.S):
            seen += 1
            data = tomllib.loads(block)
            tables = {
                "[session]": [data.get("session", {})],
                "[[device]]": data.get("device", []),
                "[fleet]": [data.get("fleet", {})],
                "[rendezvous]": [data.get("rendezvous", {})],
                "[[site]]": data.get("site", []),
                "[[site.host]]": [h for s in data.get("site", []) for h in s.get("host", [])],
            }
            for table, rows in tables.items():
                for row in rows:
                    wrong += [f"{page.relative_to(ROOT)}: {table} {k}" for k in set(row) - schema[table]]
    assert seen, "no ```toml fleet file in the docs"
    assert not wrong, "fleet-file keys the parsers reject:\n" + "\n".join(wrong)


def test_the_api_page_lists_exactly_the_routes_a_member_serves() -> None:
    routes = reference.api_routes()
    assert "POST /v1/chat/completions" in routes and "GET /healthz" in routes
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = set(re.findall(r"^\| `((?:GET|POST|PUT|DELETE) /[^`]*)` \|", page, re.M))
    assert listed == routes, f"missing: {sorted(routes - listed)}; not served: {sorted(listed - routes)}"
