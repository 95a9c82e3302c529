"""griffe extensions for the documentation site (mkdocs.yml: mkdocstrings' `extensions:`).

`NamespaceSubpackages`: griffe, which reads the source for mkdocstrings, does not descend into a folder without
`__init__.py` inside a regular package. posttrain may have such folders (implicit namespace packages that Python
imports fine). This extension reads their modules statically, the way griffe reads every other module, and hangs
them into the tree, so that an object defined there can be documented. Which folders these are is found on disk at
build time.

`DocsPageLinks`: a docstring names its documentation page as `docs/<page>.md`; on the site that becomes a link.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe

# A docstring names its page as `docs/<page>.md` (readable in `help()` and on GitHub); on the site it becomes a link.
DOCS_PAGE = re.compile(r"(?<![\w/(\[])docs/((?:[\w-]+/)*[\w-]+\.md)\b")


class NamespaceSubpackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.filepath is None or isinstance(pkg.filepath, list):
            return
        self._attach(pkg, Path(pkg.filepath).parent, loader)

    def _attach(self, module: griffe.Module, folder: Path, loader: griffe.GriffeLoader) -> None:
        for child in sorted(folder.iterdir()):
            if not child.is_dir() or child.name.startswith((".", "_")) or not child.name.isidentifier():
                continue
            if (child / "__init__.py").exists():
                member = module.members.get(child.name)
                if isinstance(member, griffe.Module):
                    self._attach(member, child, loader)
                continue
            sources = sorted(child.glob("*.py"))
            if not sources or child.name in module.members:
                continue
            namespace = griffe.Module(
                child.name,
                filepath=[child],
                parent=module,
                lines_collection=loader.lines_collection,
                modules_collection=loader.modules_collection,
            )
            module.set_member(child.name, namespace)
            for source in sources:
                code = source.read_text(encoding="utf-8-sig")
                loader.lines_collection[source] = code.splitlines(keepends=False)
                submodule = griffe.visit(
                    source.stem,
                    filepath=source,
                    code=code,
                    parent=namespace,
                    docstring_parser=loader.docstring_parser,
                    docstring_options=loader.docstring_options,
                    lines_collection=loader.lines_collection,
                    modules_collection=loader.modules_collection,
                )
                namespace.set_member(source.stem, submodule)
            self._attach(namespace, child, loader)


class DocsPageLinks(griffe.Extension):
    """`DocsPageLinks`: turns the `docs/<page>.md` a docstring names into a link to that page. The API reference
    pages live in docs/reference/, so the link is relative to that folder."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = DOCS_PAGE.sub(r"[docs/\1](../\1)", obj.docstring.value)
