"""The error of a price or planner input a user wrote: a file, a line, a value that cannot be used.

Its message says what was wrong, what was expected and what to do; commands print it and exit
with code 2 instead of showing a traceback.
"""

from geotrain.errors import UserError


class InputFileError(UserError):
    """A price, catalog or planner input is wrong; the message is meant for the user as it is."""
