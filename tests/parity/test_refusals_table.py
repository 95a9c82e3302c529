"""What posttrain still refuses of a TRL config is one table on the migration page (docs/trl_parity.md, "What
posttrain refuses"), kept equal to the code's registries: every config class's `unsupported_options` (an option
set away from its default stops the config with the reason) and the generation_kwargs keys the online engine sets
itself (`GENERATION_KWARGS_FIXED`). A refusal added, lifted or reworded in code without the table fails here, and
the message prints the rows the table should have."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import posttrain
from posttrain.online.config import GENERATION_KWARGS_FIXED, OnlineConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "trl_parity.md"
HEADING = "## What posttrain refuses"


def config_classes() -> list[type]:
    """Every config dataclass of posttrain with an `unsupported_options` registry, each once."""
    found = {}
    for info in pkgutil.walk_packages(posttrain.__path__, "posttrain."):
        if any(part in info.name for part in (".cli", ".scripts", "__main__")):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and hasattr(obj, "unsupported_options"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def _owner(cls: type, option: str, reason: str) -> type:
    """The most basic class of `cls`'s ancestry that refuses `option` with `reason`."""
    return [c for c in cls.__mro__ if getattr(c, "unsupported_options", {}).get(option) == reason][-1]


def refusal_rows() -> dict[tuple[str, str], str]:
    """{(option, posttrain column): why} from the code's registries."""
    rows = {}
    for cls in config_classes():
        for option, reason in cls.unsupported_options.items():
            owner = _owner(cls, option, reason).__name__
            rows[(option, f"refused by `{owner}` and the configs built on it")] = reason
    for key, reason in GENERATION_KWARGS_FIXED.items():
        rows[(f"generation_kwargs['{key}']", f"refused by `{OnlineConfig.__name__}` and the configs built on it")] = (
            reason
        )
    return rows


def table_rows() -> dict[tuple[str, str], str]:
    text = PAGE.read_text()
    section = text[text.index(HEADING) :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else None
        if cells and cells[0] not in ("option", "---"):
            assert len(cells) == 4 and cells[1], f"a row needs option | TRL | posttrain | why: {line}"
            rows[(cells[0], cells[2])] = cells[3]
    return rows


def _as_markdown(rows: dict[tuple[str, str], str]) -> str:
    return "\n".join(f"| {o} | accepted | {p} | {why} |" for (o, p), why in sorted(rows.items()))


def test_the_refusals_table_is_the_codes_registry():
    expected, documented = refusal_rows(), table_rows()
    assert documented == expected, "docs/trl_parity.md's refusals table should read:\n" + _as_markdown(expected)


def test_the_table_names_no_option_that_was_lifted():
    lifted = ["steps_per_generation", "generation_batch_size", "do_sample", "teacher_model_server_url"]
    options = " ".join(option for option, _ in table_rows())
    assert not [name for name in lifted if re.search(rf"\b{name}\b", options)]
