"""One layout for every experimental method: `posttrain/experimental/<m>/{__init__,<m>_config,<m>_trainer}.py`, TRL's
paths. The logic is in the config and trainer modules (`__init__` only re-exports them), and no method imports
another method's package: what methods share lives in a lower layer (online/, trainers/, losses/)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

EXPERIMENTAL = Path(__file__).resolve().parents[2] / "posttrain" / "experimental"
# Every experimental training method (TRL 1.16's trl/experimental/<m>/ packages with a trainer, and those TRL dropped
# that posttrain keeps: bco, nash_md, prm, xpo, grpo_with_replay_buffer).
METHODS = (
    "a2po",
    "async_distillation",
    "async_grpo",
    "bco",
    "cpo",
    "distillation",
    "gkd",
    "gmpo",
    "gold",
    "grpo_with_replay_buffer",
    "iw_opd",
    "kto",
    "nash_md",
    "online_dpo",
    "orpo",
    "prm",
    "sdft",
    "sdpo",
    "server_distillation",
    "tpo",
    "xpo",
)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imported_modules(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_every_method_package_is_listed():
    """A new method package joins METHODS (and so the checks below): a folder with a `<m>_trainer.py`."""
    packages = {p.parent.name for p in EXPERIMENTAL.glob("*/*_trainer.py") if p.stem == f"{p.parent.name}_trainer"}
    assert packages == set(METHODS)


def test_no_method_is_a_single_module():
    assert [m for m in METHODS if (EXPERIMENTAL / f"{m}.py").exists()] == []


@pytest.mark.parametrize("method", METHODS)
def test_method_has_the_three_modules(method):
    package = EXPERIMENTAL / method
    for name in ("__init__", f"{method}_config", f"{method}_trainer"):
        assert (package / f"{name}.py").is_file(), f"posttrain/experimental/{method}/{name}.py is missing"


@pytest.mark.parametrize("method", METHODS)
def test_init_only_reexports(method):
    """`__init__.py`: a docstring, imports from the package's own modules, and `__all__`; nothing defined there."""
    body = _tree(EXPERIMENTAL / method / "__init__.py").body
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom):
            assert node.module and node.module.startswith(f"posttrain.experimental.{method}."), ast.unparse(node)
            continue
        assert isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"], ast.unparse(node)


@pytest.mark.parametrize("method", METHODS)
def test_config_and_trainer_define_their_classes(method):
    """The config module defines the `...Config` the package exports, the trainer module its `...Trainer`."""
    module = importlib.import_module(f"posttrain.experimental.{method}")
    for kind in ("Config", "Trainer"):
        names = [n for n in module.__all__ if n.endswith(kind)]
        assert names, f"posttrain.experimental.{method} exports no ...{kind}"
        for name in names:
            where = getattr(module, name).__module__
            assert where.startswith(f"posttrain.experimental.{method}.{method}_{kind.lower()}"), (name, where)


@pytest.mark.parametrize("method", METHODS)
def test_no_method_imports_another_method(method):
    others = {m for m in METHODS if m != method} | {"_async_pipeline", "judges"}
    for path in sorted((EXPERIMENTAL / method).glob("*.py")):
        for module in _imported_modules(_tree(path)):
            parts = module.split(".")
            if parts[:2] == ["posttrain", "experimental"] and len(parts) > 2:
                assert parts[2] not in others, f"{path.relative_to(EXPERIMENTAL.parent)} imports {module}"


def test_advantage_functions_live_in_losses():
    """An advantage function is defined in posttrain/losses/advantages.py, not in a method's module."""
    for path in sorted(EXPERIMENTAL.rglob("*.py")):
        for node in _tree(path).body:
            if isinstance(node, ast.FunctionDef):
                assert "advantages" not in node.name, f"{path.name} defines {node.name}"
