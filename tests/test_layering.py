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


# The top layer: experiments/ holds the science, benchmarks/ the speed and hardware tooling.
# Both stand on the library; neither imports the other (a helper lives with its users), and
# the library imports neither.
SCRIPT_FOLDERS = {"experiments": ROOT / "experiments", "benchmarks": ROOT / "benchmarks"}


def _script_modules(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    return {p.stem: p for p in folder.rglob("*.py") if "results" not in p.relative_to(folder).parts}


def _top_level_imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return names


def _notebook_code(path: pathlib.Path) -> str:
    import json

    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_the_library_imports_no_script():
    scripts = {name for folder in SCRIPT_FOLDERS.values() for name in _script_modules(folder)}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            bad = _top_level_imports(path.read_text()) & scripts
            assert not bad, f"{path.relative_to(ROOT)} imports the script(s) {sorted(bad)}: the library is the lowest layer"


@pytest.mark.parametrize("folder,other", [("experiments", "benchmarks"), ("benchmarks", "experiments")])
def test_science_and_speed_stay_apart(folder, other):
    theirs = _script_modules(SCRIPT_FOLDERS[other])
    assert theirs, f"{other}/ has no scripts: has it moved?"
    for name, path in _script_modules(SCRIPT_FOLDERS[folder]).items():
        bad = _top_level_imports(path.read_text()) & set(theirs)
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} from {other}/: move the shared helper to its users"
        assert f'"{other}"' not in path.read_text(), f"{path.relative_to(ROOT)} puts {other}/ on its path"


def test_experiments_holds_no_speed_tooling():
    speed = [p.name for p in SCRIPT_FOLDERS["experiments"].glob("*.py")
             if p.name.startswith(("bench_", "_bench", "tune_", "gpu_", "hopper_"))]
    assert not speed, f"{speed} belong in benchmarks/ beside their results"


def test_notebooks_import_the_library_only():
    scripts = {name for folder in SCRIPT_FOLDERS.values() for name in _script_modules(folder)}
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        names = _top_level_imports("\n".join(line for line in _notebook_code(path).splitlines()
                                              if not line.lstrip().startswith(("%", "!"))))
        assert not names & scripts, f"{path.name} imports {sorted(names & scripts)}: notebooks import jfp8, not scripts"
        assert "pallas_kernels" not in names, f"{path.name} imports pallas_kernels: go through jfp8's one door"
