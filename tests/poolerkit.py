"""PgBouncer in transaction mode in front of the test PostgreSQL, for the tests that check the
queue behind a pooler (tests/faults/test_pooler.py).

Debian's ``pgbouncer`` package provides the binary (CI installs it, as it installs Chromium
and Java); where it is missing or cannot start, :func:`start_or_skip` skips the test with the
reason. PgBouncer refuses to run as root: as root it runs as the embedded PostgreSQL's system
user, which also owns its working directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from django_fairqueue import devdb

BINARY_PATHS = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")
START_TIMEOUT = 15.0


def binary() -> str | None:
    found = shutil.which("pgbouncer")
    return found or next((p for p in BINARY_PATHS if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class PgBouncer:
    """One PgBouncer process in ``pool_mode = transaction`` for the server of ``upstream``."""

    def __init__(self, upstream: str, workdir: Path, *, pool_size: int = 10) -> None:
        self.upstream = urlsplit(upstream)
        self.workdir = workdir
        self.pool_size = pool_size
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        path = self.workdir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def url(self, dbname: str | None = None) -> str:
        """``upstream``'s URL with PgBouncer's address (and ``dbname``, if given)."""
        user = self.upstream.username or "postgres"
        path = f"/{dbname}" if dbname else self.upstream.path
        return urlunsplit(("postgres", f"{user}@127.0.0.1:{self.port}", path, "", ""))

    def start(self, program: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ini = self.workdir / "pgbouncer.ini"
        user = self.upstream.username or "postgres"
        ini.write_text(
            "[databases]\n"
            # every database of the test server, as the test's own user (auth_type any)
            f"* = host={self.upstream.hostname} port={self.upstream.port or 5432} "
            f"user={user}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 400\n"
            # what psycopg and Django send that PgBouncer does not track itself
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.workdir / 'pgbouncer.log'}\n"
            f"pidfile = {self.workdir / 'pgbouncer.pid'}\n"
        )
        uid = gid = None
        if os.geteuid() == 0:  # "PgBouncer should not run as root"
            import pwd

            entry = pwd.getpwnam(devdb.SYSTEM_USER)  # the embedded server created it
            uid, gid = entry.pw_uid, entry.pw_gid
            os.chown(self.workdir, uid, gid)
            os.chown(ini, uid, gid)
        self.proc = subprocess.Popen(
            [program, str(ini)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            user=uid,
            group=gid,
            extra_groups=[] if uid is not None else None,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not _accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"PgBouncer did not start on port {self.port}:\n{self.log}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_or_skip(upstream: str, workdir: Path, **kwargs: int) -> PgBouncer:
    """A started PgBouncer, or skip the test saying why there is none."""
    program = binary()
    if program is None:
        pytest.skip("PgBouncer is not installed (Debian: apt-get install pgbouncer; CI does)")
    bouncer = PgBouncer(upstream, workdir, **kwargs)
    try:
        bouncer.start(program)
    except (OSError, RuntimeError, KeyError) as exc:
        pytest.skip(f"PgBouncer ({program}) could not start: {exc}")
    return bouncer
