"""Make `import trl` (and `trl.<anything>`) resolve to posttrain (and `posttrain.<anything>`), for the TRL harness only.

A meta-path finder answers every `trl...` import with the posttrain module of the same dotted path: the same module
object is registered under both names, so a test that patches `trl.trainer.x.y` patches what posttrain runs. A path
posttrain lacks raises ModuleNotFoundError as a missing TRL module would (unless TRL_SUITE_DIAGNOSE=1).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

SOURCE, TARGET = "trl", "posttrain"
# TRL_SUITE_DIAGNOSE=1 (never in counted runs): a module posttrain lacks is served as a stand-in whose names are
# placeholders, so a run shows what fails behind the missing module.
DIAGNOSE = os.environ.get("TRL_SUITE_DIAGNOSE") == "1"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target
        self.real_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias spec on the module: give the module its own spec back.
        module.__spec__ = self.real_spec


class _StandInModule(types.ModuleType):
    """Diagnosis only: a module posttrain lacks, whose every attribute is a placeholder (an `is_<pkg>_available`
    helper answers whether <pkg> is importable), so that the failures behind a missing module show."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith("is_") and name.endswith("_available"):
            package = name[3 : -len("_available")]
            return lambda: importlib.util.find_spec(package) is not None

        message = f"{self.__name__}.{name}: module missing in posttrain (diagnosis stand-in)"

        def refuse(*args, **kwargs):
            raise ImportError(message)

        # A class, so that fixtures that patch a method of it (TRL's conftest patches __post_init__) still run.
        return type(name, (), {"__init__": refuse, "__post_init__": lambda self: None})


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class TrlAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != SOURCE and not fullname.startswith(SOURCE + "."):
            return None
        real_name = TARGET + fullname[len(SOURCE) :]
        try:
            real_spec = importlib.util.find_spec(real_name)
        except ModuleNotFoundError:  # a parent is missing
            real_spec = None
        if real_spec is None:
            if DIAGNOSE:
                return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(real_name), is_package=real_spec.submodule_search_locations is not None
        )
        if real_spec.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real_spec.submodule_search_locations)
        return spec


def install() -> None:
    if any(isinstance(finder, TrlAliasFinder) for finder in sys.meta_path):
        return
    stale = [name for name in sys.modules if name == SOURCE or name.startswith(SOURCE + ".")]
    for name in stale:  # a real trl imported before the alias (should not happen in the harness)
        del sys.modules[name]
    sys.meta_path.insert(0, TrlAliasFinder())
