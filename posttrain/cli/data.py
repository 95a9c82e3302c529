"""The training data named on the command line: a hub dataset, a local directory, a data file given directly
(.jsonl .json .csv .parquet), or a mixture of several sources (`datasets:` in the YAML config).

A data file is checked before datasets reads it, so that a missing file, an empty one, or a broken JSON line
is reported by name and line number instead of as a failure deep inside the dataset builder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.cli.args import build_dataclass
from posttrain.errors import ConfigError, DataError

# Data file suffix -> the datasets builder that reads it.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
PATH_PREFIXES = ("/", "./", "../", "~")


@dataclass
class DataArguments:
    """Where the training (and evaluation) rows come from."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset name, local dataset directory, or data file (.jsonl .json .csv .parquet)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration (subset) of a hub dataset."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on (slices like "
                                                                        "'train[:1000]' work)."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on, of dataset_name or else of eval_dataset_name."}
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "A separate source to evaluate on (read with dataset_test_split, else "
                                        "its 'train' split, the only split of a data file)."}
    )
    eval_split_size: float | None = field(
        default=None, metadata={"help": "Hold out this fraction (0 < f < 1) of the training rows for evaluation."}
    )
    datasets: list[dict] | None = field(
        default=None,
        metadata={"help": "Several sources, concatenated: a list of {path (or name), config, split, columns (to "
                          "keep), fraction}; usually given in the YAML config."},
    )


@dataclass
class DatasetSource:
    """One entry of `datasets:`; `fraction` keeps that share of its rows, sampled with the run's seed."""

    path: str | None = None
    name: str | None = None
    config: str | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float = 1.0

    @property
    def location(self) -> str:
        return self.path or self.name


def _check_data_file(path: Path) -> None:
    """A missing, empty, or (for JSON) malformed file fails here with the file name and line number."""
    if not path.is_file():
        raise DataError(f"Data file {path} does not exist; check the path (relative paths start from "
                        f"{Path.cwd()}).")
    if path.suffix not in FILE_BUILDERS:
        raise DataError(f"{path} is not a supported data file; use one of {', '.join(FILE_BUILDERS)}, or a "
                        "dataset directory.")
    with open(path, "rb") as file:
        if not any(chunk.strip() for chunk in iter(lambda: file.read(1 << 16), b"")):
            raise DataError(f"Data file {path} is empty; it needs at least one row.")
    if FILE_BUILDERS[path.suffix] == "json":
        problem = _json_problem(path)
        if problem:
            raise DataError(f"Data file {path}: {problem}")


def _json_problem(path: Path) -> str | None:
    """What is wrong with a JSON Lines file (first bad line) or a JSON document, or None when it parses.

    A .json file whose first line is a complete JSON object is read as JSON Lines, like datasets does.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        return f"is not UTF-8 text ({err}); save it as UTF-8."
    first = next((line for line in lines if line.strip()), "")
    if path.suffix == ".jsonl" or _is_json_object(first):
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {number} is not valid JSON ({err.msg} at column {err.colno}); fix or delete that line."
            if not isinstance(row, dict):
                return f"line {number} is not a JSON object (one {{\"column\": value}} object per line)."
        return None
    try:
        json.loads("\n".join(lines))
    except json.JSONDecodeError as err:
        return f"line {err.lineno} is not valid JSON ({err.msg} at column {err.colno})."
    return None


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _looks_like_path(location: str) -> bool:
    return location.startswith(PATH_PREFIXES) or Path(location).suffix in FILE_BUILDERS


def load_source(location: str, config: str | None = None, split: str = "train"):
    """The `split` of a data file, a local dataset directory (data files or `save_to_disk`), or a hub dataset."""
    import datasets

    path = Path(location).expanduser()
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return _pick_split(loaded, split, location) if isinstance(loaded, datasets.DatasetDict) else loaded
        return _load(location, lambda: datasets.load_dataset(str(path), config, split=split))
    if path.is_file() or _looks_like_path(location):
        _check_data_file(path)
        builder = FILE_BUILDERS[path.suffix]
        return _load(location, lambda: datasets.load_dataset(builder, data_files=str(path), split=split))
    return _load(location, lambda: datasets.load_dataset(location, config, split=split))


def _pick_split(dataset_dict, split: str, location: str):
    if split not in dataset_dict:
        raise DataError(f"{location} has no split {split!r}; its splits are {sorted(dataset_dict)}.")
    return dataset_dict[split]


def _load(location: str, load):
    """Runs a datasets loader, reporting what went wrong with the data as a DataError."""
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError

    try:
        dataset = load()
    except (DatasetNotFoundError, FileNotFoundError, ConnectionError) as err:
        raise DataError(f"Could not find dataset {location!r} ({err}). Pass a hub dataset name, a dataset "
                        "directory, or a data file path.") from None
    except DatasetGenerationError as err:
        raise DataError(f"Could not read {location}: {err.__cause__ or err}") from None
    except ValueError as err:  # datasets' unknown split / config messages
        raise DataError(f"{location}: {err}") from None
    if len(dataset) == 0:
        raise DataError(f"{location} has no rows in the selected split; pick a split or slice with rows.")
    return dataset


def _select(dataset, source: DatasetSource, seed: int):
    """The source's columns and its `fraction` of rows (a seeded random sample)."""
    if source.columns:
        missing = [column for column in source.columns if column not in dataset.column_names]
        if missing:
            raise DataError(f"datasets: {source.location} has no column(s) {missing}; its columns are "
                            f"{dataset.column_names}.")
        dataset = dataset.select_columns(source.columns)
    if not 0 < source.fraction <= 1:
        raise ConfigError(f"datasets: {source.location} has fraction={source.fraction}; use 0 < fraction <= 1.")
    if source.fraction < 1:
        keep = round(source.fraction * len(dataset))
        if keep == 0:
            raise DataError(f"datasets: fraction={source.fraction} of the {len(dataset)} rows of "
                            f"{source.location} keeps no row; raise the fraction.")
        dataset = dataset.shuffle(seed=seed).select(range(keep))
    return dataset


