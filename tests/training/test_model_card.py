"""The README.md model card: base model, method and its paper, datasets, non-default settings, final metrics."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from datasets import Dataset, load_from_disk

import posttrain
from posttrain import SFTConfig
from posttrain.training.model_card import (
    PAPERS,
    dataset_names,
    non_default_settings,
    render_model_card,
    write_model_card,
)

HISTORY = [
    {"loss": 2.0, "step": 1},
    {"loss": 1.5, "reward": 0.25, "step": 2},
    {"eval_loss": 1.75, "step": 2},
    {"train_runtime": 3.0, "train_loss": 1.75, "step": 2},
]


def _trainer(tmp_path, name="DPO", model="HuggingFaceTB/SmolLM2-135M-Instruct", train_dataset=None, **config):
    args = SFTConfig(output_dir=str(tmp_path / "my-run"), use_cpu=True, **config)
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path=model))
    return SimpleNamespace(
        _name=name,
        args=args,
        model=model,
        state=SimpleNamespace(log_history=HISTORY),
        train_dataset=train_dataset,
        eval_dataset=None,
    )


def test_card_names_model_method_paper_settings_metrics_and_versions(tmp_path):
    trainer = _trainer(tmp_path, learning_rate=3e-6, max_steps=7, report_to="none", lr_scheduler_type="cosine")
    path = write_model_card(trainer)
    card = path.read_text()
    assert path == tmp_path / "my-run" / "README.md"
    assert card.startswith(
        '---\nlibrary_name: transformers\nmodel_name: "my-run"\nbase_model: "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
    )
    assert 'tags:\n- "posttrain"\n- "dpo"\n---' in card
    assert "trained with **DPO**" in card and f"posttrain {posttrain.__version__}" in card
    assert "https://huggingface.co/papers/2305.18290" in card and "@inproceedings{rafailov2023direct" in card
    settings = card.split("### Settings")[1].split("###")[0]
    rows = [line.split("|")[1].strip(" `") for line in settings.splitlines() if line.startswith("| `")]
    assert sorted(rows) == ["learning_rate", "lr_scheduler_type", "max_steps", "use_cpu"]
    assert "| `lr_scheduler_type` | cosine |" in settings
    metrics = card.split("### Final metrics")[1].split("###")[0]
    assert [line for line in metrics.splitlines() if line.startswith("| `")] == [
        "| `loss` | 1.5 |",
        "| `reward` | 0.25 |",
        "| `eval_loss` | 1.75 |",
        "| `train_runtime` | 3 |",
        "| `train_loss` | 1.75 |",
    ]


def test_a_local_model_is_not_claimed_as_a_hub_base_model(tmp_path):
    card = render_model_card(_trainer(tmp_path, name="SFT", model=str(tmp_path)))
    assert "base_model:" not in card and f"fine-tuned from the local model `{tmp_path}`" in card
    assert "## Citation" not in card  # SFT has no method paper


def test_hub_dataset_names_come_from_the_datasets_cache(tmp_path):
    cached = tmp_path / "datasets" / "trl-lib___capybara" / "default" / "0.0.0" / "abc"
    Dataset.from_list([{"text": "a"}, {"text": "b"}]).save_to_disk(str(cached))
    dataset = load_from_disk(str(cached)).map(lambda row: {"n": len(row["text"])})
    trainer = _trainer(tmp_path, train_dataset=dataset)
    assert dataset_names(trainer) == ["trl-lib/capybara"]
    assert 'datasets:\n- "trl-lib/capybara"' in render_model_card(trainer)
    assert dataset_names(_trainer(tmp_path, train_dataset=Dataset.from_list([{"text": "a"}]))) == []


def test_every_trainer_names_its_method_and_every_cited_method_exists():
    trainers = {name: getattr(posttrain, name) for name in posttrain.__all__ if name.endswith("Trainer")}
    trainers = {name: obj for name, obj in trainers.items() if inspect.isclass(obj) and hasattr(obj, "train")}
    assert {"SFTTrainer", "DPOTrainer", "GRPOTrainer"} <= set(trainers)
    names = {cls.__name__: getattr(cls, "_name", None) for cls in trainers.values()}
    assert all(names.values()), names
    import importlib
    import pkgutil

    import posttrain.experimental as experimental

    for module in pkgutil.iter_modules(experimental.__path__):
        for name, obj in vars(importlib.import_module(f"posttrain.experimental.{module.name}")).items():
            if name.endswith("Trainer") and inspect.isclass(obj) and getattr(obj, "_name", None):
                names[name] = obj._name
    assert set(PAPERS) <= set(names.values()), set(PAPERS) - set(names.values())
    assert {"DPO", "KTO", "GRPO", "RLOO", "PPO", "Distillation"} <= set(PAPERS)
    for paper in PAPERS.values():
        assert paper.bibtex.startswith("@") and paper.bibtex.count("{") == paper.bibtex.count("}")


def test_settings_resolved_at_build_are_not_reported_as_changes(tmp_path):
    assert non_default_settings(SFTConfig(output_dir=str(tmp_path), report_to="none")) == {}
    # bf16=None means on (as TRL): float32 chosen explicitly is a change, and so is fp16
    assert non_default_settings(SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False)) == {"bf16": False}
    assert non_default_settings(SFTConfig(output_dir=str(tmp_path), report_to="none", fp16=True)) == {"fp16": True}


def test_save_model_elsewhere_and_create_model_card_write_cards(tmp_path, tiny_model_path):
    from posttrain import SFTTrainer

    rows = Dataset.from_list([{"prompt": f"{i} plus 1 is", "completion": f" {i + 1}"} for i in range(8)])
    args = SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        write_report=False,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=rows)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    card = (tmp_path / "final" / "README.md").read_text()
    assert "trained with **SFT**" in card and (tmp_path / "final" / "model.safetensors").exists()
    trainer.create_model_card(model_name="my-model", tags=["arith"])
    card = (tmp_path / "run" / "README.md").read_text()
    assert 'model_name: "my-model"' in card and '- "arith"' in card
