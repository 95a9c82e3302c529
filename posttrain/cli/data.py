"""The training data named on the command line: a hub dataset, a local directory, a data file given directly
(.jsonl .json .csv .parquet), or a mixture of several sources (`datasets:` in the YAML config, TRL's format).
Also TRL's data dataclasses (ScriptArguments, DatasetConfig, DatasetMixtureConfig) and `get_dataset`.

A data file is checked before datasets reads it, so that a missing file, an empty one, or a broken JSON line
is reported by name and line number instead of as a failure deep inside the dataset builder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.cli.values import build_dataclass
from posttrain.errors import ConfigError, DataError

# Data file suffix -> the datasets builder that reads it.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
PATH_PREFIXES = ("/", "./", "../", "~")


@dataclass
class ScriptArguments:
    """The data flags of a TRL-style training script (dataset name, config, splits).

    Where a TRL-style script's data comes from (TRL's `ScriptArguments`, same fields and defaults).

    See docs/cli.md.
    """

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset name, local dataset directory, or data file (.jsonl .json .csv .parquet). "
            "Not used when `datasets` is given."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration (subset) of the dataset: the `name` of datasets.load_dataset."}
    )
    dataset_train_split: str = field(
        default="train", metadata={"help": "Split to train on (slices like 'train[:1000]' work)."}
    )
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split to evaluate on when eval_strategy is not 'no'."}
    )
    dataset_streaming: bool = field(
        default=False, metadata={"help": "Stream the dataset (an IterableDataset) instead of loading it whole."}
    )
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={
            "help": "Leave boolean buffers (attention masks) out of DDP's buffer broadcast, "
            "a fix for 'invalid scalar type' errors of some models under DDP."
        },
    )


@dataclass
class DatasetConfig:
    """One dataset of a mixture; the fields are datasets.load_dataset's arguments plus `columns` and `fraction`."""

    path: str = field(metadata={"help": "Hub dataset name, builder ('json', 'csv', ...), local directory or file."})
    name: str | None = field(default=None, metadata={"help": "Configuration (subset) of the dataset."})
    data_dir: str | None = field(default=None, metadata={"help": "Directory of the data files within `path`."})
    data_files: str | list[str] | dict[str, str] | None = field(
        default=None, metadata={"help": "Data file(s) for the builder named by `path`."}
    )
    split: str = field(default="train", metadata={"help": "Split to load (slices like 'train[:100]' work)."})
    columns: list[str] | None = field(default=None, metadata={"help": "Columns to keep (default: all)."})
    fraction: float | None = field(
        default=None,
        metadata={
            "help": "Target share of this dataset in the mixture; set for all datasets or none. Shares are "
            "normalised, and the mixture is as large as it can be without repeating rows: the first "
            "round(share * N) rows of each dataset are kept."
        },
    )


