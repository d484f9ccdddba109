"""Reading a step checkpoint without running code from it.

A step checkpoint is pickle in three places: torch.save's files (the schedule's state, each rank's RNG state),
DCP's `.metadata` (pickled dataclasses) and DCP's non-tensor entries (the optimizer's hyperparameters, read by
torch.load with weights_only=False). A pickle can call anything, so a checkpoint folder copied from shared storage
could run a command on resume. Here every one of them is read as data only:
- torch.save files with `torch.load(weights_only=True)`;
- `.metadata` with an unpickler that knows DCP's own metadata classes and nothing else (`SafeReader`);
- DCP's non-tensor entries with weights_only=True too (`SafeLoadPlanner`).
Anything else is refused with `UnsafeCheckpoint`, naming the file.
"""

import enum
import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta


class UnsafeCheckpoint(Exception):
    """A checkpoint file asks to run code (or is not what this project writes)."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


# What DCP's .metadata holds (torch 2.13): its dataclasses, paths, sizes, dtypes and layouts.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "torch": {"Size"},
}


def _enum_member(cls, name):
    """`getattr(cls, name)` for an enum member and nothing else: Python 3.11.2 (Debian 12's python3.11) pickles an
    enum member so (DCP's _MEM_FORMAT_ENCODING in every tensor's entry), where 3.11.7 calls the class with its value.
    `cls` came through find_class, so it is one of DCP's own classes."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"it asks for {getattr(cls, '__name__', type(cls).__name__)}.{name}, which is not "
                                 "checkpoint metadata")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module.startswith("pathlib.") and name in _METADATA_CLASSES["pathlib"]:
            # Python 3.13 pickles a path from pathlib._local, which 3.11 has not: read from pathlib on either.
            module = "pathlib"
        allowed = name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not checkpoint metadata")
        return super().find_class(module, name)


def load_data(path: Path):
    """A torch.save file as data (tensors, numbers, strings, lists, dicts); UnsafeCheckpoint for anything else."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(path, f"it holds more than tensors and plain values ({str(e).splitlines()[0][:200]})")


class SafeReader(FileSystemReader):
    """DCP's reader of a checkpoint folder, its `.metadata` read by an unpickler that builds DCP's metadata only.
    `refused`: what it refused (DCP words its readers' errors anew)."""

    refused: UnsafeCheckpoint | None = None

    def read_metadata(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                self.refused = self.refused or UnsafeCheckpoint(path, str(e))
                raise self.refused from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, its non-tensor entries read as data only (DCP's own reads them with weights_only=False).
    `refused`: what it refused."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder
        self.refused: UnsafeCheckpoint | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            data = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused = UnsafeCheckpoint(self.folder, f"its entry {read_item.dest_index.fqn} holds more than plain "
                                                         f"values ({str(e).splitlines()[0][:200]})")
            raise self.refused from None
        clean = io.BytesIO()
        torch.save(data, clean)  # what we just read as data: DCP's own torch.load of it runs nothing else
        clean.seek(0)
        super().load_bytes(read_item, clean)
