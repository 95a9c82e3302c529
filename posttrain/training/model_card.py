"""The model card (README.md) a run writes into its output_dir: what was trained from what, how, on which data,
with which non-default settings, how it ended, with which library versions, and the method's paper to cite.

Every trainer gets it through BaseTrainer (see posttrain/training/run_artifacts.py); a trainer names its method
with the class attribute ``_name`` (as TRL's trainers do), which keys ``PAPERS`` below.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from posttrain.training.device_paths import run_paths
from posttrain.version import __version__

CARD_NAME = "README.md"

# Settings that describe where the run wrote, not how it trained; they would make two identical runs' cards differ.
_MACHINE_SPECIFIC = frozenset(
    {"output_dir", "logging_dir", "run_name", "hub_model_id", "hub_token", "push_to_hub_token"}
)


# Values posttrain's config sets itself when it is built: pinning off on a CPU (it needs an accelerator), the fused
# layers where they were measured for the run's device (training/device_paths.py), bf16 from None (TRL's default)
# and use_cpu where that bf16 runs on a machine without an accelerator (training/base.py).
_RESOLVED_AT_BUILD = {
    "bf16": lambda args: not args.fp16,
    "use_cpu": lambda args: args.use_cpu if getattr(args, "_use_cpu_resolved", False) else False,
    "dataloader_pin_memory": lambda args: False,
    "accelerator_config": lambda args: _accelerator_config(),
    "fused_layers": lambda args: run_paths(args, fused_layers=None, check=False).fast["fused_layers"],
}
# Fields whose None default means on (TRL's bf16): False set explicitly is a change.
_NONE_MEANS_ON = frozenset({"bf16"})


def _accelerator_config():
    from transformers.trainer_pt_utils import AcceleratorConfig

    return AcceleratorConfig()


@dataclass(frozen=True)
class Paper:
    title: str
    arxiv_id: str
    bibtex: str


def _arxiv(title: str, arxiv_id: str, key: str, authors: str, year: int) -> Paper:
    """A paper cited by its arXiv preprint."""
    return Paper(
        title,
        arxiv_id,
        f"@article{{{key},\n  title   = {{{{{title}}}}},\n  author  = {{{authors}}},\n"
        f"  journal = {{arXiv preprint arXiv:{arxiv_id}}},\n  year    = {{{year}}}\n}}",
    )


PAPERS: dict[str, Paper] = {
    "DPO": Paper(
        "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
        "2305.18290",
        "@inproceedings{rafailov2023direct,\n  title     = {{Direct Preference Optimization: Your Language Model is "
        "Secretly a Reward Model}},\n  author    = {Rafael Rafailov and Archit Sharma and Eric Mitchell and "
        "Christopher D. Manning and Stefano Ermon and Chelsea Finn},\n  booktitle = {Advances in Neural Information "
        "Processing Systems 36},\n  year      = {2023}\n}",
    ),
    "KTO": Paper(
        "KTO: Model Alignment as Prospect Theoretic Optimization",
        "2402.01306",
        "@article{ethayarajh2024kto,\n  title   = {{KTO: Model Alignment as Prospect Theoretic Optimization}},\n"
        "  author  = {Kawin Ethayarajh and Winnie Xu and Niklas Muennighoff and Dan Jurafsky and Douwe Kiela},\n"
        "  journal = {arXiv preprint arXiv:2402.01306},\n  year    = {2024}\n}",
    ),
    "GRPO": Paper(
        "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        "2402.03300",
        "@article{shao2024deepseekmath,\n  title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in "
        "Open Language Models}},\n  author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao "
        "Song and Xiao Bi and Haowei Zhang and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},\n"
        "  journal = {arXiv preprint arXiv:2402.03300},\n  year    = {2024}\n}",
    ),
    "RLOO": Paper(
        "Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs",
        "2402.14740",
        "@inproceedings{ahmadian2024back,\n  title     = {{Back to Basics: Revisiting REINFORCE-Style Optimization "
        "for Learning from Human Feedback in LLMs}},\n  author    = {Arash Ahmadian and Chris Cremer and Matthias "
        'Gall{\\\'e} and Marzieh Fadaee and Julia Kreutzer and Olivier Pietquin and Ahmet {\\"U}st{\\"u}n and Sara '
        "Hooker},\n  booktitle = {Proceedings of the 62nd Annual Meeting of the Association for Computational "
        "Linguistics},\n  year      = {2024}\n}",
    ),
    "PPO": Paper(
        "Fine-Tuning Language Models from Human Preferences",
        "1909.08593",
        "@article{ziegler2019finetuning,\n  title   = {{Fine-Tuning Language Models from Human Preferences}},\n"
        "  author  = {Daniel M. Ziegler and Nisan Stiennon and Jeffrey Wu and Tom B. Brown and Alec Radford and "
        "Dario Amodei and Paul Christiano and Geoffrey Irving},\n  journal = {arXiv preprint arXiv:1909.08593},\n"
        "  year    = {2019}\n}",
    ),
    "Distillation": Paper(
        "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
        "2306.13649",
        "@inproceedings{agarwal2024onpolicy,\n  title     = {{On-Policy Distillation of Language Models: Learning "
        "from Self-Generated Mistakes}},\n  author    = {Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and "
        "Piotr Stanczyk and Sabela Ramos Garea and Matthieu Geist and Olivier Bachem},\n  booktitle = {The Twelfth "
        "International Conference on Learning Representations},\n  year      = {2024}\n}",
    ),
    "ORPO": _arxiv(
        "ORPO: Monolithic Preference Optimization without Reference Model",
        "2403.07691",
        "hong2024orpo",
        "Jiwoo Hong and Noah Lee and James Thorne",
        2024,
    ),
    "CPO": _arxiv(
        "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine Translation",
        "2401.08417",
        "xu2024contrastive",
        "Haoran Xu and Amr Sharaf and Yunmo Chen and Weiting Tan and Lingfeng Shen and Benjamin Van "
        "Durme and Kenton Murray and Young Jin Kim",
        2024,
    ),
    "TPO": _arxiv(
        "Triple Preference Optimization: Achieving Better Alignment using a Single Step Optimization",
        "2405.16681",
        "saeidi2024triple",
        "Amir Saeidi and Shivanshu Verma and Aswin RRV and Kashif Rasul and Chitta Baral",
        2024,
    ),
    "BCO": _arxiv(
        "Binary Classifier Optimization for Large Language Model Alignment",
        "2404.04656",
        "jung2024binary",
        "Seungjae Jung and Gunsoo Han and Daniel Wontae Nam and Kyoung-Woon On",
        2024,
    ),
    "GKD": _arxiv(
        "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
        "2306.13649",
        "agarwal2024onpolicy",
        "Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and Piotr Stanczyk and Sabela Ramos Garea "
        "and Matthieu Geist and Olivier Bachem",
        2024,
    ),
    "PRM": _arxiv(
        "Solving math word problems with process- and outcome-based feedback",
        "2211.14275",
        "uesato2022solving",
        "Jonathan Uesato and others",
        2022,
    ),
    "GMPO": _arxiv(
        "Geometric-Mean Policy Optimization", "2507.20673", "zhao2025geometric", "Yuzhong Zhao and others", 2025
    ),
    "A2PO": _arxiv(
        "Accelerating RL for LLM Reasoning with Optimal Advantage Regression",
        "2505.20686",
        "brantley2025accelerating",
        "Kiante Brantley and others",
        2025,
    ),
    "Online DPO": _arxiv(
        "Direct Language Model Alignment from Online AI Feedback",
        "2402.04792",
        "guo2024direct",
        "Shangmin Guo and others",
        2024,
    ),
    "XPO": _arxiv(
        "Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF",
        "2405.21046",
        "xie2024exploratory",
        "Tengyang Xie and Dylan J. Foster and Akshay Krishnamurthy and Corby Rosset and Ahmed Awadallah "
        "and Alexander Rakhlin",
        2024,
    ),
    "SDFT": _arxiv(
        "Self-Distillation Enables Continual Learning",
        "2601.19897",
        "shenfeld2026selfdistillation",
        "Idan Shenfeld and others",
        2026,
    ),
    "SDPO": _arxiv(
        "Reinforcement Learning via Self-Distillation",
        "2601.20802",
        "hubotter2026reinforcement",
        'Jonas H{\\"u}botter and others',
        2026,
    ),
    "Nash-MD": _arxiv(
        "Nash Learning from Human Feedback", "2312.00886", "munos2023nash", "Rémi Munos and others", 2023
    ),
}
PAPERS["Server Distillation"] = PAPERS["GKD"]  # distillation from a served teacher: the same objective

_VERSIONED = ("posttrain", "transformers", "torch", "datasets", "accelerate", "peft")


def method_name(trainer) -> str:
    """The trainer's ``_name`` (e.g. "DPO"), else its class name without "Trainer"."""
    return getattr(trainer, "_name", None) or type(trainer).__name__.removesuffix("Trainer") or "posttrain"


