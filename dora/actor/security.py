"""CURVE encryption and authentication on every connection, with an allow-list of keys and one role per key.

``dora keys generate DIR`` writes a keypair for the broker and one for each role (``rollout``,
``learner``, ``client`` for `dora status`): ``<name>.key`` (public) and ``<name>.key_secret``. Every
process of a run gets ``security.keys = DIR``. The broker then serves CURVE only, and a ZAP handler
lets in exactly the public keys found in DIR as ``<role>*.key``; more keys per role may be added as
``rollout-node7.key`` and so on. A key may only act as its role: a rollout key that says hello as the
learner is rejected. Clients need their own ``<role>.key_secret`` and ``broker.key``, not the broker's
secret.

A CURVE handshake that fails is silent in ZeroMQ (the connection just never comes up), so clients
put a deadline on their first answer from the broker and then stop with an error that names the
likely cause.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
import zmq.auth

if TYPE_CHECKING:
    from dora.config.run import RunConfig

ROLES = ("rollout", "learner", "client")


def generate(directory: str | pathlib.Path) -> list[pathlib.Path]:
    """Write the broker's keypair and one per role into ``directory``; returns the public key files."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    made = []
    for name in ("broker", *ROLES):
        if (directory / f"{name}.key_secret").exists():
            raise FileExistsError(f"{directory / name}.key_secret exists; not overwriting keys")
        public, secret = zmq.auth.create_certificates(directory, name)
        pathlib.Path(secret).chmod(0o600)
        made.append(pathlib.Path(public))
    return made


@dataclass(frozen=True, slots=True)
class Keys:
    directory: pathlib.Path
    broker_public: bytes
    roles: dict[bytes, str]
    """Allowed client public keys (z85) and the role each may take."""

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> Keys:
        directory = pathlib.Path(directory)
        if not (directory / "broker.key").is_file():
            raise ValueError(f"security.keys: no broker.key in {directory} (make one with `dora keys generate DIR`)")
        broker_public, _ = zmq.auth.load_certificate(directory / "broker.key")
        roles: dict[bytes, str] = {}
        for role in ROLES:
            for path in sorted(directory.glob(f"{role}*.key")):
                public, _ = zmq.auth.load_certificate(path)
                if roles.setdefault(public, role) != role:
                    raise ValueError(f"security.keys: {path.name} holds a key that is also a {roles[public]} key")
        return cls(directory=directory, broker_public=broker_public, roles=roles)

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server with the broker's keypair (before it binds)."""
        public, secret = zmq.auth.load_certificate(self.directory / "broker.key_secret")
        if secret is None:
            raise ValueError(f"security.keys: {self.directory}/broker.key_secret holds no secret key")
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    def secret_file(self, role: str) -> pathlib.Path:
        path = self.directory / f"{role}.key_secret"
        if not path.is_file():
            raise ValueError(f"security.keys: no {role}.key_secret in {self.directory}")
        return path

    def connect_as(self, sock: zmq.Socket, role: str) -> None:
        """Make ``sock`` a CURVE client with this role's keypair (before it connects)."""
        public, secret = zmq.auth.load_certificate(self.secret_file(role))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, self.broker_public

    def role_of(self, user_id: str | None) -> str | None:
        """The role of an authenticated peer, from the User-Id ZAP gave its messages (its z85 public key)."""
        return None if user_id is None else self.roles.get(user_id.encode())

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: let in the allowed keys only (``key`` is the z85 public key)."""
        return key in self.roles


def check_keys(cfg: RunConfig, role: str = "rollout") -> None:
    """A ConfigError now, at startup, for a keys directory this process cannot use."""
    from dora.config import ConfigError

    if cfg.security.keys:
        try:
            Keys.load(cfg.security.keys).secret_file(role)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None


HINT = ("if security.keys is set, check that the broker's broker.key is the one in your keys directory and "
        "that this process's public key is in the broker's allow-list")  # fmt: skip
