"""What the Django backend's tests run against: Django configured here, a
fresh database per test on PostgreSQL, MariaDB/MySQL or SQLite (migrated by
`tablemail migrate`, dropped afterwards), SMTP servers that record what they
receive (tests/support/smtp_server.py), and the tablemail daemon itself.

An unreachable database or a missing daemon binary fails the test (a suite
that passes without them proves nothing); TABLEMAIL_TEST_SKIP_UNREACHABLE=1
turns that into a skip, never under CI=true, as in the Rust tests.
TABLEMAIL_TEST_POSTGRES and TABLEMAIL_TEST_MYSQL name other servers,
TABLEMAIL_TEST_BIN another build of the daemon.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# The client under test is the working tree's, not an installed copy.
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(REPO / "tests" / "support"))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

settings.configure(
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    EMAIL_BACKEND="tablemail.django.EmailBackend",
    DEFAULT_FROM_EMAIL="webmaster@shop.example",
    USE_TZ=True,
    TIME_ZONE="UTC",
    INSTALLED_APPS=[],
)
django.setup()

from django.db import connections  # noqa: E402


def in_ci():
    return os.environ.get("CI") == "true"


def unavailable(what):
    """Fails, or skips where that was asked for outside CI."""
    if os.environ.get("TABLEMAIL_TEST_SKIP_UNREACHABLE") == "1" and not in_ci():
        pytest.skip(f"SKIPPED: {what}")
    pytest.fail(
        f"{what} (scripts/test starts the servers; TABLEMAIL_TEST_SKIP_UNREACHABLE=1 skips "
        "instead, outside CI)"
    )


def eventually(what, check, limit=20.0):
    """Polls `check` until it returns something true, failing after `limit`
    seconds; returns what it returned."""
    deadline = time.monotonic() + limit
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {limit}s waiting for: {what}")
        time.sleep(0.05)


def tablemail_bin():
    path = os.environ.get("TABLEMAIL_TEST_BIN")
    if path is None:
        target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        path = target / "debug" / "tablemail"
    path = Path(path)
    if not path.is_absolute():
        path = REPO / path
    if not path.exists():
        pytest.fail(f"the daemon {path} is not built: run `cargo build` first")
    return str(path)


# --- databases ---------------------------------------------------------------


def _admin_url(backend):
    if backend == "postgres":
        return os.environ.get("TABLEMAIL_TEST_POSTGRES", "postgres://postgres@127.0.0.1:5432/postgres")
    return os.environ.get("TABLEMAIL_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")


def _django_settings(url, name):
    parts = urlsplit(url)
    engine = {
        "postgres": "django.db.backends.postgresql",
        "postgresql": "django.db.backends.postgresql",
        "mysql": "django.db.backends.mysql",
    }[parts.scheme]
    return {
        "ENGINE": engine,
        "NAME": name,
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


def _with_database(url, name):
    base = url.rsplit("/", 1)[0]
    return f"{base}/{name}"


class Database:
    """A database of its own for one test, migrated, on Django's connection
    `alias` (the other aliases' settings stay as they are)."""

    def __init__(self, backend, alias="default"):
        self.backend = backend
        self.alias = alias
        self.name = f"tm_test_{uuid.uuid4().hex}"
        self.dir = None
        if backend == "sqlite":
            self.dir = tempfile.TemporaryDirectory(prefix="tablemail-client-")
            path = os.path.join(self.dir.name, "tablemail.db")
            self.url = f"sqlite://{path}"
            django_settings = {"ENGINE": "django.db.backends.sqlite3", "NAME": path}
        else:
            admin = _admin_url(backend)
            try:
                self._admin(f"CREATE DATABASE {self.name}")
            except Exception as e:  # the driver's own error types differ
                unavailable(f"{backend} is unreachable at {admin}: {e}")
            self.url = _with_database(admin, self.name)
            django_settings = _django_settings(admin, self.name)
        migrate = subprocess.run(
            [tablemail_bin(), "migrate"],
            env={**os.environ, "TABLEMAIL__DATABASE__URL": self.url},
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert migrate.returncode == 0, f"tablemail migrate failed: {migrate.stdout}{migrate.stderr}"
        use_connection(alias, django_settings)

    def _admin(self, sql):
        parts = urlsplit(_admin_url(self.backend))
        if self.backend == "postgres":
            import psycopg

            with psycopg.connect(
                host=parts.hostname,
                port=parts.port or 5432,
                user=parts.username,
                password=parts.password,
                dbname=parts.path.lstrip("/") or "postgres",
                autocommit=True,
                connect_timeout=5,
            ) as conn:
                conn.execute(sql)
        else:
            import MySQLdb

            conn = MySQLdb.connect(
                host=parts.hostname,
                port=parts.port or 3306,
                user=parts.username or "root",
                password=parts.password or "",
                connect_timeout=5,
            )
            try:
                conn.cursor().execute(sql)
            finally:
                conn.close()

    def rows(self, sql, params=()):
        """Rows of a query on the test's connection, in autocommit."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql, params)
            return [tuple(row) for row in cursor.fetchall()]

    def count(self, table):
        return self.rows(f"SELECT count(*) FROM {table}")[0][0]

    def drop(self):
        connections[self.alias].close()
        if self.backend == "postgres":
            self._admin(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
        elif self.backend == "mysql":
            self._admin(f"DROP DATABASE IF EXISTS {self.name}")
        else:
            self.dir.cleanup()


def use_connection(alias, django_settings):
    """Points Django's connection `alias` at another database."""
    if alias in connections.settings:
        connections[alias].close()
    # Django fills in the keys left out (and wants a default alias to do it).
    configured = connections.configure_settings({"default": django_settings})
    connections.settings[alias] = configured["default"]
    try:
        del connections[alias]
    except AttributeError:
        pass


BACKENDS = ["postgres", "mysql", "sqlite"]


@pytest.fixture(params=BACKENDS)
def db(request):
    database = Database(request.param)
    yield database
    database.drop()


# --- SMTP servers and the daemon ---------------------------------------------


class SmtpServer:
    """tests/support/smtp_server.py: a real SMTP server (aiosmtpd) that
    records every mail it accepts."""

    def __init__(self, directory):
        self.out = os.path.join(directory, f"smtp-{uuid.uuid4().hex}.jsonl")
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "support" / "smtp_server.py"), "--out", self.out],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.process.kill()
            pytest.fail(f"the SMTP server did not start (is aiosmtpd installed?): {line!r}")
        self.port = int(line.split()[1])

    def records(self):
        with open(self.out) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait_for(self, count, limit=20.0):
        return eventually(
            f"{count} mails at the SMTP server", lambda: (r := self.records()) and len(r) >= count and r, limit
        )

    def stop(self):
        self.process.terminate()
        self.process.wait(10)


class Daemon:
    """`tablemail run` on a database, sending to an SMTP server."""

    def __init__(self, url, smtp_port, directory):
        self.log = open(os.path.join(directory, f"daemon-{uuid.uuid4().hex}.log"), "w+")
        env = {
            **os.environ,
            "TABLEMAIL__DATABASE__URL": url,
            "TABLEMAIL__TRANSPORT__URL": f"smtp://127.0.0.1:{smtp_port}",
            "TABLEMAIL__DEFAULTS__FROM_ADDRESS": "tablemail@shop.example",
            "TABLEMAIL__WORKER__POLL_INTERVAL": "200ms",
            "TABLEMAIL__LOG__FORMAT": "json",
        }
        self.process = subprocess.Popen(
            [tablemail_bin(), "run"], env=env, cwd=directory, stdout=self.log, stderr=subprocess.STDOUT
        )

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="tablemail-client-") as d:
        yield d


@pytest.fixture
def smtp_server(workdir):
    """Starts SMTP servers on demand; all are stopped after the test."""
    started = []

    def start():
        server = SmtpServer(workdir)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def daemon(workdir):
    """Starts daemons on demand; all are stopped after the test."""
    started = []

    def start(url, smtp_port):
        d = Daemon(url, smtp_port, workdir)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
