"""The paths, names and addresses the flags give, checked before anything starts (issue 51).

Each check raises ``FlagError`` with one line naming the flag, the cause and the fix (node.cli and
node.join print it, exit code 2): a state directory that is a file, an output inside a file, an
identity key that is not one, a run id that would be a path, an address p2pd cannot parse. Without
them the same inputs failed later, as an exception's name, after p2pd had started or a whole local
swarm had trained (``swarm --export`` inside a file).
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from node.argv import FlagError

# a run id names directories (checkpoints/RUN_ID, the socket directory) and DHT keys
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run_id: str) -> None:
    if not _RUN_ID.match(run_id):
        raise FlagError(
            f"--run-id {run_id!r}: a run id names directories, so it is 1-128 letters, digits, '.', "
            "'_' or '-' (starting with a letter or digit); pick such a name"
        )


def _blocker(path: Path) -> tuple[Path, str] | None:
    """The first ancestor of ``path`` that is not a directory (a file), or the nearest existing
    ancestor when it cannot be written to: (that path, why); None when ``path`` can be created."""
    last = Path(path.absolute().anchor)
    for parent in reversed(path.absolute().parents):
        if not parent.exists():
            break
        if not parent.is_dir():
            return parent, "is a file, not a directory"
        last = parent
    if not path.exists() and not os.access(last, os.W_OK | os.X_OK):
        return last, "is not writable by this user"
    return None


def _shown(p: Path, given: str) -> str:
    """``p`` as the user would recognise it: relative to the working directory when ``given`` was."""
    if os.path.isabs(given):
        return str(p)
    try:
        return os.path.relpath(p)
    except ValueError:
        return str(p)


def check_new_dir(flag: str, path: str, *, may_exist: bool, force: bool = False) -> None:
    """``path``: a directory this command creates (``export --out``, ``swarm --export/--report``).

    ``may_exist``: an existing directory is written into (a report); otherwise it is refused unless
    ``force`` (then replaced). A file in its place, a file among its parents, or a parent this user
    cannot write is refused."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise FlagError(f"{flag} {path} is a file, not a directory; pass a new directory path")
        if not may_exist and not force:
            raise FlagError(f"{flag} {path} already exists; pass a new path, or --force to replace it")
        if not os.access(p, os.W_OK | os.X_OK):
            raise FlagError(f"{flag} {path} is not writable by this user; pass a directory you can write")
        return
    bad = _blocker(p)
    if bad:
        raise FlagError(
            f"{flag} {path}: {_shown(bad[0], path)} {bad[1]}; pass a path in a directory you can write"
        )


def check_new_file(flag: str, path: str, *, may_exist: bool, make_parents: bool = False) -> None:
    """``path``: a file this command writes; its directory must exist unless ``make_parents`` (the
    writer creates it)."""
    p = Path(path)
    if p.is_dir():
        raise FlagError(f"{flag} {path} is a directory; pass a file path")
    if p.exists():
        if not may_exist:
            raise FlagError(f"{flag} {path} already exists; pass a new path (it is never overwritten)")
        if not os.access(p, os.W_OK):
            raise FlagError(f"{flag} {path} is not writable by this user; pass a file you can write")
        return
    bad = _blocker(p)
    if bad:
        raise FlagError(
            f"{flag} {path}: {_shown(bad[0], path)} {bad[1]}; pass a path in a directory you can write"
        )
    parent = p.absolute().parent
    if not make_parents and not parent.is_dir():
        raise FlagError(
            f"{flag} {path}: directory {_shown(parent, path)} does not exist; create it, or pass a path "
            "in an existing directory"
        )


def check_state_dir(path: str) -> None:
    """The node's state directory (identity key, checkpoints, health file): made here if missing."""
    p = Path(path)
    fix = "pass --state-dir DIR (or set $NODE_STATE_DIR) naming a directory you can write"
    if p.exists() and not p.is_dir():
        raise FlagError(f"--state-dir {path} is a file, not a directory; {fix}")
    bad = _blocker(p)
    if bad:
        raise FlagError(f"--state-dir {path}: {_shown(bad[0], path)} {bad[1]}; {fix}")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlagError(f"--state-dir {path} cannot be created ({e.strerror or e}); {fix}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise FlagError(f"--state-dir {path} is not writable by this user; {fix}")


def check_identity(identity: str | None, state_dir: str) -> None:
    """``--identity`` (or STATE_DIR/identity.key): a libp2p private key file, or a path to make one.

    p2pd refuses a file it cannot parse with "proto: cannot parse invalid wire-format data"."""
    path = identity or os.path.join(state_dir, "identity.key")
    flag = f"--identity {path}" if identity else f"identity key {path} (in --state-dir)"
    p = Path(path)
    if not p.exists():
        # node.swarm.membership.start_dht makes its directory, p2pd the key
        check_new_file("--identity" if identity else "--state-dir", path, may_exist=False, make_parents=True)
        return
    if not p.is_file():
        fix = "pass the key file a node wrote, or a new path to make one" if identity else "remove it"
        raise FlagError(f"{flag} is not a file; {fix}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FlagError(f"{flag} cannot be read ({e.strerror or e}); fix its permissions") from None
    from hivemind.proto import crypto_pb2

    try:
        key = crypto_pb2.PrivateKey.FromString(data)
        ok = bool(key.data)
    except Exception:  # protobuf's DecodeError, whatever the file holds
        ok = False
    if not ok:
        fix = "pass the key file a node wrote" if identity else "delete it to make a new peer id"
        raise FlagError(f"{flag} is not a libp2p private key (it cannot be parsed); {fix}")


def check_ip(flag: str, host: str, *, v4_only: bool) -> None:
    """A listen address: an IP literal (p2pd listens on /ip4/HOST; the dashboard also takes a name)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        # a host name is fine for the dashboard; something shaped like an IP that is not one is not
        if v4_only or re.fullmatch(r"[0-9.]+|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*", host):
            raise FlagError(
                f"{flag} {host!r} is not an {'IPv4' if v4_only else 'IP'} address; pass e.g. 127.0.0.1 "
                "(this machine only) or 0.0.0.0 (every interface)"
            ) from None
        return
    if v4_only and addr.version != 4:
        raise FlagError(f"{flag} {host!r}: p2pd listens on IPv4 here; pass e.g. 127.0.0.1 or 0.0.0.0")


def check_announce(maddrs: list[str]) -> None:
    from hivemind.utils.multiaddr import Multiaddr

    for m in maddrs:
        try:
            Multiaddr(m)
        except Exception as e:
            why = (str(e).splitlines() or [""])[0]
            raise FlagError(
                f"--announce-maddr {m!r} is not a multiaddr ({why}); expected /ip4/PUBLIC_IP/tcp/PORT"
            ) from None
