"""The house's structure, pinned: imports flow one way, no import hides in a function, few top-level modules.

The rooms are drawn in docs/architecture.md. Each check is shown able to fail on a planted violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specula

PACKAGE = Path(specula.__file__).resolve().parent

# Entry points: each may import the layers below, none imports another (the command line imports them all).
ENTRY_POINTS = ("specula.bench", "specula.certify", "specula.serve", "specula.training")
# What the decode loop and everything under it may never import: the assemblers above it and the entry points.
ABOVE_THE_LOOP = ("specula.methods", "specula.api", "specula.chat.session", "specula.cli", *ENTRY_POINTS)
BELOW_THE_LOOP = ("specula.decoding", "specula.drafters", "specula.acceptance", "specula.acceptance_typical",
                  "specula.sampling", "specula.tree", "specula.heads", "specula.runtime", "specula.gguf",
                  "specula.files", "specula.kernels", "specula.chat.template", "specula.errors",
                  "specula.detokenize")
# Imports inside a function, each for a reason other than a cycle.
LAZY_ALLOWED = {
    ("specula.cli.serve", "specula.serve"): "FastAPI and uvicorn load only for `specula serve`",
    ("specula.cli", "specula.cli"): "each subcommand's module (trainers, benchmark, certifier) loads only for it",
    ("specula", "specula.certify"): "`specula.check` loads the certifier when first asked for",
}


def module_name(path: Path) -> str:
    return ".".join(("specula", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(modules of the package imported at module level, those imported inside a function) by ``path``."""
    top: set[str] = set()
    inner: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("specula"):
                names = [child.module, *(f"{child.module}.{alias.name}" for alias in child.names)]
            elif isinstance(child, ast.Import):
                names = [alias.name for alias in child.names if alias.name.startswith("specula")]
            (inner if in_function else top).update(n for n in names if n in MODULES)
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return top, inner


def module_graph(include_functions: bool = True) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        top, inner = imports_of(path)
        graph[name] = {m for m in (top | inner if include_functions else top) if m != name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def within(name: str, rooms: tuple[str, ...]) -> str | None:
    return next((room for room in rooms if name == room or name.startswith(room + ".")), None)


def back_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs against the layers: an entry point into another, or the loop's floor upwards."""
    wrong = []
    for name, imported in graph.items():
        for other in sorted(imported):
            mine, theirs = within(name, ENTRY_POINTS), within(other, ENTRY_POINTS)
            if mine and theirs and mine != theirs:
                wrong.append(f"{name} -> {other}")
            if within(name, BELOW_THE_LOOP) and within(other, ABOVE_THE_LOOP):
                wrong.append(f"{name} -> {other}")
            if within(name, BELOW_THE_LOOP) and other == "specula.decoding" and name != "specula.decoding":
                wrong.append(f"{name} -> {other}")
    return wrong


def test_package_imports_have_no_cycle_even_counting_imports_inside_functions():
    graph = module_graph()
    assert import_cycle(graph) == []
    graph["specula.runtime.target"] = graph["specula.runtime.target"] | {"specula.methods"}  # the check can fail
    assert import_cycle(graph)


def test_imports_flow_one_way_between_the_rooms():
    graph = module_graph()
    assert back_imports(graph) == []
    graph["specula.certify.check"] = graph["specula.certify.check"] | {"specula.bench.runners"}
    graph["specula.drafters.eagle"] = graph["specula.drafters.eagle"] | {"specula.decoding"}
    assert sorted(back_imports(graph)) == ["specula.certify.check -> specula.bench.runners",
                                           "specula.drafters.eagle -> specula.decoding"]


def test_no_module_of_the_package_is_imported_inside_a_function_without_a_reason():
    lazy = sorted((name, other) for name, path in MODULES.items() for other in imports_of(path)[1]
                  if other != name and not any(name == a and (other == b or other.startswith(b + "."))
                                               for a, b in LAZY_ALLOWED))
    assert lazy == []
    planted = ast.parse("def f():\n    from specula.runtime.target import Target\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(planted.body[0]))  # what the walk above looks for


def test_the_top_level_holds_at_most_fifteen_modules():
    top_level = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top_level) <= 15, top_level


def test_argparse_is_used_only_in_the_cli_package():
    users = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for alias in node.names} | {node.module for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom) and node.module}
        if "argparse" in names and path.parent.name != "cli":
            users.append(str(path.relative_to(PACKAGE)))
    assert users == []


def test_every_module_of_the_package_is_at_most_400_lines():
    long = sorted(f"{name} ({n})" for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400)
    assert long == []