@dataclass
class DatasetMixtureConfig:
    """A mixture of datasets from a YAML `datasets:` list, for TRL-style scripts.

    Several datasets concatenated into one (TRL's `datasets:` YAML section), optionally split into train/test.

    See docs/cli.md.
    """

    datasets: list[DatasetConfig] = field(
        default_factory=list, metadata={"help": "The datasets of the mixture (usually given in the YAML config)."}
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the datasets of the mixture."})
    test_split_size: float | None = field(
        default=None,
        metadata={"help": "Split the mixture into 'train' and 'test' with this test share (a fraction) or row count."},
    )

    def __post_init__(self):
        self.datasets = [
            build_dataclass(DatasetConfig, entry, where=f"datasets[{index}]") if isinstance(entry, dict) else entry
            for index, entry in enumerate(self.datasets)
        ]


@dataclass
class DataArguments(ScriptArguments):
    """The data flags of the `posttrain` command: TRL's ScriptArguments and DatasetMixtureConfig fields, plus
    posttrain's ways to get evaluation rows (a separate source, or a held-out share)."""

    dataset_test_split: str | None = field(
        default=None,
        metadata={
            "help": "Split to evaluate on, of dataset_name or else of eval_dataset_name (with "
            "eval_strategy other than 'no' and no other eval source: 'test', as TRL)."
        },
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A separate source to evaluate on (read with dataset_test_split, else "
            "its 'train' split, the only split of a data file)."
        },
    )
    eval_split_size: float | None = field(
        default=None, metadata={"help": "Hold out this fraction (0 < f < 1) of the training rows for evaluation."}
    )
    datasets: list[dict] | None = field(
        default=None,
        metadata={
            "help": "Several datasets, concatenated: a list of {path, name (config), data_dir, data_files, "
            "split, columns (to keep), fraction (share)}; usually given in the YAML config."
        },
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the datasets of the `datasets` mixture."})
    test_split_size: float | None = field(
        default=None,
        metadata={"help": "Hold out this share of the training rows for evaluation (TRL's name for eval_split_size)."},
    )


def _check_exists(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"Data file {path} does not exist; check the path (relative paths start from {Path.cwd()}).")


def _check_data_file(path: Path) -> None:
    """A missing, empty, or (for JSON) malformed file fails here with the file name and line number."""
    _check_exists(path)
    if path.suffix not in FILE_BUILDERS:
        raise DataError(
            f"{path} is not a supported data file; use one of {', '.join(FILE_BUILDERS)}, or a dataset directory."
        )
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
                return f'line {number} is not a JSON object (one {{"column": value}} object per line).'
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


def load_source(location: str, config: str | None = None, split: str = "train", streaming: bool = False):
    """The `split` of a data file, a local dataset directory (data files or `save_to_disk`), or a hub dataset."""
    import datasets

    path = Path(location).expanduser()
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            dataset = _pick_split(loaded, split, location) if isinstance(loaded, datasets.DatasetDict) else loaded
            return dataset.to_iterable_dataset() if streaming else dataset
        return _load(location, lambda: datasets.load_dataset(str(path), config, split=split, streaming=streaming))
    if path.is_file() or _looks_like_path(location):
        _check_data_file(path)
        builder = FILE_BUILDERS[path.suffix]
        return _load(
            location, lambda: datasets.load_dataset(builder, data_files=str(path), split=split, streaming=streaming)
        )
    return _load(location, lambda: datasets.load_dataset(location, config, split=split, streaming=streaming))


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
        raise DataError(
            f"Could not find dataset {location!r} ({err}). Pass a hub dataset name, a dataset "
            "directory, or a data file path."
        ) from None
    except DatasetGenerationError as err:
        raise DataError(f"Could not read {location}: {err.__cause__ or err}") from None
    except ValueError as err:  # datasets' unknown split / config messages
        raise DataError(f"{location}: {err}") from None
    if hasattr(dataset, "__len__") and len(dataset) == 0:  # a streamed dataset has no length
        raise DataError(f"{location} has no rows in the selected split; pick a split or slice with rows.")
    return dataset


def _load_entry(entry: DatasetConfig, streaming: bool):
    """One dataset of a mixture: local files and directories through `load_source` (checked, with clear errors),
    anything else (a builder with data_files, a hub dataset) through datasets.load_dataset."""
    import datasets

    if (
        entry.data_dir is None
        and entry.data_files is None
        and (Path(entry.path).expanduser().exists() or _looks_like_path(entry.path))
    ):
        return load_source(entry.path, entry.name, entry.split, streaming=streaming)
    return _load(
        entry.path,
        lambda: datasets.load_dataset(
            path=entry.path,
            name=entry.name,
            data_dir=entry.data_dir,
            data_files=entry.data_files,
            split=entry.split,
            streaming=streaming,
        ),
    )


def _select_columns(dataset, columns: list[str] | None, location: str):
    if not columns:
        return dataset
    names = dataset.column_names
    if names is not None:  # a streamed dataset may not know its columns before reading
        missing = [column for column in columns if column not in names]
        if missing:
            raise DataError(f"datasets: {location} has no column(s) {missing}; its columns are {names}.")
    return dataset.select_columns(columns)


def _mixture_sizes(lengths: list[int], fractions: list[float]) -> list[int]:
    """Rows kept of each dataset: shares normalised to sum to one, and the largest mixture size N for which no
    dataset gives more rows than it has; each keeps its first round(share * N) rows (TRL's rule)."""
    if any(fraction < 0 for fraction in fractions) or sum(fractions) <= 0:
        raise ConfigError(f"datasets: fractions {fractions} must be >= 0 with a positive sum.")
    shares = [fraction / sum(fractions) for fraction in fractions]
    total = min(length / share for length, share in zip(lengths, shares) if share > 0)
    return [round(share * total) for share in shares]


def get_dataset(mixture_config: DatasetMixtureConfig, seed: int | None = None):
    """Loads and concatenates the datasets of a `DatasetMixtureConfig`, as TRL's scripts do.

    The datasets of `mixture_config` (columns selected, `fraction` shares applied) concatenated in order, as a
    DatasetDict with a 'train' split, or 'train' and 'test' when `test_split_size` is set (`seed` makes that split
    reproducible; TRL's has none).

    See docs/cli.md.
    """
    import datasets

    entries = mixture_config.datasets
    if not entries:
        raise ConfigError("datasets: the mixture lists no dataset; add at least one {path: ...} entry.")
    parts = [
        _select_columns(_load_entry(entry, mixture_config.streaming), entry.columns, entry.path) for entry in entries
    ]
    fractions = [entry.fraction for entry in entries]
    if any(fraction is not None for fraction in fractions):
        if any(fraction is None for fraction in fractions):
            raise ConfigError(
                f"datasets: `fraction` is set for some datasets and not others ({fractions}); set it "
                "for all of them or for none."
            )
        if mixture_config.streaming:
            raise ConfigError(
                "datasets: `fraction` needs the length of each dataset, which streaming does not "
                "know; drop `fraction` or set streaming to false."
            )
        sizes = _mixture_sizes([len(part) for part in parts], fractions)
        parts = [part.select(range(size)) for part, size in zip(parts, sizes)]
    if not mixture_config.streaming:
        parts = _align(parts, [entry.path for entry in entries])
    combined = datasets.concatenate_datasets(parts)
    if mixture_config.test_split_size is not None:
        if mixture_config.streaming:
            raise ConfigError("test_split_size splits a dataset of known length; it does not work with streaming.")
        return combined.train_test_split(test_size=mixture_config.test_split_size, seed=seed)
    return datasets.DatasetDict({"train": combined})


def _align(parts: list, locations: list[str]) -> list:
    """Datasets with the same columns, cast to the first one's column types (JSON and CSV store strings
    differently); different columns are an error that suggests `columns`."""
    columns = {location: sorted(part.column_names) for location, part in zip(locations, parts)}
    if len({tuple(names) for names in columns.values()}) > 1:
        raise DataError(
            f"datasets: the sources have different columns {columns}; give each a 'columns' list "
            "so that they keep the same ones."
        )
    features = parts[0].features
    aligned = []
    for location, part in zip(locations, parts):
        try:
            aligned.append(part.cast(features))
        except (ValueError, TypeError) as err:
            raise DataError(
                f"datasets: {location} has column types {part.features}, which do not convert to "
                f"those of {locations[0]} ({features}): {err}"
            ) from None
    return aligned


def _holdout(args: DataArguments) -> tuple[str, float] | None:
    given = [
        (name, getattr(args, name))
        for name in ("eval_split_size", "test_split_size")
        if getattr(args, name) is not None
    ]
    if len(given) > 1:
        raise ConfigError("--eval_split_size and --test_split_size both hold out training rows; pass one of them.")
    return given[0] if given else None


def _check_arguments(args: DataArguments) -> None:
    if (args.dataset_name is None) == (args.datasets is None):
        raise ConfigError(
            "Give the training data either as --dataset_name or as a `datasets:` list in the YAML "
            "config" + (", not both." if args.dataset_name else ".")
        )
    holdout = _holdout(args)
    if holdout is not None:
        name, size = holdout
        if args.dataset_test_split or args.eval_dataset_name:
            raise ConfigError(
                f"--{name} holds out training rows for evaluation, which conflicts with "
                "--dataset_test_split / --eval_dataset_name; pass only one way to get eval rows."
            )
        if not 0 < size < 1:
            raise ConfigError(f"--{name} {size}: use a fraction between 0 and 1, e.g. 0.1.")
    if args.datasets is not None and args.dataset_test_split and not args.eval_dataset_name:
        raise ConfigError(
            "--dataset_test_split needs one source; with a `datasets:` mixture use "
            "--eval_dataset_name or --test_split_size."
        )


def check_data_arguments(args: DataArguments) -> None:
    """The checks that need neither datasets nor reading the data: contradictory flags and a data file that is
    not there (the command runs them before importing the trainer)."""
    _check_arguments(args)
    for location in (args.dataset_name, args.eval_dataset_name):
        if location and _looks_like_path(location) and not Path(location).expanduser().is_dir():
            _check_exists(Path(location).expanduser())


def load_training_data(args: DataArguments, seed: int, evaluate: bool = False):
    """(train_dataset, eval_dataset or None) as the data flags describe them.

    `evaluate` (eval_strategy is not 'no') with no eval source given evaluates on the dataset's 'test' split,
    as TRL's scripts do, and says so when there is none.
    """
    _check_arguments(args)
    if args.datasets is not None:
        mixture = DatasetMixtureConfig(datasets=list(args.datasets), streaming=args.streaming)
        train = get_dataset(mixture)["train"]
    else:
        train = load_source(
            args.dataset_name, args.dataset_config, args.dataset_train_split, streaming=args.dataset_streaming
        )
    holdout = _holdout(args)
    if holdout is not None:
        name, size = holdout
        if not hasattr(train, "__len__"):
            raise ConfigError(f"--{name} needs a dataset of known length; it does not work with streaming.")
        if len(train) < 2:
            raise DataError(f"--{name} needs at least 2 training rows; there are {len(train)}.")
        try:
            halves = train.train_test_split(test_size=size, seed=seed)
        except ValueError as err:  # a fraction that leaves one side empty
            raise DataError(f"--{name} {size} of {len(train)} rows: {err}") from None
        return halves["train"], halves["test"]
    if args.eval_dataset_name:
        return train, load_source(args.eval_dataset_name, None, args.dataset_test_split or "train")
    if args.dataset_test_split:
        return train, load_source(
            args.dataset_name, args.dataset_config, args.dataset_test_split, streaming=args.dataset_streaming
        )
    if evaluate:
        if args.dataset_name is None:
            raise ConfigError(
                "eval_strategy is not 'no' but the `datasets:` mixture has no eval rows; set "
                "--test_split_size (or --eval_dataset_name), or --eval_strategy no."
            )
        try:
            return train, load_source(args.dataset_name, args.dataset_config, "test", streaming=args.dataset_streaming)
        except DataError as err:
            raise DataError(
                f"eval_strategy is not 'no', so the run evaluates on the 'test' split of "
                f"{args.dataset_name} (TRL's default dataset_test_split), which fails: {err} Pass "
                "--dataset_test_split, --eval_dataset_name or --eval_split_size, or --eval_strategy "
                "no."
            ) from None
    return train, None
