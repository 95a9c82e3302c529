"""A second run with the same data and settings loads the tokenized dataset from datasets' cache."""

import json
import os

from datasets import load_dataset

from posttrain import SFTConfig, SFTTrainer


def _trainer(tmp_path, model_path, data_file, max_length=64):
    data = load_dataset("json", data_files=str(data_file), split="train", cache_dir=str(tmp_path / "hf"))
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_length=max_length,
        save_strategy="no",
        disable_tqdm=True,
    )
    return SFTTrainer(model_path, args=args, train_dataset=data)


def test_tokenized_dataset_is_reused_and_invalidated(tmp_path, tiny_model_path):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"{i} plus", "completion": f" {i}"}) + "\n" for i in range(20)))
    first = _trainer(tmp_path, tiny_model_path, data_file).train_dataset
    files = [f["filename"] for f in first.cache_files]
    assert files and all(os.path.exists(f) for f in files)
    mtimes = [os.path.getmtime(f) for f in files]

    second = _trainer(tmp_path, tiny_model_path, data_file).train_dataset
    assert [f["filename"] for f in second.cache_files] == files
    assert [os.path.getmtime(f) for f in files] == mtimes  # loaded, not rewritten
    assert second["input_ids"] == first["input_ids"]

    # Other tokenization settings -> another cache entry.
    third = _trainer(tmp_path, tiny_model_path, data_file, max_length=32).train_dataset
    assert [f["filename"] for f in third.cache_files] != files
