"""The package's shape: no import cycles (imports inside functions included), and the top-level functions
that read like the algorithm stay short enough to read."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports anywhere in its file (functions included)."""
    modules = {".".join(f.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): f
               for f in package.rglob("*.py")}
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules that has one (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_cycle_through_an_import_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_vagen_has_no_import_cycles():
    found = cycles(import_graph(ROOT / "vagen"))
    assert found == [], f"import cycles in vagen/ (imports inside functions included): {found}"


def test_the_core_algorithms_import_nothing_of_ours_but_themselves():
    graph = import_graph(ROOT / "vagen")
    outside = {m: sorted(d for d in deps if not d.startswith("vagen.core")) for m, deps in graph.items()
               if m.startswith("vagen.core")}
    assert all(not deps for deps in outside.values()), outside


@pytest.mark.parametrize("path, name", [("vagen/train.py", "main"), ("vagen/update.py", "ppo_update"),
                                        ("vagen/rollout.py", "rollout"), ("vagen/decoding_hf.py", "generate"),
                                        ("vagen/decoding_hf.py", "_decode"), ("vagen/decoding_hf.py", "_feed")])
def test_the_functions_that_read_like_the_algorithm_stay_under_80_lines(path, name):
    tree = ast.parse((ROOT / path).read_text())
    lengths = [n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert lengths and max(lengths) < 80, f"{path}:{name} has {lengths} lines"


def test_no_file_of_the_vllm_decoder_is_over_400_lines():
    files = sorted((ROOT / "vagen" / "decoding_vllm").glob("**/*.py"))
    assert {f.name for f in files} >= {"__init__.py", "engine.py", "weights.py", "play.py"}, files
    lengths = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in files}
    assert all(n <= 400 for n in lengths.values()), f"files over 400 lines: {lengths}"


# vLLM's modules vagen imports outside vagen/vllm_compat.py, which holds every reach into its internals
VLLM_PUBLIC_MODULES = {"vllm", "vllm.sampling_params", "vllm.lora.request"}


def vllm_imports(path: Path) -> set[str]:
    """The vLLM modules `path` imports anywhere (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found.update(name for name in names if name == "vllm" or name.startswith("vllm."))
    return found


def test_only_vllm_compat_imports_vllms_internal_modules(tmp_path):
    (tmp_path / "reach.py").write_text("def f():\n    import vllm.envs\n    from vllm import LLM\n")
    assert vllm_imports(tmp_path / "reach.py") == {"vllm.envs", "vllm"}
    outside = {str(f.relative_to(ROOT)): sorted(vllm_imports(f) - VLLM_PUBLIC_MODULES)
               for f in (ROOT / "vagen").rglob("*.py") if f.name != "vllm_compat.py"}
    assert not any(outside.values()), f"vLLM internals imported outside vagen/vllm_compat.py: {outside}"
