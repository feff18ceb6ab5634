"""Transport security for the ZeroMQ links between the engine's processes.

Two transports (``launch.py --transport``):

* ``ipc`` (default): every socket is a file in the launcher's private runtime
  directory (mode 0700). Only the user who started the engine (and root) can
  open, hence connect to, those sockets, so no extra authentication is used.
  ipc works on one host only.
* ``tcp``: endpoints are ``tcp://HOST:PORT``. Anyone who can reach a port could
  push messages into a worker, so CURVE is on by default: the launcher makes
  one keypair per process (the router and every worker), writes the public
  keys into the engine config and each secret key into its own file (mode
  0600) in the runtime directory. Every binding (PULL) socket is a CURVE
  server whose ZAP handler accepts exactly the engine's own public keys;
  every connecting (PUSH) socket is a CURVE client with its process's
  keypair and the server's public key, looked up in the config by endpoint.
  A peer without CURVE fails the handshake; a peer with any other key is
  refused by the ZAP handler (and logged). Messages are also encrypted.
  ``--no-curve`` turns this off: only for loopback, never across machines.

Each process loads one :class:`Security` (``Security.load(config, name)``) and
creates its sockets with :func:`bind_pull` and :func:`connect_push`.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.config.engine import EngineConfig

log = logging.getLogger("disagg.security")

ROUTER = "router"
ZAP_DOMAIN = "disagg"
KEY_DIR = "curve"  # inside the runtime dir
SECRET_SUFFIX = ".key_secret"


class SecurityError(RuntimeError):
    """Transport security is misconfigured; the process must not start its sockets."""


def process_name(role: str, index: int) -> str:
    """The name a process's CURVE keys are filed under: ``"router"`` or ``"<role>-<index>"``."""
    return f"{role}-{index}"


# --------------------------------------------------------------------------
# Key files (launcher side)
# --------------------------------------------------------------------------


