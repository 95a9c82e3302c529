"""The package's shape, checked from its source: layers that import only downward (lazy imports included), no
import circle, TRL's import paths as thin faces, and the size limits (files of at most 500 lines, functions of at
most 80). docs/architecture.md draws the same layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"

# Bottom to top: a module may import its own package and any package of a lower rank, never a higher one.
LAYERS = [
    ("errors", "version"),
    ("runtime",),
    ("losses",),
    ("data",),
    ("models",),
    ("tools",),
    ("generation",),
    ("rewards",),
    ("training",),
    ("callbacks",),
    ("online",),
    ("trainers",),
    ("experimental",),
    ("cli",),
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}
FACE_RANK = len(LAYERS)  # the TRL face and the top-level namespace: everything else
# TRL's import paths: only imports and re-exports (a module-level __getattr__ may forward names lazily).
FACES = (
    "trainer",
    "scripts",
    "compat",
    "data_utils",
    "chat_template_utils",
    "import_utils",
    "extras",
    "distributed",
    "kernels",
)
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def rank(module: str) -> int:
    parts = module.split(".")
    return RANK.get(parts[1], FACE_RANK) if len(parts) > 1 else FACE_RANK


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "face"


def imports_of(module: str, modules: dict[str, Path] = MODULES) -> set[str]:
    """posttrain modules that `module` imports anywhere in its body (a lazy import inside a function counts)."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != module and target.startswith("posttrain"):
                found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_package_has_a_layer():
    packages = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    unplaced = packages - set(RANK) - set(FACES) - {"__main__"}
    assert not unplaced, f"packages with no layer in LAYERS (place them, and in docs/architecture.md): {unplaced}"


def test_layers_import_only_downward():
    upward = [
        f"{source} -> {target}"
        for source, targets in GRAPH.items()
        for target in targets
        if layer(source) != layer(target) and rank(target) >= rank(source)
    ]
    assert not upward, "imports up (or across) a layer:\n" + "\n".join(sorted(upward))


def test_no_import_circle():
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def synthetic_tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    """Writes `files` (path -> source) under `root` and returns them as the checkers' module map."""
    modules = {}
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[name.removesuffix(".py").replace("/", ".")] = path
    return modules


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The graph must count an import inside a function body, a relative import and a `from package import
    module`, or the layer test would miss them."""
    files = {
        "posttrain/models/a.py": "def f():\n    from posttrain.trainers.sft import SFTTrainer\n",
        "posttrain/models/b.py": "from .a import f\nfrom ..trainers import grpo\n",
        "posttrain/trainers/sft.py": "",
        "posttrain/trainers/grpo.py": "",
    }
    modules = synthetic_tree(tmp_path, files)
    assert imports_of("posttrain.models.a", modules) == {"posttrain.trainers.sft"}
    assert imports_of("posttrain.models.b", modules) == {"posttrain.models.a", "posttrain.trainers.grpo"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.count(".") and m.split(".")[1] in FACES))
def test_trl_faces_are_thin(module):
    """A TRL import path only re-exports the core: no class, and no function but a lazy `__getattr__`."""
    tree = ast.parse(MODULES[module].read_text())
    defined = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name != "__getattr__"
    ]
    assert not defined, f"{module} defines {defined}; move the logic into the core and re-export it here"


def oversize(module: str) -> list[str]:
    """What of `module` is over a size limit: the file itself and each function over the limit."""
    text = MODULES[module].read_text()
    lines = len(text.splitlines())
    found = [f"the file ({lines} lines, at most {MAX_FILE_LINES})"] if lines > MAX_FILE_LINES else []
    return found + [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, at most {MAX_FUNCTION_LINES})"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_file_and_function_sizes(module):
    found = oversize(module)
    assert not found, f"{module} is over a size limit, split it: {found}"


def test_architecture_doc_names_real_files_and_every_layer():
    """docs/architecture.md is the map of this tree: each file it names exists, and each layer is on it."""
    import re

    root = PACKAGE.parent
    text = (root / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:tests|posttrain|[a-z_]+)/[\w/]*\.py)", text))
    assert len(named) > 30, "the file pattern no longer finds the paths the document names"
    missing = sorted(p for p in named if not (root / p).exists() and not (PACKAGE / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    absent = sorted(
        p for packages in LAYERS for p in packages if p not in {"errors", "version"} and f"{p}/" not in text
    )
    assert not absent, f"layers missing from docs/architecture.md: {absent}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(module: str, modules: dict[str, Path] = MODULES) -> list[str]:
    """The private names `module` takes from other posttrain modules: an imported `_name`, a private module imported
    from outside its own package, or `some_module._name` on an imported module. A package's own private modules
    (`experimental/_moved.py`) are its business."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, module_names = [], set()

    def check_source(source: str, line: int):
        parts = source.split(".")
        for i, part in enumerate(parts):
            if is_private(part) and ".".join(parts[:i]) != package:
                found.append(f"{module}:{line} imports the private module {source}")
                return

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("posttrain"):
                    check_source(alias.name, node.lineno)
                    module_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            if not source.startswith("posttrain"):
                continue
            check_source(source, node.lineno)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:
                    check_source(target, node.lineno)
                    module_names.add(alias.asname or alias.name)
                elif is_private(alias.name):
                    found.append(f"{module}:{node.lineno} imports {alias.name} from {source}")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_names:
            if is_private(node.attr):
                found.append(f"{module}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def is_base_class(name: str, ours: set[str]) -> bool:
    """A posttrain trainer or mixin: what another trainer subclasses (`DataReport.of(self)` is a factory)."""
    return name in ours and name.endswith(("Trainer", "Mixin"))


def unbound_calls(module: str, modules: dict[str, Path] = MODULES) -> list[str]:
    """Where a class of `module` runs another posttrain class's method on itself, past the method resolution order:
    `OtherTrainer.method(self, ...)`, `super(OtherClass, self)`, or a method borrowed as `name = Other.method`.
    Such a call skips the overrides in between (and ties the two classes' private code together); the shared
    step belongs in a public base or hook instead."""
    tree = ast.parse(modules[module].read_text())
    ours = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("posttrain")):
            ours |= {alias.asname or alias.name for alias in node.names}
    found = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func, names = node.func, [arg.id if isinstance(arg, ast.Name) else None for arg in node.args]
            if isinstance(func, ast.Name) and func.id == "super" and names[1:] == ["self"]:
                if names[0] is not None and names[0] != cls.name:
                    found.append(f"{module}:{node.lineno} super({names[0]}, self) in {cls.name}")
            elif (
                names[0] == "self"
                and isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and is_base_class(func.value.id, ours)
                and func.value.id != cls.name
            ):
                found.append(f"{module}:{node.lineno} {func.value.id}.{func.attr}(self, ...) in {cls.name}")
        for statement in cls.body:
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Attribute):
                value = statement.value
                if (
                    isinstance(value.value, ast.Name)
                    and is_base_class(value.value.id, ours)
                    and not value.attr.isupper()
                ):
                    found.append(f"{module}:{statement.lineno} borrows {value.value.id}.{value.attr} in {cls.name}")
    return found


