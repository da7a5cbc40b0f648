"""The package graph is the one docs/architecture.md states: every import in kafila/ (at module
level, inside functions, under TYPE_CHECKING) follows an arrow the document allows, and the
graph has no cycle beyond the ones the document names as still to break, between layers or
between the modules of one layer (`module-cycle` lines)."""

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


def imported(tree: ast.Module) -> list[str]:
    """Every absolute import's target in `tree` (a `from m import n` names m and m.n), wherever
    it stands: at module level, in a function, under TYPE_CHECKING."""
    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
    return targets


def code_arrows() -> dict[tuple[str, str], list[str]]:
    """(from, to) -> the files whose imports draw that arrow."""
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(KAFILA.rglob("*.py")):
        src = layer(module_name(path))
        assert src is not None
        for target in imported(parsed(path)):
            dst = layer(target)
            if dst is not None and dst != src and str(path) not in arrows[(src, dst)]:
                arrows[(src, dst)].append(str(path.relative_to(ROOT)))
    return arrows


def module_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of `sources` (module name -> its text) it imports: a target that is
    no module of them (`from kafila.a.b import name`) counts as the module that holds it."""

    def holder(target: str) -> str | None:
        while target and target not in sources:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, text in sources.items():
        for target in imported(ast.parse(text)):
            dst = holder(target)
            if dst is not None and dst != module and not (module.startswith(f"{dst}.")):
                graph[module].add(dst)  # (a module importing its own package's __init__ is no cycle)
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The modules that import each other, directly or round a longer loop: each strongly
    connected group of two or more (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(frozenset(group))
    return groups


def code_modules() -> dict[str, str]:
    return {module_name(path): path.read_text() for path in sorted(KAFILA.rglob("*.py"))}


def stated_rules() -> tuple[dict[str, set[str]], set[frozenset[str]]]:
    """The ```imports block of docs/architecture.md: `a -> b c` lines (`*` on the left: every
    layer may import those), and `cycle a b` lines for cycles still to break."""
    allowed: dict[str, set[str]] = defaultdict(set)
    cycles: set[frozenset[str]] = set()
    for line in imports_block():
        if line.startswith("cycle "):
            cycles.add(frozenset(line.split()[1:]))
        elif "->" in line:
            src, dsts = line.split("->", 1)
            allowed[src.strip()].update(dsts.split())
    return allowed, cycles


def imports_block() -> list[str]:
    """The ```imports block of docs/architecture.md, its lines without comments."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```imports\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```imports block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]


def stated_module_cycles() -> set[frozenset[str]]:
    """`module-cycle a b` lines: modules that still import each other, to break."""
    return {frozenset(line.split()[1:]) for line in imports_block() if line.startswith("module-cycle ")}


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


def test_no_two_modules_import_each_other_beyond_the_stated_ones() -> None:
    """Also within one layer, and also where one side imports only for its types (TYPE_CHECKING)."""
    found = set(module_cycles(module_graph(code_modules())))
    new = found - stated_module_cycles()
    assert not new, f"new module import cycles: {sorted(map(sorted, new))}"
    gone = stated_module_cycles() - found
    assert not gone, f"stated module cycles that are gone (drop their lines): {sorted(map(sorted, gone))}"


def test_the_module_check_catches_a_cycle_of_type_only_imports() -> None:
    """The check itself can fail: two modules of one layer importing each other, one of them
    only under TYPE_CHECKING (as forming.arrivals and forming.epochs did), and a longer loop."""
    sources = {
        "kafila.session.forming.arrivals": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from kafila.session.forming.epochs import HostEpochs\n"
        ),
        "kafila.session.forming.epochs": "from kafila.session.forming.arrivals import HostArrivals\n",
        "kafila.a": "import kafila.b\n",
        "kafila.b": "def f():\n    from kafila.c import g\n",
        "kafila.c": "from kafila import a\n",
        "kafila": "",
        "kafila.d": "from kafila.a import x\nfrom kafila import __version__\n",
    }
    assert set(module_cycles(module_graph(sources))) == {
        frozenset({"kafila.session.forming.arrivals", "kafila.session.forming.epochs"}),
        frozenset({"kafila.a", "kafila.b", "kafila.c"}),
    }
