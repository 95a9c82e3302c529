"""Tiny vision-language models and image datasets shared by the VLM tests (built once per session)."""

import numpy as np
import pytest
from datasets import Dataset

ARCHS = ("llava", "gemma3", "idefics3")
# What each tiny architecture puts in input_ids for one image (independent of posttrain: from the configs
# in posttrain/models/tiny_vlm.py, 32 px images, 8 px patches): its placeholder text and its image tokens.
PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>", "idefics3": "<image>"}
IMAGE_TOKENS = {
    "llava": {"<image>": 16},
    "gemma3": {"<start_of_image>": 1, "<image_soft_token>": 4, "<end_of_image>": 1},
    "idefics3": {"<fake_token_around_image>": 2, "<global-img>": 1, "<image>": 4},
}


@pytest.fixture(scope="session")
def vlm_paths(tmp_path_factory):
    from posttrain.models import tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    return {arch: getattr(tiny_vlm, f"build_tiny_{arch}")(root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def vlm_ref_paths(tmp_path_factory):
    """The same architectures with other random weights (a reference model that differs from the policy)."""
    from posttrain.models import tiny_vlm

    root = tmp_path_factory.mktemp("vlm_ref")
    return {arch: getattr(tiny_vlm, f"build_tiny_{arch}")(root / arch, seed=1) for arch in ARCHS}


def image(i: int, size: int = 32):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(i).rand(size, size, 3) * 255).astype("uint8"))


def messages_data(n: int = 4) -> Dataset:
    return Dataset.from_list(
        [
            {
                "images": [image(i)],
                "messages": [
                    {"role": "user", "content": "what is this" + " number" * (i % 2)},
                    {"role": "assistant", "content": f"digit {i}"},
                ],
            }
            for i in range(n)
        ]
    )


def prompt_completion_data(n: int = 4) -> Dataset:
    return Dataset.from_list(
        [
            {
                "images": [image(i)],
                "prompt": [{"role": "user", "content": "what is" + " it" * i}],
                "completion": [{"role": "assistant", "content": f"digit {i}"}],
            }
            for i in range(n)
        ]
    )


def preference_data(n: int = 4) -> Dataset:
    return Dataset.from_list(
        [
            {
                "images": [image(i)],
                "prompt": [{"role": "user", "content": "what is" + " it" * i}],
                "chosen": [{"role": "assistant", "content": f"digit {i}"}],
                "rejected": [{"role": "assistant", "content": f"a cat {i + 1} is here"}],
            }
            for i in range(n)
        ]
    )


def common_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        bf16=False,
    )
    base.update(kw)
    return base
