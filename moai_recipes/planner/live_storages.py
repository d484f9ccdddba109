"""Bytes of tensor storages alive, and the most at once: what the planner's layer traces count
(planner/activations.OpCounter). A run measures its own peak with PyTorch's counters (train/peak_memory.py), not
with this ledger, so that a counting mistake here shows as a prediction error."""

import weakref

import torch


class LiveStorages:
    """A storage counts from when `add` first sees it until it is freed (a weak reference's callback: a storage's
    Python object lives as long as the storage); seen again, or after `resized`, its new size counts. Storages
    in `ignore` never count (the weights and inputs a trace runs on; held here, so their ids stay theirs).
    `remember_peak`: keep which storages were alive at the peak (`alive_at_peak`), at a cost on each new peak."""

    def __init__(self, ignore=(), *, remember_peak: bool = False):
        self.current = self.peak = 0
        self._known: dict[int, tuple[weakref.ref, list[int]]] = {}  # id(storage) -> (ref, [bytes])
        self._ignored = {id(s): s for s in ignore}
        self._remember_peak = remember_peak
        self._at_peak: list[weakref.ref] = []

    def add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._ignored:
            return
        entry = self._known.get(key)
        if entry is not None and entry[0]() is storage:
            self._resize(entry[1], storage.nbytes())
            return
        size = [storage.nbytes()]
        self._known[key] = (weakref.ref(storage, lambda _, key=key, size=size: self._freed(key, size)), size)
        self._grow(size[0])

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place (UntypedStorage.resize_: FSDP2 frees and refills its gathered parameters so)."""
        entry = self._known.get(id(storage))
        if entry is not None and entry[0]() is storage:
            self._resize(entry[1], storage.nbytes())

    def reset_peak(self) -> None:
        """From now on, the peak is the most alive at once from here (a new step)."""
        self.peak = self.current
        if self._remember_peak:
            self._at_peak = [ref for ref, _ in self._known.values()]

    def alive_at_peak(self) -> set[int]:
        """The ids of the storages alive at the peak that still are (remember_peak=True)."""
        return {id(s) for s in (ref() for ref in self._at_peak) if s is not None}

    def _resize(self, size: list[int], nbytes: int) -> None:
        grown, size[0] = nbytes - size[0], nbytes
        self._grow(grown)

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            if self._remember_peak:
                self._at_peak = [ref for ref, _ in self._known.values()]

    def _freed(self, key: int, size: list[int]) -> None:
        self.current -= size[0]
        self._known.pop(key, None)