def tag_model(model, tags: list[str]) -> None:
    """Adds Hub tags to the model (`model.model_tags`, written into its card when pushed): the method's name and
    "trl" (the method family TRL's trainers tag with, so models trained with TRL's methods are found together)."""
    target = getattr(model, "base_model", model) if not hasattr(model, "add_model_tags") else model
    if hasattr(target, "add_model_tags"):
        target.add_model_tags(tags)


def base_model_id(trainer) -> str | None:
    config = getattr(getattr(trainer, "model", None), "config", None)
    name = getattr(config, "_name_or_path", None)
    return name or None


def dataset_names(trainer) -> list[str]:
    """Hub ids of the training/eval datasets where they can be told: the ``owner___name`` folder datasets caches
    a Hub dataset in (kept by every ``map``), else the builder's ``dataset_name``; nothing for in-memory data."""
    datasets = [getattr(trainer, "train_dataset", None)]
    eval_dataset = getattr(trainer, "eval_dataset", None)
    datasets += list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    names: list[str] = []
    for dataset in datasets:
        name = _dataset_name(dataset)
        if name and name not in names:
            names.append(name)
    return names


def _dataset_name(dataset) -> str | None:
    for cache_file in getattr(dataset, "cache_files", None) or []:
        for part in Path(cache_file.get("filename", "")).parts:
            if (match := re.fullmatch(r"([\w.-]+)___([\w.-]+)", part)) and not part.startswith("parquet___"):
                return f"{match.group(1)}/{match.group(2)}"
    info = getattr(dataset, "info", None)
    name = getattr(info, "dataset_name", None)
    return name if name and name not in ("generator", "json", "csv", "parquet", "text", "arrow") else None


