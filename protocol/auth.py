"""Optional swarm key: only nodes holding a shared secret get their frames accepted.

Threat model
------------
What it protects: with ``--swarm-key FILE`` every frame a node sends on its stream handlers
(forward, backward and error replies, weights, anchor packets, bases — every handler that
does not go through the DHT) is wrapped by ``sign``; the receiver calls ``verify`` on the raw
bytes *before* ``decode_frame``, so a node without the key cannot get a single frame
accepted, cannot make the receiver parse msgpack or allocate tensors, and cannot replay a
key holder's frame outside a short time window (or at all, with a ``ReplayGuard``). Each
frame carries ``magic | timestamp | nonce | HMAC-SHA256 tag`` (60 bytes); the tag covers the
header and the whole frame, so a flipped bit anywhere, a truncated tag, another key or a
stale timestamp is ``Unauthorized`` (code ``"unauthorized"``).

What it does not protect:

* A key holder is trusted to speak the protocol, not to be honest: it can still send wrong
  activations or poisoned gradients within the frame limits (the frame validation, NaN
  checks, clipping and bans are the defence there, not the key).
* The DHT itself stays open: hivemind's DHT has no notion of this key, so a stranger can
  still join the DHT, read run and stage records and publish records of its own. Records
  are schema-validated, and a stranger routed to by a poisoned stage record cannot answer
  with a frame that verifies, so the hop fails and routing drops it; but it can waste hops
  and read who is in the swarm.
* Confidentiality and peer authentication on the wire are libp2p's job: streams are already
  encrypted and bound to peer ids by TLS/Noise. The key adds swarm *membership*, not secrecy.
* A leaked key admits its holder until every node switches to a new key (there is no
  revocation); keep the file ``chmod 600`` and rotate it by restarting the swarm.
* Timestamps assume clocks within ``max_skew_s`` (default 120 s) of each other (NTP).

Key files hold at least 32 random bytes, raw or hex; ``make_swarm_key`` creates one (0600).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict

from protocol.frames import FrameError

MAGIC = b"VSK1"
KEY_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32
HEADER_BYTES = len(MAGIC) + 8 + NONCE_BYTES + TAG_BYTES  # what ``sign`` adds to a frame: 60 bytes
DEFAULT_MAX_SKEW_S = 120.0
_MAX_KEY_FILE = 4096
_DOMAIN = b"vnode/frame-auth/v1"


class Unauthorized(FrameError):
    """A frame did not carry a valid tag of this swarm's key (or was stale or replayed)."""

    code = "unauthorized"


class SwarmKeyError(ValueError):
    """The swarm key file is missing, unsafe or malformed (one line, with the fix)."""


