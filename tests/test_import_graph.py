"""No import circle: the package's modules and the laboratory's (benchmarks/) import one way, and
the installed package holds no benchmark module.

The graph is read from the source (ast): every `import` and `from ... import` of a trajflow or
benchmarks module. In the laboratory, one inside a function counts too: an import deferred into a
function still ties two modules together (benchmarks' `table` once lived in run_all, which imports
every benchmark: a circle that only function-level imports hid). In the package, the imports a
module runs when it is imported (its top level, `if TYPE_CHECKING:` left out): the package defers
some imports on purpose (torch-free validation, Ray only where it runs)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"trajflow": "trajflow", "schemas": "trajflow.schemas", "algorithms": "trajflow.algorithms",
                "engines": "trajflow.engines", "tasks": "trajflow.tasks", "operators": "trajflow.operators",
                "pipelines": "trajflow.pipelines", "jobs": "trajflow.jobs", "benchmarks": "benchmarks"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, dotted in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([dotted, *parts])] = path
    return found


def _top_level(tree: ast.Module):
    """The statements a module runs when imported (into if/try blocks, not `if TYPE_CHECKING:`)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]


def imports(path: Path, name: str, known: set[str], anywhere: bool = True) -> set[str]:
    """The known modules `path` (module `name`) imports: anywhere in it, or at its top level."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if anywhere else _top_level(tree)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_and_the_package_never_imports_the_laboratory():
    found = modules()
    lab = {name for name in found if name.startswith("benchmarks")}
    anywhere = {name: imports(found[name], name, lab) for name in lab}
    assert not cycles(anywhere), cycles(anywhere)
    package = {name for name in found if name.startswith("trajflow")}
    top = {name: imports(found[name], name, package, anywhere=False) for name in package}
    assert not cycles(top), cycles(top)
    wrong = [(name, dep) for name in package for dep in imports(found[name], name, set(found)) if dep in lab]
    assert not wrong, f"the package imports the laboratory: {wrong}"


def test_the_installed_package_holds_no_benchmark_module():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert not any(p.startswith("benchmarks") or p.endswith(".benchmarks") for p in setuptools["packages"])
    assert not any("benchmarks" in d for d in setuptools.get("package-dir", {}).values())


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
