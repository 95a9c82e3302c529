"""No tensor created on the wrong device in the training hot paths: every `torch.tensor/zeros/ones/full/empty/arange/
rand*` call in the modules a training step runs names its `device=` (a `*_like` call inherits it), except the few
listed in ON_THE_HOST with why they belong on the CPU. Read from the source (ast), so a new call without a device
fails here before it reaches a GPU."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
HOT_PATHS = [
    *sorted((PACKAGE / "losses").glob("*.py")),
    PACKAGE / "online" / "loss.py",
    PACKAGE / "online" / "logps.py",
    PACKAGE / "online" / "phases.py",
    PACKAGE / "models" / "layouts.py",
    PACKAGE / "models" / "fused_layers.py",
    PACKAGE / "trainers" / "sft.py",
    PACKAGE / "trainers" / "dpo.py",
    PACKAGE / "trainers" / "grpo.py",
    PACKAGE / "training" / "preference.py",
    PACKAGE / "training" / "base.py",
    PACKAGE / "training" / "metric_values.py",
]
FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "linspace"}
# (file, function) -> why the tensor is created on the CPU
ON_THE_HOST = {
    ("losses/bco.py", "fit_density_ratio_classifier"): "BCO's logistic regression fits on CPU float64 features",
    ("losses/gold.py", "shared_token_ids"): "built once from two vocabularies, moved with the model's tensors",
    ("online/phases.py", "groups"): "row indices into the rollout, which is assembled on the host",
    ("online/phases.py", "build_rollout"): "the rollout is assembled on the host from the episodes' lists and moved "
    "to the device as one batch",
    ("models/fused_layers.py", "activation_name"): "probe values, run once when the layers are fused",
    ("trainers/grpo.py", "_keep_informative_groups"): "dataset indices from a CPU generator (the same on any device)",
}


def _missing_device(path: Path) -> list[tuple[str, str, int]]:
    found = []
    tree = ast.parse(path.read_text())
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(function):
            call = node.func if isinstance(node, ast.Call) else None
            if not (isinstance(call, ast.Attribute) and call.attr in FACTORIES):
                continue
            if not (isinstance(call.value, ast.Name) and call.value.id == "torch"):
                continue
            if any(k.arg == "device" or k.arg is None for k in node.keywords):  # device=, or **kwargs carrying it
                continue
            found.append((str(path.relative_to(PACKAGE)), function.name, node.lineno))
    return found


def test_hot_path_tensors_name_their_device():
    missing = sorted({site for path in HOT_PATHS for site in _missing_device(path)})
    unexplained = [(f, fn, line) for f, fn, line in missing if (f, fn) not in ON_THE_HOST]
    assert unexplained == [], "add device=... (the batch's or the model's device)"


def test_the_scan_finds_a_call_without_device(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch\ndef f(x):\n    a = torch.zeros(3, device=x.device)\n    return torch.ones(2)\n")
    assert [line for *_, line in _missing_device_in(module)] == [4]


def _missing_device_in(path: Path):
    global PACKAGE
    saved, PACKAGE = PACKAGE, path.parent
    try:
        return _missing_device(path)
    finally:
        PACKAGE = saved
