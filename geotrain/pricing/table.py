"""Reading the planner's CSV input files with errors that name the file, line and column.

All planner tables (instance catalog, egress prices, network matrix) are plain CSV with a header
row. Lines starting with ``#`` are comments, so a user can note where an edited figure came from.
Each data row is returned as a :class:`Row` whose typed getters raise :class:`InputFileError`
naming ``file:line``, the column and the expected form::

    for row in read_table(path, required=["cloud", "region"]):
        price = row.number("spot_usd_per_hour", optional=True, minimum=0)

Encodings: files are read with :func:`geotrain.text_files.read_user_text`, as every file a user writes:
UTF-8 (a byte-order mark, as Excel's "CSV UTF-8" writes, is skipped) or UTF-16 with a byte-order mark
(Windows PowerShell's ``>``, Notepad's "Unicode"). Other encodings (UTF-16 without a byte-order mark,
UTF-32, Windows-1252) and tab-separated files (Excel's "Unicode text") fail with a message that says how
to save the file instead.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from geotrain.pricing.errors import InputFileError
from geotrain.text_files import read_user_text


@dataclass
class Row:
    path: Path
    line: int
    values: dict[str, str]

    def where(self, column: str) -> str:
        return f"{self.path}:{self.line}, column {column!r}"

    def text(self, column: str, optional: bool = False) -> str:
        value = self.values.get(column, "").strip()
        if not value and not optional:
            raise InputFileError(f"{self.where(column)}: value is missing; fill it in or remove the line")
        return value

    def number(self, column: str, optional: bool = False, minimum: float | None = None,
               maximum: float | None = None) -> float | None:
        raw = self.text(column, optional=optional)
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise InputFileError(f"{self.where(column)}: {raw!r} is not a number; expected e.g. 0.18") from None
        if value != value or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise InputFileError(f"{self.where(column)}: {raw} is out of range; expected a number {bounds}")
        return value

    def integer(self, column: str, minimum: int = 0) -> int:
        raw = self.text(column)
        try:
            value = int(raw)
        except ValueError:
            raise InputFileError(f"{self.where(column)}: {raw!r} is not a whole number; expected e.g. 1") from None
        if value < minimum:
            raise InputFileError(f"{self.where(column)}: {value} is out of range; expected a whole number >= {minimum}")
        return value

    def choice(self, column: str, choices: tuple[str, ...]) -> str:
        raw = self.text(column)
        if raw not in choices:
            raise InputFileError(f"{self.where(column)}: {raw!r} is not allowed; expected one of {', '.join(choices)}")
        return raw


def read_table(path: Path, required: list[str]) -> Iterator[Row]:
    """Yield the data rows of a CSV file, after checking that its header has the required columns."""
    path = Path(path)
    lines = read_user_text(path, error=InputFileError, advice=SAVE_AS_UTF8).splitlines()
    header: list[str] | None = None
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cells = next(csv.reader([line]))
        if header is None:
            if len(cells) == 1 and "\t" in line:
                raise InputFileError(f"{path}:{number}: the header is separated by tabs, not commas (as in Excel's "
                                     "\"Unicode text\"); save the file with commas, in Excel as \"CSV UTF-8 "
                                     "(comma delimited)\"")
            header = [cell.strip() for cell in cells]
            missing = [name for name in required if name not in header]
            if missing:
                raise InputFileError(f"{path}:{number}: header lacks column(s) {', '.join(missing)}; "
                                   f"expected at least: {', '.join(required)}")
            continue
        if len(cells) != len(header):
            raise InputFileError(f"{path}:{number}: has {len(cells)} fields but the header has {len(header)} "
                               f"({', '.join(header)}); check for a missing or extra comma")
        yield Row(path, number, dict(zip(header, cells)))
    if header is None:
        raise InputFileError(f"{path}: no header row; expected a CSV header with: {', '.join(required)}")


SAVE_AS_UTF8 = 'save it as UTF-8 (in Excel: "CSV UTF-8 (comma delimited)")'
