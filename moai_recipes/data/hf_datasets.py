"""The boundary to Hugging Face `datasets`: a Hub dataset id or a local dataset folder, one split of it, as rows.

`datasets` brings the Hub's layouts, configs and splits, its download cache and its offline mode
(HF_DATASETS_OFFLINE=1 reads a dataset the cache holds); its errors become one UserError each, saying what
exists. Nothing else uses `datasets` (inputs.import_ahead imports it before a launcher forks its workers). Tested by
`python -m pytest tests/test_hf_datasets.py`.
"""

from dataclasses import dataclass
from pathlib import Path

from moai_recipes.errors import UserError


@dataclass(frozen=True)
class HFSplit:
    """Which rows to read: `source` (a Hub id, owner/name, or a local folder), its config `name`, the `split`
    (a name, or a slice such as train[:10%]) and `data_files` (which files of the repository or folder)."""

    source: str
    name: str | None = None
    split: str = "train"
    data_files: str | list | dict | None = None

    def describe(self) -> str:
        return self.source + (f" ({self.name})" if self.name else "") + f", split {self.split}"


def open_split(what: HFSplit, *, streaming: bool = False):
    """The split as a `datasets.Dataset` (read through the local cache, downloaded once) or, `streaming`,
    an IterableDataset read as it goes."""
    import datasets

    if Path(what.source).expanduser().is_file():
        raise UserError(f"dataset.source={what.source} is a file; a single file is read with dataset.path={what.source}")
    base = what.split.split("[", 1)[0]
    kwargs = {"name": what.name, "data_files": what.data_files, "streaming": streaming}
    folder = Path(what.source).expanduser()
    try:
        if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
            # A folder written by save_to_disk: read back as it was saved (a Dataset: its one split, `train`).
            saved = datasets.load_from_disk(str(folder))
            splits = saved if isinstance(saved, datasets.DatasetDict) else datasets.DatasetDict({"train": saved})
            if base not in splits:
                raise UserError(f"dataset.split={what.split}: {folder} holds the splits {', '.join(splits)}")
            data = splits[base]
            if base != what.split:
                raise UserError(f"dataset.split={what.split}: slices of a save_to_disk folder are not read; use "
                                f"dataset.split={base}")
            return data.to_iterable_dataset() if streaming else data
        splits = datasets.load_dataset(what.source, **kwargs)
        if base not in splits:
            raise UserError(f"dataset.split={what.split}: {what.describe().rsplit(',', 1)[0]} has no split '{base}'; "
                            f"its splits are {', '.join(splits)}")
        if base == what.split or streaming:
            if base != what.split:
                raise UserError(f"dataset.split={what.split}: a slice of a split cannot be streamed; stream "
                                f"dataset.split={base} (with max_steps) or turn dataset.streaming off")
            return splits[base]
        return datasets.load_dataset(what.source, split=what.split, **kwargs)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; each is said in the user's terms below
        raise UserError(_explain(what, e)) from None


def fingerprint(ds) -> str | None:
    """What the datasets library itself keys this split's cache by; None when it has none (streaming)."""
    return getattr(ds, "_fingerprint", None)


def rows(ds, what: HFSplit):
    """(where, row) for each row, `where` naming the source, split and row number (1-based)."""
    for n, row in enumerate(ds, 1):
        yield f"{what.source} [{what.split}] row {n}", row


def num_rows(ds) -> int | None:
    """Rows in the split, where known without reading it (a streamed split may not say)."""
    n = getattr(ds, "num_rows", None)
    if n is None and getattr(ds, "info", None) and ds.info.splits and ds.split in ds.info.splits:
        n = ds.info.splits[ds.split].num_examples or None
    return n


def _explain(what: HFSplit, e: Exception) -> str:
    import datasets

    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if e.__cause__ is not None:  # DatasetGenerationError says only that something failed; its cause says what
        text += f": {str(e.__cause__).strip() or type(e.__cause__).__name__}"
    source = f"dataset.source={what.source}"
    local = Path(what.source).expanduser()
    if isinstance(e, datasets.exceptions.DatasetNotFoundError) or (
            isinstance(e, (ConnectionError, FileNotFoundError)) and not local.exists()):
        offline = datasets.config.HF_DATASETS_OFFLINE or datasets.config.HF_HUB_OFFLINE
        where = ("offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set) and not in the datasets cache"
                 if offline else "not found on the Hugging Face Hub")
        return (f"{source}: no such local folder, and {where}. Give a Hub id (owner/name) that exists, or a "
                f"folder of data files; a gated dataset needs `huggingface-cli login` ({text})")
    if "BuilderConfig" in text or "config name is missing" in text.lower():
        return (f"dataset.name={what.name}: {text}. Set dataset.name to one of the configs listed"
                if what.name else f"{source} has several configs: {text}. Choose one with dataset.name=NAME")
    if isinstance(e, datasets.data_files.EmptyDatasetError):
        return f"{source}: {text}. Put .parquet, .jsonl, .json or .csv files in it, or name them with dataset.data_files"
    if "Unknown split" in text or "Bad split" in text or "corresponds to no data" in text:
        return f"dataset.split={what.split}: {text}; choose a split (or a slice) that has rows"
    if isinstance(e, StopIteration) or "BatchSize must be greater than 0" in text:
        return f"{source}: a data file holds no rows ({text}); remove empty files or choose others with dataset.data_files"
    return f"{source}: cannot be read by the datasets library: {text}"
