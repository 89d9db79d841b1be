"""The package's import graph, measured: circles, folder sizes, and where modes and torch
internals are read.

    python scripts/import_graph.py            # a report
    python scripts/import_graph.py --check    # exit 1 on a circle (of modules, or of sibling
                                              # folders), an arrow back up,
                                              # importlib, torch internals outside _torch,
                                              # or the validation switch read too widely

Every ``import`` of a tensorpar module counts, at module level or inside a function (an
import inside a function hides a circle from Python, not from the design). A circle is a
strongly connected component of more than one module.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The layers, lowest first: an import from a lower layer into a higher one runs back up.
LAYERS = [["_torch", "errors", "_not_data"], ["comm"], ["placeholder", "collaborative"],
          ["validation"], ["hierarchical"], ["collectives"], ["ddp"],
          ["nn", "domain", "context", "pipeline", "launch"], ["testing", "bench", "__init__"]]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
# Inside a package: its sub-packages, lowest first (its own modules stand above them all).
INNER = {"domain": ["_tiles", "_layers", "_forward"]}
PACKAGE = ROOT / "tensorpar"
TORCH_PRIVATE = re.compile(r"\btorch(?:\.[A-Za-z_]+)*\._[a-z][A-Za-z_]*")
# Reading the validation switch is deciding a call's mode: the switch and validation, the
# compile dispatch, the layers' path, the reducer, the replica check, the domain layout and
# the attention entry points (lengths passed are exchanged anyway when validating).
SWITCH_READ = re.compile(r"VALIDATE\[0\]|SWITCH\[0\]|validation_enabled\(\)")
MAX_SWITCH_READERS = 8


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The first name below ``tensorpar`` (a package, or a top-level module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def inner_level(module: str) -> int | None:
    """A module's place in its package's `INNER` order (``None``: the package has none)."""
    parts = module.split(".")
    order = INNER.get(parts[1]) if len(parts) > 1 else None
    if order is None:
        return None
    return order.index(parts[2]) if len(parts) > 2 and parts[2] in order else len(order)


def runs_back_up(a: str, b: str) -> bool:
    """Whether ``a`` importing ``b`` runs from a lower layer (or sub-package) to a higher one."""
    if package_of(a) != package_of(b):
        return LEVEL.get(package_of(a), 99) < LEVEL.get(package_of(b), 99)
    low, high = inner_level(a), inner_level(b)
    return low is not None and high is not None and low < high


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The tensorpar modules ``path`` imports (a package import counts as its __init__)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from package import submodule" depends on the submodule, not on the package
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != "tensorpar":
                found.add(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder_circles(graph: dict[str, set[str]], folder: dict[str, str]) -> list[list[str]]:
    """Circles among the sub-folders of one package (``nn/layers`` <-> ``nn/state``).

    A circle of modules across folders is already a circle; this finds folders that import
    each other through different modules, so that neither can be read without the other.
    """
    between: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            fa, fb = folder[a], folder[b]
            if fa != fb and fa.count("/") >= 2 and fa.rpartition("/")[0] == fb.rpartition("/")[0]:
                between[fa].add(fb)
    for f in set(folder.values()):
        between.setdefault(f, set())
    return circles(dict(between))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 on a circle, an arrow back up, importlib, torch "
                             "internals outside tensorpar._torch, or the validation switch "
                             "read in more than MAX_SWITCH_READERS modules")
    parser.add_argument("--list", metavar="PACKAGE", help="also list PACKAGE's arrows back up")
    args = parser.parse_args()
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports_of(p, set(files)) - {m} for m, p in files.items()}
    found = circles(graph)
    folder = {m: str(p.parent.relative_to(ROOT)) for m, p in files.items()}
    found_folders = folder_circles(graph, folder)
    per_folder = collections.Counter(str(p.parent.relative_to(ROOT)) for p in files.values())
    texts = {m: p.read_text() for m, p in files.items()}
    validate = sorted(m for m, t in texts.items() if SWITCH_READ.search(t))
    private = {m: sorted(set(TORCH_PRIVATE.findall(t))) for m, t in texts.items()}
    private = {m: v for m, v in private.items() if v}
    importlib = sorted(m for m, t in texts.items() if re.search(r"\bimportlib\b", t))
    print(f"{len(files)} modules; {sum(len(v) for v in graph.values())} import arrows")
    print(f"circles: {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    print(f"circles between sibling folders: {len(found_folders)}")
    for c in found_folders:
        print("  " + " <-> ".join(c))
    back = collections.Counter(
        (package_of(a), package_of(b)) for a, targets in graph.items() for b in targets
        if runs_back_up(a, b))
    print(f"arrows back up (a lower layer importing a higher one): {sum(back.values())}")
    for (a, b), n in sorted(back.items()):
        print(f"  {a} -> {b}: {n}")
        if args.list == a:
            for m, targets in sorted(graph.items()):
                for t in sorted(targets):
                    if package_of(m) == a and package_of(t) == b:
                        print(f"      {m} -> {t}")
    print("modules per folder:")
    for folder, n in sorted(per_folder.items()):
        print(f"  {n:3d}  {folder}")
    print(f"modules reading the validation switch: {len(validate)} (at most {MAX_SWITCH_READERS})")
    for m in validate:
        print(f"  {m}")
    print(f"modules naming torch private names: {len(private)}")
    for m, names in sorted(private.items()):
        print(f"  {m}: {', '.join(names)}")
    print(f"modules using importlib: {len(importlib)} {importlib}")
    broken = (found or found_folders or back or importlib or set(private) - {"tensorpar._torch"}
              or len(validate) > MAX_SWITCH_READERS)
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
