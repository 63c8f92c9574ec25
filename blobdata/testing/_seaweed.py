"""SeaweedFS (``weed server -s3``) as :class:`~blobdata.testing.LocalS3Server` runs it: private to the user
who started it, and leaving nothing behind.

Every port listens on 127.0.0.1, where any user of the machine can reach it, so each door is shut or
locked with what only this run knows (all of it in the server's 0700 temporary directory, made anew
for each start):

* S3: the keys given (``blobdata serve`` makes random ones for each run);
* the filer's and the master's HTTP APIs are off (``-filer.disableHttp``, ``-disableHttp``: the master
  answers only its status page); the volume server's HTTP needs a JWT signed with random keys
  (``security.toml``'s ``jwt.signing``, read and write);
* every gRPC port (master, volume, filer, S3) takes only mutual TLS with a certificate of a CA made
  for this run (``security.toml``'s ``grpc`` sections), so SeaweedFS's own clients (``weed shell``)
  cannot connect without its key.

And nothing stays: glog writes to the server's log (``-logtostderr``) instead of ``weed.*`` files in
``$TMPDIR``; the gRPC unix sockets SeaweedFS makes in ``/tmp`` (``seaweedfs-<part>-grpc-<port>.sock``,
a fixed place) are removed when the server stops, and those of a server that was killed (nothing
listens on them any more) when the next one starts.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import json
import os
import secrets
import socket
import stat
from pathlib import Path

__all__ = ["command", "grpc_sockets", "remove_sockets", "sweep_sockets"]

#: The parts of ``weed server`` that make a gRPC unix socket in /tmp, in the order of their ports below.
_PARTS = ("master", "volume", "filer", "s3")
_SOCKETS = Path("/tmp")
_NAME = "blobdata-weed"


def _pem_files(tmpdir: Path) -> dict[str, Path]:
    """A CA and one certificate (server and client) it signed, for 127.0.0.1, valid for 30 days; the
    private keys written 0600. Returns the paths of ``ca``, ``cert`` and ``key``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=30))
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{_NAME} CA")])
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _NAME)])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = {"ca": tmpdir / "ca.pem", "cert": tmpdir / "cert.pem", "key": tmpdir / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)
    return paths


def _security(tmpdir: Path) -> str:
    """``security.toml``: random JWT keys for the volume server's HTTP, mutual TLS on every gRPC port."""
    pem = _pem_files(tmpdir)
    jwt = "".join(
        f'[{section}]\nkey = "{secrets.token_hex(32)}"\n'
        for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    )
    grpc = "".join(
        f'[grpc.{part}]\ncert = "{pem["cert"]}"\nkey = "{pem["key"]}"\nallowed_commonNames = "{_NAME}"\n'
        for part in (*_PARTS, "client")
    )
    return (
        f"{jwt}[access]\nui = false\n[filer.expose_directory_metadata]\nenabled = false\n"
        f'[grpc]\nca = "{pem["ca"]}"\n{grpc}'
    )


def command(weed: str, tmpdir: Path, ports: list[int], access_key: str, secret_key: str) -> list[str]:
    """The ``weed server`` command line for ``ports`` (master, its gRPC, volume, its gRPC, filer, its gRPC,
    S3, its gRPC), its files written into ``tmpdir`` (its working directory: weed reads
    ``security.toml`` and ``master.toml`` there)."""
    config = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    for name, text in (
        ("s3.json", json.dumps(config)),
        # Growing 7 volumes for each new bucket (weed's default) costs ~1 s per bucket; 2 keep a test's
        # first write fast.
        ("master.toml", "[master.volume_growth]\ncopy_1 = 2\ncopy_other = 1\n"),
        ("security.toml", _security(tmpdir)),
    ):
        fd = os.open(tmpdir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    (tmpdir / "data").mkdir(mode=0o700)
    p = ports
    # Every port is pinned: weed otherwise derives gRPC ports as HTTP port + 10000, which may be taken.
    # Small volumes (8 MB, grown on demand) start fast and use little disk; telemetry off (never contact
    # a non-loopback address); preStopSeconds=0 so SIGTERM stops it at once.
    return [
        weed, "-logtostderr", "server",
        f"-dir={tmpdir / 'data'}",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p[0]}", f"-master.port.grpc={p[1]}",
        f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
        f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
        "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={tmpdir / 's3.json'}",
        # Relative to the working directory (``tmpdir``): a unix socket's path has at most 107 bytes,
        # which a deep $TMPDIR (pytest-xdist's, say) passes when spelled whole.
        "-filer.localSocket=filer.sock",
        "-s3.localSocket=s3.sock",
        "-disableHttp", "-filer.disableHttp",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=8", "-volume.max=0",
        "-volume.preStopSeconds=0",
        "-volume.minFreeSpace=256MiB",
    ]  # fmt: skip


def grpc_sockets(ports: list[int]) -> list[Path]:
    """The unix sockets ``weed server`` makes in /tmp for the gRPC ``ports`` of :func:`command`."""
    grpc = (ports[1], ports[3], ports[5], ports[7])
    return [_SOCKETS / f"seaweedfs-{part}-grpc-{port}.sock" for part, port in zip(_PARTS, grpc, strict=True)]


def _own_socket(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()


def remove_sockets(paths: list[Path]) -> None:
    """Remove ``paths`` that are this user's sockets (never another user's, never through a link)."""
    for path in paths:
        if _own_socket(path):
            with contextlib.suppress(OSError):
                path.unlink()


def sweep_sockets() -> list[Path]:
    """Remove this user's SeaweedFS gRPC sockets in /tmp that nothing listens on any more (a server killed
    by SIGKILL cannot remove its own); returns them."""
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(_SOCKETS) if n.startswith("seaweedfs-") and n.endswith(".sock")]
    except OSError:
        return removed
    for name in names:
        path = _SOCKETS / name
        if not _own_socket(path):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            try:
                probe.connect(str(path))
                continue  # a live server's
            except OSError as exc:
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    continue  # busy or unknown: left alone
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed
