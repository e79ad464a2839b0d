"""The package's shape as ARCHITECTURE.md draws it: ``hetflow/tasks/`` holds the DAG's tasks and
nothing else, a stage imports no other stage, the package and the benches take only stages from it, a
stage shares no module state with one, nothing patches the interpreter's imports, the replica reaches
neither Airflow nor MLflow, no import cycle, the pipeline never imports the developer tools, no
grab-bag module, no module over 400 lines, no function of the package over 80 lines, a test file
named for what it tests, and the fast tier's guard against replicas.

Each rule is a function that returns what breaks it, run on the tree and on a planted violation."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

from conftest import REPO


def _module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _every_import(tree: ast.AST) -> set[str]:
    """Every module a tree imports, at its top or in a function, ``from a import b`` counting as a.b
    too (``from hetflow.tasks import train`` imports the module hetflow.tasks.train), and every
    module named in a string given to ``importlib.import_module``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
            found.add(ast.unparse(node.args[0]).strip("'\"f").split("{")[0].rstrip("."))
    return found


def _imports(path: Path, package: str) -> set[str]:
    """Every module of ``package`` that ``path`` imports, at its top or inside a function."""
    found = _every_import(ast.parse(path.read_text()))
    return {name for name in found if name == package or name.startswith(f"{package}.")}


def _graph(package: str) -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in (REPO / package).rglob("*.py")}
    return {name: _imports(path, package) & modules.keys() - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a package imports its parent's __init__ implicitly: ignored)."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for imported in sorted(graph[node]):
            if state.get(imported) == "open":
                return trail[trail.index(imported) :] + [imported]
            if imported not in state and (found := visit(imported, [*trail, imported])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_pipeline_package_has_no_import_cycle():
    graph = _graph("hetflow")
    # the walk found the tree
    assert {"hetflow.tasks.train", "hetflow.replica.sync", "hetflow.cluster.backends.local.replicas"} <= graph.keys()
    assert _cycle(graph) is None, _cycle(graph)


def test_a_cycle_is_found_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_in_the_pipeline_imports_the_developer_tools():
    for path in [*(REPO / "hetflow").rglob("*.py"), *(REPO / "dags").glob("*.py"), *(REPO / "plugins").glob("*.py")]:
        assert not _imports(path, "devstack"), path


def test_no_module_is_a_grab_bag():
    names = {path.stem for path in [*(REPO / "hetflow").rglob("*.py"), *(REPO / "devstack").rglob("*.py")]}
    assert not names & {"common", "utils", "helpers"}


STAGES_FOLDER = REPO / "hetflow" / "tasks"
MAX_LINES = 400
MAX_FUNCTION_LINES = 80


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]


def stage_imports_of_stages(stage_files: list[Path]) -> list[str]:
    """``stage imports other`` for each stage module that imports another stage."""
    stages = {path.stem for path in stage_files} - {"__init__"}
    broken = []
    for path in stage_files:
        for name in _every_import(ast.parse(path.read_text())):
            other = name.removeprefix("hetflow.tasks.").split(".")[0]
            if name.startswith("hetflow.tasks.") and other in stages and other != path.stem:
                broken.append(f"{path.stem} imports {other}")
    return sorted(set(broken))


def stage_internals_taken(files: list[Path]) -> list[str]:
    """``file: name from hetflow.tasks.stage`` for each name other than the stage itself that the package
    or a bench takes from a stage module: what others need is library code, which lives outside the stages."""
    taken = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetflow.tasks."):
                stage = node.module.removeprefix("hetflow.tasks.")
                taken += [f"{_shown(path)}: {a.name} from hetflow.tasks.{stage}" for a in node.names if a.name != stage]
    return taken


_MUTABLE_CALLS = {"set", "dict", "list", "defaultdict", "deque", "Counter", "OrderedDict"}


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Set, ast.Dict, ast.List, ast.SetComp, ast.DictComp, ast.ListComp)):
        return True
    return isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in _MUTABLE_CALLS


def module_state(files: list[Path], stage_files: list[Path]) -> list[str]:
    """A stage module binding a mutable value at its top (state another stage could read or
    change), and any module assigning to another module's attribute (state set from outside)."""
    broken = []
    for path in stage_files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_mutable(node.value):
                broken.append(f"{path.stem}: module-level {ast.unparse(node).split('=')[0].strip()}")
    for path in files:
        tree = ast.parse(path.read_text())
        modules = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        modules |= {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetflow")
            for alias in node.names
        }
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in modules
                ):
                    broken.append(f"{_shown(path)}: sets {ast.unparse(target)}")
    return broken


def import_hooks(files: list[Path]) -> list[str]:
    """Code that replaces how imports work: assigning ``__import__`` or ``import_module``, or
    touching ``sys.meta_path`` / ``sys.path_hooks``."""
    broken = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if ast.unparse(target).split(".")[-1] in ("__import__", "import_module"):
                    broken.append(f"{_shown(path)}: assigns {ast.unparse(target)}")
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("sys.meta_path", "sys.path_hooks"):
                broken.append(f"{_shown(path)}: touches {ast.unparse(node)}")
    return broken


