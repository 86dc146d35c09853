"""The planner against [EMJ24], cell by cell: writes the planner's side, and prints the table from both files.

The published side is ``geotrain/data/planner/published_emj24.csv`` (each cell with its figure or table);
this script writes the planner's side, ``benchmarks/results/planner_validation.json`` (a prediction per cell
and the lessons), and prints the markdown table of docs/planning.md from the two files. A unit test
(tests/unit/test_planner_validation.py) checks that the JSON is what the shipped inputs predict now, and
holds the errors to the issue's bounds (median <= 10%, largest <= 25% per family and quantity).

Run from the repository root::

    python benchmarks/planner_validation.py           # writes the JSON, then prints the table
    python benchmarks/planner_validation.py --table   # prints the table from the committed JSON
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geotrain.planner.validation import Lesson, compare, lessons, load_published, markdown, predictions  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "planner_validation.json"


def write() -> None:
    figures = load_published()
    data = {"benchmark": "planner_validation", "published": "geotrain/data/planner/published_emj24.csv",
            "predictions": predictions(figures=figures), "lessons": [asdict(row) for row in lessons()]}
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(data, indent=2) + "\n")


def table() -> str:
    data = json.loads(RESULT.read_text())
    return markdown(compare(load_published(), data["predictions"]), [Lesson(**row) for row in data["lessons"]])


if __name__ == "__main__":
    if "--table" not in sys.argv:
        write()
    print(table())
