"""Private swarms: who may talk to this peer's DHT, join its averaging groups and download its state.

Two mechanisms, each optional (docs/security.md says what each protects):

- **The swarm token** (``swarm.token_file`` or ``GEOTRAIN_SWARM_TOKEN``): a shared secret. Every DHT
  request and answer carries an HMAC-SHA256 of its bytes under a key derived from the token, a time and a
  nonce (:class:`SwarmTokenAuthorizer`, plugged into hivemind's DHT as its ``authorizer``), so a peer
  without the token gets no DHT answers and cannot store records. Each peer also stores a *membership
  proof* (an HMAC of its own libp2p peer id) under ``{run_id}_members``; averagers, which see the
  libp2p-authenticated id of whoever calls them, admit only peer ids with a valid proof.
- **The allow-list** (``swarm.allow`` / ``swarm.allow_file``): libp2p peer ids (``geotrain identity``
  prints one); averagers admit only these.

Open swarms (neither set) stay the default.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time

from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

# the token and the allow-list are read without hivemind (checked before a command starts); re-exported here
from geotrain.hive.dht.admission_files import (MIN_TOKEN_CHARACTERS, TOKEN_ENVIRONMENT_VARIABLE,  # noqa: F401
                                               AdmissionConfigError, load_allowed_peer_ids, load_swarm_token)

logger = logging.getLogger(__name__)

MAX_CLOCK_SKEW_S = 60.0  # a request older or newer than this is refused (replays, wrong clocks)
MEMBERSHIP_TTL_S = 600.0  # membership proofs are re-stored every third of this
MAX_REMEMBERED_NONCES = 200_000  # replay protection's memory bound (about 20 MB at most)


def members_key(run_id: str) -> str:
    return f"{run_id}_members"


def _derive(token: bytes, purpose: bytes) -> bytes:
    return hmac.new(token, b"geotrain/" + purpose, hashlib.sha256).digest()


class SwarmTokenAuthorizer(AuthorizerBase):
    """hivemind DHT authorizer: requests and answers carry an HMAC under the swarm token.

    The MAC covers the whole serialized message (with its time and a random nonce); a servicer refuses a
    request with a wrong MAC, a time more than :data:`MAX_CLOCK_SKEW_S` away, or a nonce it has seen;
    a client refuses an answer with a wrong MAC or another request's nonce.
    """

    def __init__(self, token: bytes):
        self._key = _derive(token, b"dht")
        self._nonces: dict[bytes, float] = {}  # nonce -> time it may be forgotten
        self._refusals_logged_at = 0.0

    def __getstate__(self):  # the DHT runs in a process of its own
        return {"_key": self._key}

    def __setstate__(self, state):
        self._key = state["_key"]
        self._nonces = {}
        self._refusals_logged_at = 0.0

    def _mac(self, message) -> bytes:
        return hmac.new(self._key, message.SerializeToString(deterministic=True), hashlib.sha256).digest()

    def _refused(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._refusals_logged_at > 60.0:  # operators need to know, once a minute is enough
            self._refusals_logged_at = now
            logger.warning("refused a DHT %s without this swarm's token (a peer outside the private swarm, or a "
                           "peer with another token)", what)
        return False

    async def sign_request(self, request, service_public_key) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._mac(request)

    async def validate_request(self, request) -> bool:
        auth = request.auth
        signature = auth.signature
        auth.signature = b""
        valid = hmac.compare_digest(signature, self._mac(request))
        auth.signature = signature
        if not valid:
            return self._refused("request")
        now = get_dht_time()
        if abs(auth.time - now) > MAX_CLOCK_SKEW_S:
            return self._refused("request (its time is over a minute off: a replay, or a clock that is wrong)")
        if auth.nonce in self._nonces:
            return self._refused("request (replayed)")
        self._remember(auth.nonce, now)
        return True

    def _remember(self, nonce: bytes, now: float) -> None:
        if len(self._nonces) >= MAX_REMEMBERED_NONCES:
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
            while len(self._nonces) >= MAX_REMEMBERED_NONCES:  # a flood within the window: forget the oldest
                self._nonces.pop(next(iter(self._nonces)))
        self._nonces[nonce] = now + 2 * MAX_CLOCK_SKEW_S

    async def sign_response(self, response, request) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(response)

    async def validate_response(self, response, request) -> bool:
        auth = response.auth
        signature = auth.signature
        auth.signature = b""
        valid = hmac.compare_digest(signature, self._mac(response)) and auth.nonce == request.auth.nonce
        auth.signature = signature
        return valid or self._refused("answer")


class Admission:
    """Who this peer's averagers serve: the allow-list, and peers with a valid membership proof.

    Picklable: hivemind's averagers run in processes of their own and check callers there.
    """

    PROOF_CACHE_S = 60.0

    def __init__(self, run_id: str, token: bytes | None, allowed: frozenset[str] | None):
        self.run_id = run_id
        self._proof_key = None if token is None else _derive(token, b"member/" + run_id.encode())
        self.allowed = allowed
        self._admitted_until: dict[str, float] = {}

    @property
    def is_open(self) -> bool:
        return self._proof_key is None and self.allowed is None

    def proof(self, peer_id_bytes: bytes) -> bytes:
        return hmac.new(self._proof_key, peer_id_bytes, hashlib.sha256).digest()

    async def admits(self, peer_id, dht) -> bool:
        """Whether ``peer_id`` (a hivemind PeerID, authenticated by libp2p) may average with us or download state."""
        if self.allowed is not None and peer_id.to_base58() not in self.allowed:
            return False
        if self._proof_key is None:
            return True
        name = peer_id.to_base58()
        now = time.monotonic()
        if self._admitted_until.get(name, 0.0) > now:
            return True
        record = await dht.get(members_key(self.run_id), latest=True, return_future=True)
        entry = record.value.get(name) if record is not None and isinstance(record.value, dict) else None
        value = getattr(entry, "value", None)
        if isinstance(value, bytes) and hmac.compare_digest(value, self.proof(peer_id.to_bytes())):
            if len(self._admitted_until) > 10_000:
                self._admitted_until.clear()
            self._admitted_until[name] = now + self.PROOF_CACHE_S
            return True
        return False


class MembershipAnnouncer(threading.Thread):
    """Stores this peer's membership proof in the DHT, and again every third of its lifetime."""

    def __init__(self, dht, admission: Admission):
        super().__init__(name="membership", daemon=True)
        self.dht = dht
        self.admission = admission
        self.peer_id = dht.peer_id
        self._stop_event = threading.Event()
        self.interval_s = MEMBERSHIP_TTL_S / 3

    def announce(self) -> bool:
        return bool(self.dht.store(members_key(self.admission.run_id), subkey=self.peer_id.to_base58(),
                                   value=self.admission.proof(self.peer_id.to_bytes()),
                                   expiration_time=get_dht_time() + MEMBERSHIP_TTL_S))

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self.announce()
            except Exception as error:  # the DHT is shutting down with the peer
                logger.debug("membership proof not stored: %s", error)
                return

    def stop(self) -> None:
        self._stop_event.set()
