"""A throw-away PostgreSQL cluster for tests and benchmarks: ``initdb`` in a
temporary folder, a server on a Unix socket only (no TCP port), durability
off (the data is thrown away), stopped and deleted at the end.

PostgreSQL refuses to run as root: as root the cluster runs as the
``postgres`` user (``nobody`` where there is none).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

USER = "pamer"
PORT = 5432  # on a socket of its own folder, so it never collides


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class Cluster:
    """``with Cluster() as cluster: url = cluster.new_database()``."""

    def __init__(self) -> None:
        self.initdb, self.pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if not (self.initdb and self.pg_ctl):
            raise FileNotFoundError("initdb and pg_ctl (PostgreSQL server binaries) are not installed")
        self.root = Path(tempfile.mkdtemp(prefix="pamer-pg-"))
        self.data, self.socket = self.root / "data", self.root / "socket"
        self._names = itertools.count()
        self._as: list[str] = []
        if os.geteuid() == 0:
            owner = next((u for u in ("postgres", "nobody") if _user_exists(u)), None)
            if owner is None:
                raise PermissionError("running as root and neither a postgres nor a nobody user exists")
            os.chmod(self.root, 0o755)
            self.socket.mkdir()
            shutil.chown(self.root, owner)
            shutil.chown(self.socket, owner)
            self._as = ["runuser", "-u", owner, "--"]
        else:
            self.socket.mkdir()

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> Cluster:
        assert self.initdb and self.pg_ctl
        try:
            self._run(self.initdb, "-D", str(self.data), "-U", USER, "-A", "trust", "-E", "UTF8", "--no-sync")
            options = (
                f"-k {self.socket} -p {PORT} -c listen_addresses='' -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
            )
            log = str(self.root / "server.log")
            self._run(self.pg_ctl, "-D", str(self.data), "-l", log, "-o", options, "-w", "start")
        except subprocess.CalledProcessError as exc:
            self.stop()
            raise RuntimeError(f"the throw-away PostgreSQL did not start: {exc.stderr or exc.stdout}") from exc
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@/{database}?host={self.socket}&port={PORT}"

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        name = f"t{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self.pg_ctl and (self.data / "postmaster.pid").exists():
            self._run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
