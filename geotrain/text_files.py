"""Reading a text file a user wrote: a config, a planner profile or table, a run summary, an allow-list,
a swarm token, a lab topology.

Every such file goes through :func:`read_user_text`, so a file that cannot be read or is not UTF-8 text
fails the same way everywhere: one line naming the file (and the line and byte offset of the first bad
byte) and saying how to save it, raised as the caller's error class (a
:class:`~geotrain.errors.UserError`: exit code 2), never a ``UnicodeDecodeError`` traceback.

Encodings: files are UTF-8. A UTF-8 byte-order mark (Excel's "CSV UTF-8", Notepad) is skipped, and
UTF-16 with a byte-order mark (Windows PowerShell's ``>``, Notepad's "Unicode") is read as such. Other
encodings (UTF-16 without a byte-order mark, UTF-32, Windows-1252) and NUL bytes fail with a message.

YAML files are parsed with :func:`load_yaml`, which refuses a key written twice in one mapping (plain
YAML keeps the last one and silently drops the first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from geotrain.errors import UserError

SAVE_AS_UTF8 = 'save it as UTF-8 (your editor\'s "Save with encoding", or `iconv -f WINDOWS-1252 -t UTF-8`)'


def read_user_text(path: str | Path, what: str = "", error: type[Exception] = UserError,
                   advice: str = SAVE_AS_UTF8, unreadable_hint: str = "check the path") -> str:
    """The text of a file a user named, or ``error`` with a message that names it.

    ``what`` names the file's role in messages ("config", "profile"); ``advice`` says how to save the
    file as UTF-8 (the price tables name Excel's option); ``unreadable_hint`` what to do when the file
    cannot be opened.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as problem:
        role = f"{what} " if what else ""
        raise error(f"cannot read {role}{path}: {problem.strerror or problem}; {unreadable_hint}") from None
    return decode_user_text(path, data, error, advice)


def decode_user_text(path: str | Path, data: bytes, error: type[Exception] = UserError,
                     advice: str = SAVE_AS_UTF8) -> str:
    """The text of ``data`` read from ``path``: UTF-8 (a byte-order mark is skipped) or UTF-16 with a
    byte-order mark; anything else raises ``error`` naming the encoding found and ``advice``."""
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        raise error(f"{path}: the file is UTF-32 (it starts with a UTF-32 byte-order mark); {advice}")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            raise error(f"{path}: the file starts with a UTF-16 byte-order mark but is not valid UTF-16 "
                        f"(it may be cut short); {advice}") from None
    elif b"\x00" in data:
        # UTF-16 without a byte-order mark has a NUL byte next to every ASCII character.
        odd, even = data[1::2].count(0), data[0::2].count(0)
        if max(odd, even) >= len(data) // 4:
            endian = "little" if odd > even else "big"
            raise error(f"{path}: the file is UTF-16 ({endian}-endian, without a byte-order mark), not UTF-8; {advice}")
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise error(f"{path}:{line}: the file contains NUL bytes, so it is not a UTF-8 text file; {advice}")
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as problem:
            line = data.count(b"\n", 0, problem.start) + 1
            raise error(f"{path}:{line}: byte 0x{data[problem.start]:02x} (at byte offset {problem.start}) is not "
                        f"UTF-8; the file was probably saved in another encoding (e.g. Windows-1252); {advice}") from None
    if "\x00" in text:
        raise error(f"{path}: the file contains NUL characters, so it is not a text file; {advice}")
    return text


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A YAML mapping names one key twice; ``problem`` names the key and both lines."""


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, but a key written twice in one mapping raises :class:`DuplicateKeyError`.

    Keys merged in with ``<<: *anchor`` may be overridden, as YAML intends; only keys written twice are refused.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_unique_keys(loader, node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_unique_keys(loader: yaml.SafeLoader, node: yaml.Node, where: str, visited: set[int]) -> None:
    if id(node) in visited:  # an alias: checked where its anchor is
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(loader, item, f"{where}[{index}]", visited)
    elif isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            # a scalar key constructs to a hashable value; other keys are left to the constructor
            key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{where}.{key}" if where else str(key)
            first = seen.get(key) if key is not None else None
            if first is not None:
                line, again = first.start_mark.line + 1, key_node.start_mark.line + 1
                raise DuplicateKeyError(
                    problem=f"key {dotted!r} is written twice, at line {line} and at line {again}; YAML would keep "
                            "only the second and silently drop the first, so merge the two into one or delete one",
                    problem_mark=key_node.start_mark)
            if key is not None:
                seen[key] = key_node
            _check_unique_keys(loader, value_node, dotted, visited)
