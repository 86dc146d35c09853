"""Fixtures for the lab tests: a lab that is always taken down and checked clean (helpers: lab_helpers.py).

The fixture checks that ``down`` left nothing behind even when the test failed.
"""

from __future__ import annotations

import pytest

from lab_helpers import Lab, nothing_left


@pytest.fixture
def make_lab(tmp_path):
    """``make_lab(name)`` -> a :class:`Lab`; every lab made is taken down at the end and checked clean."""
    labs = []

    def make(name: str) -> Lab:
        lab = Lab(name, tmp_path)
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in labs:
            lab.down()
        left = {lab.name: nothing_left(lab.name) for lab in labs}
        assert not any(left.values()), f"the lab left something behind: {left}"
