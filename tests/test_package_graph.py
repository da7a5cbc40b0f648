"""The package graph is the one docs/architecture.md states: every import in kafila/ (at module
level, inside functions, under TYPE_CHECKING) follows an arrow the document allows, and the
graph has no cycle beyond the ones the document names as still to break."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KAFILA = ROOT / "kafila"


def layer(module: str) -> str | None:
    """The unit the rules speak of: a top-level package, or a part of session/ (session.ring)."""
    parts = module.split(".")
    if parts[0] != "kafila":
        return None
    if len(parts) == 1 or not ((KAFILA / parts[1]).is_dir() or (KAFILA / f"{parts[1]}.py").exists()):
        return "kafila"  # the package itself (`from kafila import __version__`)
    if parts[1] in ("__init__", "__main__"):
        return "kafila"
    if parts[1] == "session" and len(parts) > 2:
        return f"session.{parts[2]}"
    return parts[1]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def parsed(path: Path) -> ast.Module:
    """`path`'s syntax tree. CPython 3.11 keeps the AST constructor's recursion counter per
    interpreter, not per thread (gh-106905), so a thread an earlier test left running that parses
    at the same moment can make ast.parse raise "AST constructor recursion depth mismatch" (seen
    under load); parsing again is exact."""
    for _ in range(4):
        try:
            return ast.parse(path.read_text(), str(path))
        except SystemError:
            continue
    return ast.parse(path.read_text(), str(path))


def code_arrows() -> dict[tuple[str, str], list[str]]:
    """(from, to) -> the files whose imports draw that arrow."""
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(KAFILA.rglob("*.py")):
        src = layer(module_name(path))
        assert src is not None
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                dst = layer(target)
                if dst is not None and dst != src and str(path) not in arrows[(src, dst)]:
                    arrows[(src, dst)].append(str(path.relative_to(ROOT)))
    return arrows


def stated_rules() -> tuple[dict[str, set[str]], set[frozenset[str]]]:
    """The ```imports block of docs/architecture.md: `a -> b c` lines (`*` on the left: every
    layer may import those), and `cycle a b` lines for cycles still to break."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```imports\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```imports block"
    allowed: dict[str, set[str]] = defaultdict(set)
    cycles: set[frozenset[str]] = set()
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("cycle "):
            cycles.add(frozenset(line.split()[1:]))
        elif "->" in line:
            src, dsts = line.split("->", 1)
            allowed[src.strip()].update(dsts.split())
    return allowed, cycles


def test_every_import_follows_an_arrow_the_architecture_states() -> None:
    allowed, _ = stated_rules()
    wrong = {
        f"{src} -> {dst}: {', '.join(files)}"
        for (src, dst), files in code_arrows().items()
        if dst not in allowed[src] | allowed["*"] and "any" not in allowed[src]
    }
    assert not wrong, "imports docs/architecture.md does not allow:\n" + "\n".join(sorted(wrong))


def test_the_package_graph_has_no_cycle_beyond_the_stated_ones() -> None:
    _, stated = stated_rules()
    edges = {pair for pair in code_arrows() if pair[0] not in ("cli", "kafila")}
    cycles = {frozenset((a, b)) for a, b in edges if (b, a) in edges}
    assert cycles <= stated, f"new import cycles: {sorted(map(sorted, cycles - stated))}"
    # and no longer cycle: a walk from each layer never comes back to it (the stated pairs aside)
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        if frozenset((a, b)) not in stated:
            graph[a].add(b)
    for start in list(graph):
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            assert node != start, f"an import cycle passes through {start}"
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])


def test_the_rules_catch_a_wrong_arrow() -> None:
    """The check itself can fail: api importing session is an arrow the document forbids."""
    allowed, _ = stated_rules()
    assert "session.runtime" not in allowed["api"] | allowed["*"]
    assert "api" in allowed["session.ring"]  # the ring serves the API's interface