def load_mixture(entries: list[dict], seed: int):
    """The `datasets:` sources, each narrowed to its columns and fraction, concatenated in the given order."""
    from datasets import concatenate_datasets

    parts = []
    for index, entry in enumerate(entries):
        source = build_dataclass(DatasetSource, entry, where=f"datasets[{index}]")
        if (source.path is None) == (source.name is None):
            raise ConfigError(f"datasets[{index}] needs exactly one of 'path' (local file or directory) or 'name' "
                              f"(hub dataset); got {entry}.")
        parts.append((source, _select(load_source(source.location, source.config, source.split), source, seed)))
    columns = {source.location: sorted(part.column_names) for source, part in parts}
    if len({tuple(names) for names in columns.values()}) > 1:
        raise DataError(f"datasets: the sources have different columns {columns}; give each a 'columns' list "
                        "so that they keep the same ones.")
    # Same columns, possibly stored differently (string / large_string from JSON / CSV): cast to the first's.
    features = parts[0][1].features
    aligned = []
    for source, part in parts:
        try:
            aligned.append(part.cast(features))
        except (ValueError, TypeError) as err:
            raise DataError(f"datasets: {source.location} has column types {part.features}, which do not convert to "
                            f"those of {parts[0][0].location} ({features}): {err}") from None
    return concatenate_datasets(aligned)


def _check_arguments(args: DataArguments) -> None:
    if (args.dataset_name is None) == (args.datasets is None):
        raise ConfigError("Give the training data either as --dataset_name or as a `datasets:` list in the YAML "
                          "config" + (", not both." if args.dataset_name else "."))
    if args.eval_split_size is not None:
        if args.dataset_test_split or args.eval_dataset_name:
            raise ConfigError("--eval_split_size holds out training rows for evaluation, which conflicts with "
                              "--dataset_test_split / --eval_dataset_name; pass only one way to get eval rows.")
        if not 0 < args.eval_split_size < 1:
            raise ConfigError(f"--eval_split_size {args.eval_split_size}: use a fraction between 0 and 1, e.g. 0.1.")
    if args.datasets is not None and args.dataset_test_split and not args.eval_dataset_name:
        raise ConfigError("--dataset_test_split needs one source; with a `datasets:` mixture use "
                          "--eval_dataset_name or --eval_split_size.")


def load_training_data(args: DataArguments, seed: int):
    """(train_dataset, eval_dataset or None) as the data flags describe them."""
    _check_arguments(args)
    if args.datasets is not None:
        train = load_mixture(args.datasets, seed)
    else:
        train = load_source(args.dataset_name, args.dataset_config, args.dataset_train_split)
    if args.eval_split_size is not None:
        if len(train) < 2:
            raise DataError(f"--eval_split_size needs at least 2 training rows; there are {len(train)}.")
        try:
            halves = train.train_test_split(test_size=args.eval_split_size, seed=seed)
        except ValueError as err:  # a fraction that leaves one side empty
            raise DataError(f"--eval_split_size {args.eval_split_size} of {len(train)} rows: {err}") from None
        return halves["train"], halves["test"]
    if args.eval_dataset_name:
        return train, load_source(args.eval_dataset_name, None, args.dataset_test_split or "train")
    if args.dataset_test_split:
        return train, load_source(args.dataset_name, args.dataset_config, args.dataset_test_split)
    return train, None