def _top_level_imports(path: Path) -> set[str]:
    """What importing ``path`` imports: its top level, including under ``if`` and ``try``."""
    tree = ast.parse(path.read_text())
    scopes = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    inside = {id(inner) for scope in scopes for inner in ast.walk(scope)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def forbidden_in_replica(root: Path, forbidden: tuple[str, ...]) -> list[str]:
    """The import chains by which a replica (``python -m hetflow.replica``) reaches a forbidden
    package: every import of the replica package's own modules, then what the hetflow modules they
    reach import when imported."""

    def path_of(module: str) -> Path | None:
        base = root.joinpath(*module.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)

    replica = sorted((root / "hetflow" / "replica").rglob("*.py"))
    queue = [(_every_import(ast.parse(p.read_text())), [_module_name(p, root)]) for p in replica]
    seen, broken = set(), []
    while queue:
        imported, chain = queue.pop()
        for name in sorted(imported):
            if name.split(".")[0] in forbidden:
                broken.append(" -> ".join([*chain, name]))
            elif name.startswith("hetflow") and name not in seen and (found := path_of(name)):
                seen.add(name)
                queue.append((_top_level_imports(found), [*chain, name]))
    return broken


def long_modules(files: list[Path]) -> list[str]:
    return [f"{_shown(path)}: {n} lines" for path in files if (n := len(path.read_text().splitlines())) > MAX_LINES]


def long_functions(files: list[Path]) -> list[str]:
    """Every function (or method) over MAX_FUNCTION_LINES lines, its decorators left out."""
    return [
        f"{_shown(path)}: {node.name} {length} lines"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]


def _tracked_python() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in listed.split() if (REPO / name).exists()]


def test_the_stages_folder_holds_the_dags_tasks_and_nothing_else(hetflow_env):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    task_ids = set(bag.dags["hetflow_train"].task_ids) | set(bag.dags["hetflow_tune"].task_ids)
    held = {path.name for path in STAGES_FOLDER.iterdir() if path.name != "__pycache__"}
    # hetflow_deploy's tasks are the steps of one rollout: each calls deploy.py's one stage with its step.
    assert held == {f"{task_id}.py" for task_id in task_ids} | {"__init__.py", "deploy.py"}
    for task in bag.dags["hetflow_deploy"].tasks:
        assert "from hetflow.tasks import deploy as stage\n" in inspect.getsource(task.python_callable), task.task_id
        assert "stage.deploy(run_id, " in inspect.getsource(task.python_callable), task.task_id


def test_no_stage_imports_another_stage(tmp_path):
    assert stage_imports_of_stages(sorted(STAGES_FOLDER.glob("*.py"))) == []
    (tmp_path / "train.py").write_text("from hetflow.tasks.evaluate import evaluate\n")
    (tmp_path / "evaluate.py").write_text("import importlib\nimportlib.import_module('hetflow.tasks.train')\n")
    assert stage_imports_of_stages(sorted(tmp_path.glob("*.py"))) == [
        "evaluate imports train",
        "train imports evaluate",
    ]


def test_the_package_and_the_benches_take_only_a_stage_from_a_stage_module(tmp_path):
    outside_the_stages = [path for path in _python_files("hetflow", "bench") if STAGES_FOLDER not in path.parents]
    assert stage_internals_taken(outside_the_stages) == []
    (tmp_path / "gate.py").write_text("from hetflow.tasks.export import export, judge\n")
    assert stage_internals_taken([tmp_path / "gate.py"]) == ["gate.py: judge from hetflow.tasks.export"]


def test_no_module_state_passes_between_stages(tmp_path):
    stages = sorted(STAGES_FOLDER.glob("*.py"))
    assert module_state(_python_files("hetflow", "dags", "plugins"), stages) == []
    planted = tmp_path / "provision_cluster.py"
    planted.write_text("PROVISIONED_HERE: set[str] = set()\nLOG = 'fine'\n")
    setter = tmp_path / "dag_run.py"
    setter.write_text("from hetflow.tasks import train\ntrain.IMPORT_LATER_STAGES = True\n")
    assert module_state([setter], [planted]) == [
        "provision_cluster: module-level PROVISIONED_HERE: set[str]",
        "dag_run.py: sets train.IMPORT_LATER_STAGES",
    ]


def test_nothing_patches_the_interpreters_imports(tmp_path):
    assert import_hooks(_python_files("hetflow", "dags", "plugins")) == []
    hook = tmp_path / "timings.py"
    hook.write_text("import builtins, sys\nbuiltins.__import__ = print\nsys.meta_path.insert(0, None)\n")
    assert import_hooks([hook]) == ["timings.py: assigns builtins.__import__", "timings.py: touches sys.meta_path"]