def non_default_settings(args) -> dict[str, Any]:
    """The config's settings that differ from the declared defaults; paths, tokens and settings resolved when the
    config is built from an automatic default (None, e.g. bf16) are left out.

    (A default config is not built to compare with: building one resets accelerate's state mid-run.)
    """
    from dataclasses import MISSING, fields

    changed = {}
    for spec in fields(args):
        if spec.name in _MACHINE_SPECIFIC or spec.name.startswith("_") or not spec.init:
            continue
        if spec.default is not MISSING:
            default = spec.default
        elif spec.default_factory is not MISSING:
            default = spec.default_factory()
        else:
            default = None
        raw = getattr(args, spec.name)
        if spec.name in _RESOLVED_AT_BUILD and _RESOLVED_AT_BUILD[spec.name](args) == raw:
            continue
        value, default = _plain(raw), _plain(default)
        off = value in (False, [], {}, "", None) and spec.name not in _NONE_MEANS_ON
        if value == default or (default in (None, "", "auto") and off):
            continue
        changed[spec.name] = value
    return changed


def _plain(value):
    value = getattr(value, "value", value)  # enums
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return [] if value in ("none", ["none"]) else value  # report_to's spellings of "no tracker"


def final_metrics(log_history: list[dict]) -> dict[str, float]:
    """The last logged value of every numeric metric (train, eval and the run summary), in order of appearance."""
    last: dict[str, float] = {}
    for row in log_history:
        for key, value in row.items():
            if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool):
                last[key] = value
    return last


def versions() -> dict[str, str]:
    found = {}
    for package in _VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    if "posttrain" not in found:
        found["posttrain"] = __version__
    return found


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.6g}" if math.isfinite(value) else str(value)
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, str], rows: dict[str, Any]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    lines += [f"| `{key}` | {_cell(value)} |" for key, value in rows.items()]
    return "\n".join(lines)


