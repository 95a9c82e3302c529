"""Every trainer's constructor takes TRL 1.16's parameters in TRL's order with TRL's defaults (a required parameter
stays required, an optional one optional), so that code calling TRL's trainers positionally or by keyword runs
unchanged. posttrain's own extra parameters may only come after TRL's. The reference is the snapshot of TRL 1.16
in tests/fixtures/trl_1.16_surface.json (`trainer_signatures`, written by scripts/trl_surface.py)."""

import importlib
import inspect
import json
from pathlib import Path

import pytest

SNAPSHOT = json.loads((Path(__file__).parents[1] / "fixtures" / "trl_1.16_surface.json").read_text())[
    "trainer_signatures"
]


def posttrain_class(key: str):
    if "." not in key:
        import posttrain

        return getattr(posttrain, key)
    module, _, name = key.rpartition(".")
    return getattr(importlib.import_module(module.replace("trl.", "posttrain.", 1)), name)


def signature_of(cls) -> list[list[str]]:
    out = []
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind is param.KEYWORD_ONLY:
            continue  # posttrain's keyword-only extras cannot shift a positional argument
        if param.kind is param.VAR_POSITIONAL:
            out.append(["*" + name, "<varargs>"])
        elif param.kind is param.VAR_KEYWORD:
            out.append(["**" + name, "<varkw>"])
        else:
            out.append([name, "<required>" if param.default is param.empty else repr(param.default)])
    return out


@pytest.mark.parametrize("key", sorted(SNAPSHOT))
def test_trainer_signature_starts_with_trls(key):
    trl = [p for p in SNAPSHOT[key] if not p[0].startswith("*")]
    ours = [p for p in signature_of(posttrain_class(key)) if not p[0].startswith("*")]
    assert ours[: len(trl)] == trl, (
        f"{key}: TRL 1.16's parameters (name, default) are\n{trl}\nposttrain's first {len(trl)} are\n{ours[: len(trl)]}"
    )


def test_the_snapshot_covers_every_trainer():
    assert {"SFTTrainer", "DPOTrainer", "KTOTrainer", "RewardTrainer", "GRPOTrainer", "RLOOTrainer"} <= set(SNAPSHOT)
    assert sum(key.startswith("trl.experimental.") for key in SNAPSHOT) >= 10
