"""The import graph of the library: one direction, no circles, one door to the kernels.

Every import counts, function-level ones too (they hide circles, not remove them).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jfp8", "pallas_kernels")
# The two pure-jnp rule modules the kernels share with the reference, so that both compute the
# same bits by construction: the elementwise E4M3 rules and the grouped work schedule.
SHARED_RULES = {"pallas_kernels.fp8_math": {"jfp8.fp8"}, "pallas_kernels.schedule": {"jfp8.reference"}}
THE_DOOR = "jfp8.api"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                subs = [f"{base}.{a.name}" for a in node.names]
                # `from pkg import submodule` needs the submodule, not what pkg/__init__ imports
                targets = subs + ([base] if not any(t in modules for t in subs) else [])
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    graph = _graph()
    assert "jfp8.api" in graph and "pallas_kernels.gemm" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_one_door_to_the_kernels_and_one_direction():
    graph = _graph()
    for name, deps in graph.items():
        kernel_deps = {d for d in deps if d.startswith("pallas_kernels")}
        if name.startswith("pallas_kernels"):
            assert not {d for d in deps if d.startswith("jfp8")}, f"{name} imports jfp8: kernels are the lowest layer"
        elif name != THE_DOOR and name != "jfp8":
            allowed = {rule for rule, users in SHARED_RULES.items() if name in users}
            assert kernel_deps <= allowed | {"pallas_kernels"} and not (kernel_deps - allowed), (
                f"{name} imports {sorted(kernel_deps - allowed)}: only {THE_DOOR} calls the kernels")


@pytest.mark.parametrize("forbidden", ["argparse", "torch"])
def test_the_library_is_not_the_bench(forbidden):
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert forbidden not in names, f"{path.relative_to(ROOT)} imports {forbidden}"