# ---------------------------------------------------------------------- key files


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """Read a swarm key file: >= 32 bytes, raw or hex. Refuses files group/others can access."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SwarmKeyError(
            f"swarm key file {path} does not exist; create one with "
            f"`(umask 077; head -c 32 /dev/urandom | xxd -p -c 64 > {path})` and copy it to every node"
        ) from None
    except OSError as e:
        raise SwarmKeyError(f"cannot read swarm key file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SwarmKeyError(f"swarm key file {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SwarmKeyError(
            f"swarm key file {path} is accessible by group/others (mode {mode:04o}); run `chmod 600 {path}`"
        )
    if st.st_size > _MAX_KEY_FILE:
        raise SwarmKeyError(f"swarm key file {path} is {st.st_size} bytes; expected a short random key")
    with open(path, "rb") as f:
        raw = f.read(_MAX_KEY_FILE + 1)
    key = _parse_key(raw)
    if len(key) < KEY_BYTES:
        raise SwarmKeyError(
            f"swarm key file {path} holds {len(key)} bytes; at least {KEY_BYTES} random bytes are needed"
        )
    return key


def _parse_key(raw: bytes) -> bytes:
    text = raw.strip()
    if text and len(text) % 2 == 0 and all(c in b"0123456789abcdefABCDEF" for c in text):
        return bytes.fromhex(text.decode())
    return raw


def make_swarm_key(path: str | os.PathLike) -> bytes:
    """Create a new key file (32 random bytes as hex, mode 0600); never overwrites one."""
    path = os.fspath(path)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{path} already exists; refusing to overwrite a swarm key") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def key_id(key: bytes) -> str:
    """A short public fingerprint of a key, safe to log, to tell two keys apart."""
    return hashlib.sha256(b"vnode/key-id/v1" + key).hexdigest()[:12]


# ---------------------------------------------------------------------- frames


def _frame_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < KEY_BYTES:
        raise ValueError(f"a swarm key has at least {KEY_BYTES} bytes")
    return hmac.new(bytes(key), _DOMAIN, hashlib.sha256).digest()


def sign(key: bytes, data: bytes, *, now: float | None = None) -> bytes:
    """``MAGIC | ts_ms (8, big-endian) | nonce (16) | HMAC-SHA256 tag (32) | data``."""
    ts = int((time.time() if now is None else now) * 1000)
    header = MAGIC + ts.to_bytes(8, "big") + secrets.token_bytes(NONCE_BYTES)
    tag = hmac.new(_frame_key(key), header + data, hashlib.sha256).digest()
    return header + tag + bytes(data)


def verify(
    key: bytes,
    signed: bytes,
    *,
    now: float | None = None,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
    replay: ReplayGuard | None = None,
) -> bytes:
    """Check the tag and timestamp and return the frame bytes; raise ``Unauthorized`` otherwise.

    Constant-time tag comparison; the tag is checked before the replay guard sees the nonce,
    so bytes from a stranger cannot fill the guard.
    """
    view = memoryview(signed)
    if len(view) < HEADER_BYTES:
        raise Unauthorized("frame is not signed with the swarm key (too short for a tag)")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise Unauthorized("frame is not signed with the swarm key; does the sender have --swarm-key?")
    head = bytes(view[: HEADER_BYTES - TAG_BYTES])
    tag = bytes(view[HEADER_BYTES - TAG_BYTES : HEADER_BYTES])
    mac = hmac.new(_frame_key(key), head, hashlib.sha256)
    mac.update(view[HEADER_BYTES:])
    if not hmac.compare_digest(mac.digest(), tag):
        raise Unauthorized("frame tag does not verify with this swarm's key")
    ts_ms = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 8], "big")
    skew = ts_ms / 1000 - (time.time() if now is None else now)
    if abs(skew) > max_skew_s:
        raise Unauthorized(
            f"frame timestamp is {skew:+.0f}s from this node's clock (window {max_skew_s:.0f}s); "
            "a replay, or a clock to fix with NTP"
        )
    if replay is not None:
        replay.check(head[len(MAGIC) + 8 :], ts_ms, int((time.time() if now is None else now) * 1000))
    return bytes(view[HEADER_BYTES:])


class ReplayGuard:
    """Remembers the nonces of verified frames; a nonce seen twice is a replay.

    Bounded: when ``max_entries`` is reached the oldest nonce is forgotten and frames whose
    timestamp is not newer than it are refused from then on, so forgetting never lets an
    old frame through. Entries older than the skew window expire (they are refused anyway).
    Thread-safe.
    """

    def __init__(self, max_skew_s: float = DEFAULT_MAX_SKEW_S, max_entries: int = 100_000):
        self.window_ms = int(max_skew_s * 1000)
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._floor_ms = -1
        self._lock = threading.Lock()

    def check(self, nonce: bytes, ts_ms: int, now_ms: int | None = None) -> None:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        with self._lock:
            if ts_ms <= self._floor_ms:
                raise Unauthorized("frame is older than the replay window this node still tracks")
            if nonce in self._seen:
                raise Unauthorized("replayed frame (nonce seen before)")
            self._seen[nonce] = ts_ms
            while self._seen:
                oldest_nonce, oldest_ts = next(iter(self._seen.items()))
                if len(self._seen) > self.max_entries:
                    self._floor_ms = max(self._floor_ms, oldest_ts)
                elif oldest_ts >= now_ms - self.window_ms:
                    break  # still inside the window (older ones are refused by the timestamp check)
                del self._seen[oldest_nonce]

    def __len__(self) -> int:
        return len(self._seen)
