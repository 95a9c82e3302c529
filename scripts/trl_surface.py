"""Writes the public surface of the installed TRL as JSON: the snapshot that tests/parity/test_parity.py holds
posttrain to. Run it with `bash scripts/trl_surface.sh` (a throwaway venv with trl==1.16.0).

Recorded: top-level names (and which are modules), the functions of `trl.data_utils`, each trainer's
constructor parameters in order, and each config's fields with their defaults: every field TRL adds to
`transformers.TrainingArguments`, and the TrainingArguments fields whose default TRL changes. `trainer_signatures`
holds every trainer's constructor (the stable ones and `trl.experimental`'s) as [name, default] pairs in order,
the default as its repr ("<required>" for none; "*args"/"**kwargs" for the catch-alls). `modules` maps every
importable public TRL module (no path component starting with "_") to its public names: its `__all__`, or else the
classes and functions it defines itself.
"""

import dataclasses
import inspect
import json
import sys
import types

import trl
import trl.data_utils
from transformers import TrainingArguments

TRAINERS = (
    "SFTTrainer",
    "DPOTrainer",
    "KTOTrainer",
    "RewardTrainer",
    "GRPOTrainer",
    "RLOOTrainer",
    "DistillationTrainer",
)
CONFIGS = (
    "SFTConfig",
    "DPOConfig",
    "KTOConfig",
    "RewardConfig",
    "GRPOConfig",
    "RLOOConfig",
    "DistillationConfig",
    "ScriptArguments",
    "ModelConfig",
    "DatasetMixtureConfig",
)


def default_of(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "<required>"
    return value if isinstance(value, (type(None), bool, int, float, str)) else repr(value)


def config_fields(cls) -> dict:
    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    out = {}
    for field in dataclasses.fields(cls):
        if field.name not in base or default_of(field) != default_of(base[field.name]):
            out[field.name] = default_of(field)
    return out


# trl.experimental trainers: import path -> class name
EXPERIMENTAL_TRAINERS = {
    "trl.experimental.a2po": "A2POTrainer",
    "trl.experimental.cpo": "CPOTrainer",
    "trl.experimental.gkd": "GKDTrainer",
    "trl.experimental.gmpo": "GMPOTrainer",
    "trl.experimental.gold": "GOLDTrainer",
    "trl.experimental.iw_opd": "IWOPDTrainer",
    "trl.experimental.online_dpo": "OnlineDPOTrainer",
    "trl.experimental.orpo": "ORPOTrainer",
    "trl.experimental.sdft": "SDFTTrainer",
    "trl.experimental.sdpo": "SDPOTrainer",
    "trl.experimental.server_distillation": "ServerDistillationTrainer",
    "trl.experimental.tpo": "TPOTrainer",
}


def signature_of(cls) -> list[list[str]]:
    out = []
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self":
            continue
        if param.kind is param.VAR_POSITIONAL:
            out.append(["*" + name, "<varargs>"])
        elif param.kind is param.VAR_KEYWORD:
            out.append(["**" + name, "<varkw>"])
        else:
            out.append([name, "<required>" if param.default is param.empty else repr(param.default)])
    return out


def trainer_signatures() -> dict:
    import importlib

    out = {t: signature_of(getattr(trl, t)) for t in TRAINERS}
    for module, name in EXPERIMENTAL_TRAINERS.items():
        out[f"{module}.{name}"] = signature_of(getattr(importlib.import_module(module), name))
    return out


def module_surface() -> dict:
    import importlib
    import os
    import pkgutil
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = {}
    for info in pkgutil.walk_packages(trl.__path__, "trl."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency TRL's module needs (triton, openenv): not importable here
            continue
        if hasattr(module, "__all__"):
            names = sorted(set(module.__all__))
        else:
            names = sorted(
                n
                for n, v in vars(module).items()
                if not n.startswith("_")
                and (inspect.isclass(v) or inspect.isfunction(v))
                and getattr(v, "__module__", None) == module.__name__
            )
        out[info.name] = names
    return dict(sorted(out.items()))


def main(path: str) -> None:
    names = sorted(n for n in dir(trl) if not n.startswith("_"))
    surface = {
        "trl_version": trl.__version__,
        "top_level": [n for n in names if not isinstance(getattr(trl, n), types.ModuleType)],
        "top_level_modules": [n for n in names if isinstance(getattr(trl, n), types.ModuleType)],
        "data_utils": sorted(
            n
            for n, v in vars(trl.data_utils).items()
            if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == "trl.data_utils"
        ),
        "trainers": {
            t: [p for p in inspect.signature(getattr(trl, t).__init__).parameters if p != "self"] for t in TRAINERS
        },
        "configs": {c: config_fields(getattr(trl, c)) for c in CONFIGS},
        "trainer_signatures": trainer_signatures(),
        "modules": module_surface(),
    }
    with open(path, "w") as f:
        json.dump(surface, f, indent=1, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/trl_1.16_surface.json")