def _write_secret_file(path: Path, public: bytes, secret: bytes) -> None:
    """A zmq certificate file (readable by ``zmq.auth.load_certificate``), created 0600."""
    text = (
        "#   disagg-diffusion CURVE secret key: valid for one engine run only.\n"
        "#   Do not copy this file or change its permissions.\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{public.decode("ascii")}"\n'
        f'    secret-key = "{secret.decode("ascii")}"\n'
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


def key_dir(config: EngineConfig) -> Path:
    return Path(config.runtime_dir) / KEY_DIR


def provision_curve(config: EngineConfig) -> EngineConfig:
    """Make one CURVE keypair per process; return ``config`` with the public keys and secret-file paths.

    Secret keys go to ``<runtime>/curve/<name>.key_secret`` (directory 0700,
    files 0600); only their paths enter the config. Keys from an earlier run
    in the same runtime directory are discarded.
    """
    if config.transport != "tcp":
        raise SecurityError(f"CURVE is for tcp topologies, not {config.transport!r}")
    directory = fresh_key_dir(key_dir(config))
    names = [ROUTER, *(process_name(w.role, w.index) for w in config.workers)]
    public: dict[str, str] = {}
    files: dict[str, str] = {}
    for name in names:
        public[name], files[name] = new_key_pair(directory, name)
    return msgspec.structs.replace(config, curve_public=public, curve_secret_files=files)


def fresh_key_dir(directory: Path) -> Path:
    """An empty 0700 directory for secret key files (keys of an earlier run there are discarded)."""
    if not zmq.has("curve"):
        raise SecurityError("this libzmq has no CURVE support; use --no-curve on loopback only, or --transport ipc")
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    return directory


def new_key_pair(directory: Path, name: str) -> tuple[str, str]:
    """A fresh key pair for process ``name``: the secret goes into a 0600 file in ``directory``; returns
    (z85 public key, the file's path). Where the process runs elsewhere (``launch.py --ray``), its own
    node calls this, so the secret never leaves that node."""
    pub, sec = zmq.curve_keypair()
    path = directory / f"{name}{SECRET_SUFFIX}"
    _write_secret_file(path, pub, sec)
    return pub.decode("ascii"), str(path)


def remove_secrets(config: EngineConfig) -> None:
    """Delete the run's secret key files (the launcher calls this at exit)."""
    if config.curve_secret_files:
        shutil.rmtree(key_dir(config), ignore_errors=True)


def load_secret_file(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a key file written by :func:`provision_curve`; refuses loose permissions."""
    path = Path(path)
    try:
        st = path.lstat()
    except OSError as e:
        raise SecurityError(f"cannot read CURVE secret key file {path}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecurityError(f"CURVE secret key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise SecurityError(f"CURVE secret key file {path} is accessible by other users (mode {st.st_mode & 0o777:o})")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise SecurityError(f"CURVE secret key file {path} belongs to another user")
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise SecurityError(f"{path} holds no secret key")
    return public, secret


# --------------------------------------------------------------------------
# Per-process view
# --------------------------------------------------------------------------


class _AllowList:
    """ZAP credentials provider: accepts exactly the engine's own public keys."""

    def __init__(self, keys: set[bytes], owner: str):
        self.keys = frozenset(keys)
        self.owner = owner
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        if self.refused <= 20 or self.refused % 1000 == 0:  # a flood must not flood the log
            log.warning("CURVE: %s refused a connection from unknown client key %s (refusal #%d)",
                        self.owner, key.decode("ascii", "replace"), self.refused)
        return False


class _Authenticator(ThreadAuthenticator):
    def curve_user_id(self, client_public_key: bytes) -> str:
        # No ZAP user id. With one, libzmq queues a "credential" item ahead of the peer's first
        # message, visible before a large multipart message has fully arrived: the socket polls
        # readable with no message there, and zmq.asyncio's recv then fails with EAGAIN (the
        # router's receive loop would die). Nothing here uses the user id.
        return ""


class Security:
    """One process's transport security: its own keypair, every public key, the ZAP handler(s)."""

    def __init__(self, name: str, endpoints: dict[str, str], public: dict[str, bytes],
                 keypair: tuple[bytes, bytes] | None):
        self.name = name
        self.endpoints = endpoints  # endpoint -> name of the process that binds it
        self.public = public  # name -> z85 public key; empty: CURVE off
        self.keypair = keypair  # (public, secret); None without CURVE
        self._auth: list[ThreadAuthenticator] = []
        self._auth_ctx: set[int] = set()
        self._allow: list[_AllowList] = []

    @classmethod
    def load(cls, config: EngineConfig, name: str) -> "Security":
        """The security of process ``name`` (``"router"`` or ``"<role>-<index>"``) in ``config``."""
        endpoints = {config.router_endpoint: ROUTER}
        endpoints.update({w.endpoint: process_name(w.role, w.index) for w in config.workers})
        if not config.curve_public:
            return cls(name, endpoints, {}, None)
        if config.transport != "tcp":
            raise SecurityError(f"CURVE keys in a {config.transport!r} topology; CURVE is for tcp")
        public = {n: k.encode("ascii") for n, k in config.curve_public.items()}
        missing = sorted(set(endpoints.values()) - set(public))
        if missing:
            raise SecurityError(f"no CURVE public key for {', '.join(missing)}")
        path = config.curve_secret_files.get(name)
        if not path:
            raise SecurityError(f"no CURVE secret key file for {name}")
        own_public, secret = load_secret_file(path)
        if own_public != public[name]:
            raise SecurityError(f"{path} does not hold the key pair of {name} named in the engine config")
        return cls(name, endpoints, public, (own_public, secret))

    @property
    def curve(self) -> bool:
        return bool(self.public)

    def server_key(self, endpoint: str) -> bytes:
        owner = self.endpoints.get(endpoint)
        if owner is None:
            raise SecurityError(f"{endpoint} is not an endpoint of this engine's topology")
        return self.public[owner]

    def ensure_authenticator(self, ctx: zmq.Context) -> None:
        """One ZAP handler per context (ZAP is per context), started before any server socket binds."""
        if id(ctx) in self._auth_ctx:
            return
        auth = _Authenticator(ctx, log=logging.getLogger("disagg.security.zap"))
        auth.start()
        allow = _AllowList(set(self.public.values()), self.name)
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allow)
        self._allow.append(allow)
        self._auth.append(auth)
        self._auth_ctx.add(id(ctx))

    def move(self, name: str, endpoint: str, public_key: str) -> None:
        """Process ``name`` now binds ``endpoint`` with ``public_key`` (a worker replaced on another node):
        connect to it there, and admit that key instead of its old one."""
        self.endpoints = {e: n for e, n in self.endpoints.items() if n != name}
        self.endpoints[endpoint] = name
        if self.curve:
            self.public[name] = public_key.encode("ascii")
            for allow in self._allow:
                allow.keys = frozenset(self.public.values())  # one assignment: the ZAP thread sees old or new

    def close(self) -> None:
        """Stop the ZAP handler(s); call before terminating the context."""
        for auth in self._auth:
            auth.stop()
        self._auth.clear()
        self._auth_ctx.clear()


def _apply(sock: zmq.Socket, options: dict) -> None:
    for name, value in options.items():
        setattr(sock, name, value)


def bind_pull(ctx: zmq.Context, endpoint: str, security: Security, **options) -> zmq.Socket:
    """A PULL socket bound at ``endpoint``; with CURVE a server that only admits the engine's own keys.

    ``options`` are socket options by pyzmq attribute name (``linger=0``).
    Works with ``zmq.Context`` and ``zmq.asyncio.Context`` alike.
    """
    sock = ctx.socket(zmq.PULL)
    try:
        _apply(sock, {"linger": 0, **options})
        if security.curve:
            security.ensure_authenticator(ctx)
            public, secret = security.keypair
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
            try:  # fail closed should the ZAP handler ever be missing (libzmq >= 4.3, draft option)
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            except (AttributeError, zmq.ZMQError):
                pass
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def connect_push(ctx: zmq.Context, endpoint: str, security: Security, **options) -> zmq.Socket:
    """A PUSH socket connected to ``endpoint``; with CURVE a client with this process's keypair.

    The server's public key is looked up by endpoint in the engine's own
    topology, so a socket can only ever authenticate to the engine's processes.
    """
    sock = ctx.socket(zmq.PUSH)
    try:
        _apply(sock, {"linger": 0, **options})
        if security.curve:
            public, secret = security.keypair
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_serverkey = security.server_key(endpoint)
        sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