def render_model_card(
    trainer,
    model_name: str | None = None,
    dataset_name: str | list[str] | None = None,
    tags: str | list[str] | None = None,
) -> str:
    """The card's Markdown (YAML front matter for the Hub, then the sections)."""
    args = trainer.args
    method = method_name(trainer)
    model_name = model_name or Path(args.output_dir).resolve().name
    base = base_model_id(trainer)
    on_hub = bool(base) and not os.path.isdir(base)
    datasets = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or dataset_names(trainer))
    tag_list = ["posttrain", method.lower().replace(" ", "-"), *([tags] if isinstance(tags, str) else tags or [])]
    front = ["---", "library_name: transformers", f"model_name: {json.dumps(model_name)}"]
    if on_hub:
        front.append(f"base_model: {json.dumps(base)}")
    if datasets:
        front.append("datasets:\n" + "\n".join(f"- {json.dumps(name)}" for name in datasets))
    front += ["tags:\n" + "\n".join(f"- {json.dumps(tag)}" for tag in dict.fromkeys(tag_list)), "---"]

    paper = PAPERS.get(method)
    settings = non_default_settings(args)
    found_versions = versions()
    if on_hub:
        origin = f"a fine-tuned version of [{base}](https://huggingface.co/{base})"
    elif base:
        origin = f"fine-tuned from the local model `{base}`"
    else:
        origin = "fine-tuned from a model passed as an object (its origin was not recorded)"
    data = f" on {', '.join(f'`{name}`' for name in datasets)}" if datasets else ""
    sections = [
        "\n".join(front),
        f"# {model_name}",
        f"This model is {origin}. It was trained with **{method}**{data} using posttrain "
        f"{found_versions.get('posttrain', '')}.",
        "## Training procedure",
        f"Method: {method}"
        + (f", from [{paper.title}](https://huggingface.co/papers/{paper.arxiv_id})." if paper else "."),
        f"### Settings that differ from `{type(args).__name__}`'s defaults",
        _table(("setting", "value"), settings) if settings else "None.",
    ]
    metrics = final_metrics(trainer.state.log_history)
    sections += ["### Final metrics", _table(("metric", "last value"), metrics) if metrics else "None logged yet."]
    sections += [
        "### Framework versions",
        "\n".join(f"- {name}: {version}" for name, version in found_versions.items()),
    ]
    if paper:
        sections += ["## Citation", f"{method}:", "```bibtex\n" + paper.bibtex + "\n```"]
    return "\n\n".join(sections) + "\n"


def write_model_card(trainer, output_dir: str | os.PathLike | None = None, **kwargs) -> Path:
    """Writes README.md into ``output_dir`` (the run's by default); returns its path."""
    directory = Path(output_dir or trainer.args.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CARD_NAME
    path.write_text(render_model_card(trainer, **kwargs), encoding="utf-8")
    return path


def generate_model_card(
    base_model: str | None,
    model_name: str,
    hub_model_id: str,
    dataset_name: str | None,
    tags: list[str],
    wandb_url: str | None,
    trackio_url: str | None,
    trainer_name: str,
    trainer_citation: str | None = None,
    template_file: str | None = None,
    paper_title: str | None = None,
    paper_id: str | None = None,
    comet_url: str | None = None,
):
    """A Hub model card (`huggingface_hub.ModelCard`) for a model pushed as `hub_model_id` (TRL's helper of the same
    name): metadata (base model, dataset, tags), a quick-start snippet, where the run was tracked, the trainer and
    the paper to cite. `template_file` is a Jinja card template to fill instead (it receives every argument).
    Trainers' own cards are `render_model_card`'s."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(
        base_model=base_model,
        datasets=dataset_name,
        library_name="transformers",
        model_name=model_name,
        tags=list(tags),
    )
    if template_file is not None:
        fields = dict(base_model=base_model, model_name=model_name, hub_model_id=hub_model_id)
        fields.update(dataset_name=dataset_name, tags=tags, wandb_url=wandb_url, trackio_url=trackio_url)
        fields.update(trainer_name=trainer_name, trainer_citation=trainer_citation, paper_title=paper_title)
        fields.update(paper_id=paper_id, comet_url=comet_url)
        return ModelCard.from_template(data, template_path=template_file, **fields)
    lines = [f"# Model Card for {model_name}", ""]
    source = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a base model"
    lines += [f"This model is a fine-tuned version of {source}", ""]
    if dataset_name:
        lines[-2] += f" on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset."
    else:
        lines[-2] += "."
    lines += ["## Quick start", "", "```python", "from transformers import pipeline", ""]
    lines += [
        'question = "If you had a time machine, but could only go to the past or the future once, which would it be?"',
        f'generator = pipeline("text-generation", model="{hub_model_id}", device="cuda")',
        'output = generator([{"role": "user", "content": question}], max_new_tokens=128, return_full_text=False)[0]',
        'print(output["generated_text"])',
        "```",
        "",
        "## Training procedure",
        "",
    ]
    for name, url in (("Weights & Biases", wandb_url), ("Trackio", trackio_url), ("Comet", comet_url)):
        if url:
            lines += [f"[Visualize this run in {name}]({url})", ""]
    lines += [f"This model was trained with {trainer_name}.", ""]
    if paper_title and paper_id:
        lines[-2] = lines[-2][:-1] + f", the method of [{paper_title}](https://huggingface.co/papers/{paper_id})."
    lines += ["### Framework versions", ""]
    lines += [f"- {package}: {version}" for package, version in versions().items()]
    if trainer_citation:
        lines += ["", "## Citations", "", f"Cite {trainer_name} as:", "", "```bibtex", trainer_citation, "```"]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
