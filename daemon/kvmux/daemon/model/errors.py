"""The one error type of the model folder package."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class ModelFormatError(Exception):
    """A model folder is missing something, or something in it is inconsistent.

    The message names the folder, each problem found (the missing or inconsistent
    thing) and what was expected. ``problems`` holds the same lines one by one.
    """

    def __init__(self, folder: Path | str | None, problems: str | Iterable[str]) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.problems: tuple[str, ...] = (
            (problems,) if isinstance(problems, str) else tuple(problems)
        )
        where = f"model folder {self.folder}" if self.folder is not None else "model"
        if len(self.problems) == 1:
            message = f"{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{where}: {len(self.problems)} problems:\n{lines}"
        super().__init__(message)
