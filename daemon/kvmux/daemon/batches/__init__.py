"""OpenAI's Files and Batch API over kvmux's own jobs: files in the daemon's state
folder with their records in the job journal, and each batch a kvmux job run from
its input file to its output and error files (see :mod:`._batches`)."""

from ._batches import BatchError, Batches, BatchRecord, validate
from ._files import FileRecord, FileStore, Staged

__all__ = [
    "BatchError",
    "BatchRecord",
    "Batches",
    "FileRecord",
    "FileStore",
    "Staged",
    "validate",
]