def test_no_module_takes_another_modules_private_names():
    """Shared machinery is public and documented where it lives (`training/class_metrics.py`, ...); a private
    helper is its module's own."""
    found = [reach for module in MODULES for reach in private_reaches(module)]
    assert not found, "private names taken from another module (make the helper public):\n" + "\n".join(found)


def test_no_class_runs_another_classes_method_on_itself():
    found = [call for module in MODULES for call in unbound_calls(module)]
    assert not found, "methods run past the method resolution order (use a public base or hook):\n" + "\n".join(found)


def test_the_private_and_unbound_checkers_see_what_they_must(tmp_path):
    files = {
        "posttrain/trainers/a.py": "from posttrain.trainers.b import _helper, public\n"
        "from posttrain.experimental import _moved\nimport posttrain\nX = posttrain._EXPORTS\n",
        "posttrain/trainers/b.py": "from posttrain.trainers.kto import KTOTrainer, OtherTrainer\n"
        "class BTrainer(KTOTrainer):\n"
        "    count = KTOTrainer.count_loss_items\n"
        "    COLUMNS = KTOTrainer.REF_COLUMNS\n"
        "    def f(self):\n"
        "        KTOTrainer._record(self, 1)\n"
        "        super(OtherTrainer, self).g()\n"
        "        super(BTrainer, self).g()\n"
        "        DataReport.of(self)\n",
        "posttrain/experimental/c.py": "from posttrain.experimental._moved import warn\nfrom . import _moved\n",
        "posttrain/experimental/_moved.py": "",
        "posttrain/trainers/kto.py": "",
    }
    modules = synthetic_tree(tmp_path, files)
    assert private_reaches("posttrain.trainers.a", modules) == [
        "posttrain.trainers.a:1 imports _helper from posttrain.trainers.b",
        "posttrain.trainers.a:2 imports the private module posttrain.experimental._moved",
        "posttrain.trainers.a:4 reads posttrain._EXPORTS",
    ]
    assert private_reaches("posttrain.experimental.c", modules) == []
    assert sorted(unbound_calls("posttrain.trainers.b", modules)) == [
        "posttrain.trainers.b:3 borrows KTOTrainer.count_loss_items in BTrainer",
        "posttrain.trainers.b:6 KTOTrainer._record(self, ...) in BTrainer",
        "posttrain.trainers.b:7 super(OtherTrainer, self) in BTrainer",
    ]


def test_tests_mirror_the_package():
    """Tests live in tests/<layer>/test_<module>.py, one folder per posttrain sub-package, plus the folders for what
    is not one layer: docs, TRL parity, multi-process (dist), vLLM and Ray runs; only this file stays at the top."""
    tests = Path(__file__).resolve().parent
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    allowed = layers | {"docs", "parity", "dist", "vllm", "ray"}
    misplaced = [
        str(path.relative_to(tests))
        for path in tests.rglob("test_*.py")
        if path.parent != tests
        and path.relative_to(tests).parts[0] not in allowed
        or path.parent == tests
        and path.name != Path(__file__).name
    ]
    assert not misplaced, misplaced
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= allowed and len(folders) >= 10, folders