def test_the_replica_reaches_neither_airflow_nor_mlflow(tmp_path):
    assert forbidden_in_replica(REPO, ("airflow", "mlflow")) == []
    (tmp_path / "hetflow" / "replica").mkdir(parents=True)
    (tmp_path / "hetflow" / "replica" / "__main__.py").write_text("def main():\n    from hetflow import paths\n")
    (tmp_path / "hetflow" / "paths.py").write_text("import mlflow.tracking\ndef later():\n    import airflow\n")
    assert forbidden_in_replica(tmp_path, ("airflow", "mlflow")) == [
        "hetflow.replica.__main__ -> hetflow.paths -> mlflow.tracking"
    ]


def test_no_module_is_over_400_lines(tmp_path):
    assert long_modules(_tracked_python()) == []
    (tmp_path / "long.py").write_text("pass\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("pass\n" * MAX_LINES)
    assert long_modules(sorted(tmp_path.glob("*.py"))) == ["long.py: 401 lines"]


def test_no_function_of_the_package_or_the_benches_is_over_80_lines(tmp_path):
    assert long_functions(_python_files("hetflow", "bench")) == []
    (tmp_path / "long.py").write_text("class Worker:\n    def train(self):\n" + "        pass\n" * MAX_FUNCTION_LINES)
    (tmp_path / "short.py").write_text("def train():\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1))
    assert long_functions(sorted(tmp_path.glob("*.py"))) == ["long.py: train 81 lines"]


# What a test file's name may start with after ``test_``: a module or package of hetflow, or one of these.
TEST_PREFIXES = {"dags", "devstack", "docker", "bench", "layout", "e2e", "security"}


def misnamed_tests(test_files: list[Path], package: Path) -> list[str]:
    """Test files whose name does not say what they test (``test_<package>_<module>.py``, or a
    cross-cutting prefix)."""
    known = TEST_PREFIXES | {
        path.stem for path in package.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists()
    }
    return [path.name for path in test_files if path.stem.removeprefix("test_").split("_")[0] not in known]


def test_a_test_file_is_named_for_what_it_tests(tmp_path):
    assert misnamed_tests(sorted((REPO / "tests").glob("test_*.py")), REPO / "hetflow") == []
    for name in ("test_cluster_lease.py", "test_e2e_run.py", "test_promotion.py"):
        (tmp_path / name).touch()
    assert misnamed_tests(sorted(tmp_path.glob("test_*.py")), REPO / "hetflow") == ["test_promotion.py"]


def test_docs_state_the_naming_rule_this_file_checks():
    """docs/testing.md names the cross-cutting prefixes: the same ones ``misnamed_tests`` allows."""
    rule = (REPO / "docs" / "testing.md").read_text().split("cross-cutting prefixes", 1)[1].split("(", 1)[0]
    assert set(re.findall(r"`(\w+)`", rule)) == TEST_PREFIXES, rule


def test_the_replica_guard_knows_a_replica_start_when_it_sees_one():
    from replica_guard import starts_replicas

    assert starts_replicas(["/venv/bin/python", "-m", "hetflow.cluster.backends.local.keeper", "--run-dir", "/runs/a"])
    assert starts_replicas("python -m hetflow.replica --run-dir /runs/a")
    assert not starts_replicas(["git", "status"])
    assert not starts_replicas(["python", "-m", "hetflow.cli.main", "validate"])


def architecture_tree(text: str) -> set[str]:
    """The paths that ARCHITECTURE.md's tree lists (the code block under "## The tree", two spaces a
    level, a folder's name ending in "/")."""
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    paths, folders = set(), []
    for line in block.strip("\n").splitlines():
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        folders[depth:] = [name] if name.endswith("/") else []
        paths.add("".join(folders[:depth]) + name)
    return paths


def tracked_layout(tracked: list[str]) -> set[str]:
    """What the tree says it lists: every tracked top-level file and folder, and hetflow/ and docs/ file
    by file, a sub-package's ``__init__.py`` and docs/screenshots/' images left out."""
    paths = set()
    for path in tracked:
        parts = path.split("/")
        paths.add(parts[0] + ("/" if len(parts) > 1 else ""))
        if parts[0] not in ("hetflow", "docs"):
            continue
        paths.update("/".join(parts[:depth]) + "/" for depth in range(2, len(parts)))
        if not (parts[-1] == "__init__.py" and len(parts) > 2) and parts[:2] != ["docs", "screenshots"]:
            paths.add(path)
    return paths


def test_architecture_md_lists_the_tracked_layout():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    text = (REPO / "ARCHITECTURE.md").read_text()
    assert architecture_tree(text) == tracked_layout(tracked)
    # A module's line gone from the tree shows as that module.
    keeper = next(line for line in text.splitlines() if line.lstrip().startswith("keeper.py "))
    assert tracked_layout(tracked) - architecture_tree(text.replace(keeper + "\n", "")) == {
        "hetflow/cluster/backends/local/keeper.py"
    }
