"""The files of a private swarm: the swarm token and the allow-list (see :mod:`geotrain.hive.dht.admission`).

Kept apart from hivemind, so that the commands read and check both before anything starts
(:func:`check_admission_files`, called where the config is loaded): a wrong file is exit code 2 at once,
not after the model was built and the DHT started.
"""

from __future__ import annotations

import os

from geotrain.config import SwarmConfig
from geotrain.hive.dht.multiaddrs import peer_id_problem
from geotrain.errors import UserError
from geotrain.text_files import read_user_text

TOKEN_ENVIRONMENT_VARIABLE = "GEOTRAIN_SWARM_TOKEN"
MIN_TOKEN_CHARACTERS = 16


class AdmissionConfigError(UserError):
    """The swarm token or the allow-list cannot be read."""


def load_swarm_token(swarm: SwarmConfig) -> bytes | None:
    """The swarm's token: ``GEOTRAIN_SWARM_TOKEN`` if set, else the contents of ``swarm.token_file``."""
    text = os.environ.get(TOKEN_ENVIRONMENT_VARIABLE)
    where = TOKEN_ENVIRONMENT_VARIABLE
    if text is None and swarm.token_file is not None:
        where = str(swarm.token_file)
        text = read_user_text(swarm.token_file, "the swarm token file", AdmissionConfigError)
    if text is None:
        return None
    token = text.strip()
    if len(token) < MIN_TOKEN_CHARACTERS:
        raise AdmissionConfigError(
            f"the swarm token in {where} has {len(token)} characters; use at least {MIN_TOKEN_CHARACTERS} random "
            "ones, e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > swarm.token`")
    return token.encode()


def load_allowed_peer_ids(swarm: SwarmConfig) -> frozenset[str] | None:
    """The admitted peer ids (``swarm.allow`` plus ``swarm.allow_file``); None: every peer."""
    allowed = set(swarm.allow)
    if swarm.allow_file is not None:
        lines = read_user_text(swarm.allow_file, "the allow file", AdmissionConfigError).splitlines()
        for number, line in enumerate(lines, start=1):
            peer_id = line.split("#", 1)[0].strip()
            if not peer_id:
                continue
            problem = peer_id_problem(peer_id)
            if problem is not None:
                raise AdmissionConfigError(f"{swarm.allow_file}:{number}: {peer_id!r} is not a peer id ({problem}); "
                                           "`geotrain identity FILE` prints a peer's id")
            allowed.add(peer_id)
        if not allowed:
            raise AdmissionConfigError(f"the allow file {swarm.allow_file} lists no peer id; it would admit nobody")
    return frozenset(allowed) if allowed else None


def check_admission_files(swarm: SwarmConfig) -> None:
    """Read the token and the allow-list once, so that a wrong one stops the command before it starts."""
    load_swarm_token(swarm)
    load_allowed_peer_ids(swarm)
