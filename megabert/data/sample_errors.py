"""Errors from reading samples reach the user as one line, with or without DataLoader workers.

A DataLoader worker that raises hands torch an exception it re-raises in the main process
as `Caught X in DataLoader worker process N` plus the worker's whole traceback: 60-odd lines
around the one line a MegabertError already had. So the loader's dataset is wrapped here:
an error while reading a sample is not raised in the worker but handed back in place of the
batch, and raised in the main process as what it was. A MegabertError stays itself (its
class and its line); any other exception from a dataset that knows its files becomes the
DataError its `sample_error(idx, error)` writes, naming the file and the rows that failed
(bit rot inside a compressed chunk, a corrupt page: the readers' own libraries say only
"filter returned failure" or "corrupt snappy data"). The same happens without workers, so
`--num-workers 0` and 2 print the same line.

An exception from a dataset without `sample_error`, or from the loader's own code, is a bug,
not damaged data: torch reports it with its traceback as before. MEGABERT_TRACEBACK=1 lets
every exception through that way (with the worker's traceback), as it does for cli_main.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch.utils.data import default_collate

from megabert.errors import DataError, MegabertError

_MAX_CAUSE_CHARS = 240


def cause(error: BaseException) -> str:
    """`Type: message` of a library's exception, on one line and not too long for one."""
    text = " ".join(str(error).split())
    if len(text) > _MAX_CAUSE_CHARS:
        text = text[:_MAX_CAUSE_CHARS - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class SampleFailure:
    """What a worker hands back instead of a batch: the error's class and its line (rebuilt in
    the main process, so no exception object, with its traceback and causes, is pickled)."""

    __slots__ = ("kind", "message")

    def __init__(self, error: MegabertError):
        self.kind, self.message = type(error), str(error)

    def error(self) -> MegabertError:
        try:
            return self.kind(self.message)
        except TypeError:  # a subclass whose constructor takes more than the line
            return DataError(self.message)


def _explained(dataset, idx, error: Exception) -> Optional[MegabertError]:
    # The pre-training datasets name the file behind a failed sample; torch's and the
    # fine-tuning tasks' tensor datasets have no such method.
    explain = getattr(dataset, "sample_error", None)
    if explain is None:
        return None
    try:
        return explain(idx, error)
    except Exception:  # the dataset cannot say where: let the original exception speak
        return None


def read_sample(dataset, idx):
    """dataset[idx], a reader's own exception turned into the one-line MegabertError the dataset's
    `sample_error` writes (raised as is when the dataset cannot say where it failed)."""
    try:
        return dataset[idx]
    except MegabertError:
        raise
    except Exception as e:
        if os.environ.get("MEGABERT_TRACEBACK") == "1":
            raise
        explained = _explained(dataset, idx, e)
        if explained is None:
            raise
        raise explained from e


class ReportingDataset(torch.utils.data.Dataset):
    """A map-style dataset whose read errors come back as a SampleFailure instead of raising."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx):
        return self.__getitems__([idx])[0]

    def __getitems__(self, indices) -> list:  # torch's fetcher calls this with a micro-batch's indices
        if os.environ.get("MEGABERT_TRACEBACK") == "1":
            return [self.dataset[i] for i in indices]
        samples = []
        for idx in indices:
            try:
                samples.append(self.dataset[idx])
            except MegabertError as e:
                return [SampleFailure(e)]
            except Exception as e:
                explained = _explained(self.dataset, idx, e)
                if explained is None:
                    raise
                return [SampleFailure(explained)]
        return samples


def collate(samples: list):
    """default_collate, passing a SampleFailure through as the batch."""
    if samples and isinstance(samples[0], SampleFailure):
        return samples[0]
    return default_collate(samples)


class _RaisingIterator:
    """The DataLoader's iterator, raising a failure where its batch would have been."""

    def __init__(self, iterator):
        self._iterator = iterator

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._iterator)

    def __next__(self):
        batch = next(self._iterator)
        if isinstance(batch, SampleFailure):
            raise batch.error()
        return batch


class _RaisesFailures:
    """DataLoader mix-in: a SampleFailure where a batch belongs is raised as its error."""

    def __iter__(self):
        # Not a generator: iter(loader) starts persistent workers now, as DataLoader's does.
        return _RaisingIterator(super().__iter__())


class ReportingDataLoader(_RaisesFailures, torch.utils.data.DataLoader):
    """A DataLoader over ReportingDataset(dataset), collated by default_collate: read errors
    raise in the main process, one line each."""

    def __init__(self, dataset, **kwargs):
        super().__init__(ReportingDataset(dataset), collate_fn=collate, **kwargs)


class ReportingIterableLoader(_RaisesFailures, torch.utils.data.DataLoader):
    """A DataLoader (batch_size=None) over an IterableDataset that yields a SampleFailure
    where it failed (see `yield_failures`): the failure raises in the main process."""


def yield_failures(items):
    """The items of an iterator, then, if it raises a MegabertError, a SampleFailure in its place
    (for an IterableDataset behind a ReportingIterableLoader)."""
    try:
        yield from items
    except MegabertError as e:
        if os.environ.get("MEGABERT_TRACEBACK") == "1":
            raise
        yield SampleFailure(e)
