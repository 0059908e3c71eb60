"""``manage.py fairpipeline bench``: the Spark pipeline against the same formulas in SQL.

For each row count: scratch source and sink tables (UNLOGGED, dropped afterwards) with the
rows of ``tenants`` tenants (10 by default), **interleaved** as in a table every tenant writes
to (each id's tenant picked by a hash of it; ``contiguous=True``: one run of ids per tenant,
which flatters any write by key range), each tenant with its own ``rules`` formulas (3 typed
columns; every further rule goes to a ``jsonb`` results column). The source gets the
``(tenant, id)`` index the how-to asks for and a ``VACUUM ANALYZE``. Then, on a warm
SparkSession:

* **SQL baselines**: each tenant's formulas compiled by hand to one ``INSERT ... SELECT``
  (plain ``INSERT``: the sink starts empty), computed by PostgreSQL alone; once on one
  connection, once on one connection per CPU core running tenants side by side. The faster is
  "the baseline";
* **Spark pipeline, atomic sink** (the default): the same formulas through planned work
  batches, claimed, read by Spark tasks (COPY -> Arrow), transformed, staged and merged under
  the fence, as a worker runs them;
* **Spark pipeline, ``Sink(atomic=False)``** (unless ``direct=False``): the same, but each
  Spark task writes its rows into the sink in its own lease-fenced transaction.

Each starts from an empty sink; their results are compared with the baseline's. The database
server's CPU time of each is measured from ``/proc`` when the server runs on this machine: the
user and system time of the postmaster and all its processes (backends, including exited ones,
which the postmaster's children's times count; background writers, WAL writer, autovacuum).

Nothing stays behind: the scratch tables, the jobs, work batches and channels the run created
are removed when it ends (the tenants are named after the run, so no existing channel is used).
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from django_fairqueue.contrib.pipeline import datastore
from django_fairqueue.contrib.pipeline.core import Pipeline, Sink, Source, registry
from django_fairqueue.contrib.pipeline.spark import get_session, jvm_peak_rss_bytes
from django_fairqueue.runtime import proctree

SOURCE = "fq_bench_pipeline_source"
SINK = "fq_bench_pipeline_sink"
TYPED = ("subtotal", "total", "band")
#: Keys of the results column whose sums the benchmark compares (when there are that many rules).
CHECKED_RESULTS = ("r004", "r005", "r006")
#: The source columns of each kind of rules (the realistic ones read a marketing table's
#: columns too, with blanks: ``channel``, ``spend`` and ``clicks`` are blank in some rows).
SIMPLE_COLUMNS = ("id", "tenant", "price", "qty", "discount", "tax_rate")
REALISTIC_COLUMNS = (
    *SIMPLE_COLUMNS,
    *("channel", "region", "spend", "clicks", "impressions", "first_on", "last_on"),
)
RULE_KINDS = ("simple", "realistic")
#: A realistic rule set has a chain of this many rules, each using the one before, in every
#: 100 rules (from its 80th).
CHAIN_DEPTH = 20


@dataclass(frozen=True)
class Rule:
    """One formula in the pipeline's language and the same computation in PostgreSQL's SQL
    (the data has no blanks and no rule divides, so the spreadsheet rules about blanks and
    error values do not come into it)."""

    name: str
    formula: str
    sql: str


def tenant_rules(index: int, count: int) -> list[Rule]:
    """``count`` rules (at least 3) of the tenant numbered ``index``; tenants differ."""
    if index % 2 == 0:
        subtotal = "(price * qty)"
        total = f"round(({subtotal} * (1 - discount) * (1 + tax_rate))::text::numeric, 2)::float8"
        rules = [
            Rule("subtotal", "subtotal = price * qty", subtotal),
            Rule("total", "total = ROUND(subtotal * (1 - discount) * (1 + tax_rate), 2)", total),
            Rule(
                "band",
                'band = IFS(total >= 500, "high", total >= 100, "mid", TRUE, "low")',
                f"CASE WHEN {total} >= 500 THEN 'high' WHEN {total} >= 100 THEN 'mid' "
                "ELSE 'low' END",
            ),
        ]
    else:
        subtotal = "(price * qty - discount * price)"
        total = f"(greatest({subtotal}, 0) * (1 + tax_rate) + 4.95)"
        rules = [
            Rule("subtotal", "subtotal = price * qty - discount * price", subtotal),
            Rule("total", "total = MAX(subtotal, 0) * (1 + tax_rate) + 4.95", total),
            Rule(
                "band",
                'band = IF(qty > 10, "bulk", "retail")',
                "CASE WHEN qty > 10 THEN 'bulk' ELSE 'retail' END",
            ),
        ]
    for k in range(4, count + 1):
        a = ((k + index) % 7 + 1) / 10
        n = (k + index) % 17
        x = 50 + (k * 13 + index) % 900
        name = f"r{k:03d}"
        kind = k % 5
        if kind == 0:
            formula = f"ROUND(price * {a} + qty * {n}, 2)"
            code = f"round((price * {a} + qty * {n})::text::numeric, 2)::float8"
        elif kind == 1:
            formula = f"IF(qty > {n}, price * {a}, discount * {x})"
            code = f"CASE WHEN qty > {n} THEN price * {a} ELSE discount * {x} END"
        elif kind == 2:
            formula = f'IF(price > {x}, "high", "low")'
            code = f"CASE WHEN price > {x} THEN 'high' ELSE 'low' END"
        elif kind == 3:
            formula = f"MAX(subtotal - {x}, 0)"
            code = f"greatest({subtotal} - {x}, 0)"
        else:
            formula = f"ABS(price * {a} - qty)"
            code = f"abs(price * {a} - qty)"
        rules.append(Rule(name, f"{name} = {formula}", code))
    return rules[:count] if count >= 3 else rules


def _num(column: str) -> str:
    """A numeric column in the baseline's SQL as the formulas see it: blank is 0."""
    return f"coalesce({column}, 0)::float8"


def _round(sql: str, digits: int) -> str:
    """ROUND as the formulas do it (half away from zero, on the decimal the number prints as)."""
    return f"round(({sql})::text::numeric, {digits})::float8"


def _realistic_rule(k: int, index: int, previous: Rule | None) -> Rule:
    """Rule ``r{k}`` of a realistic set: what marketing analysts write (IF chains, text, dates,
    blanks, division, tenant aggregates, chains of rules using rules), with its SQL twin. Each
    SQL twin follows the formulas' semantics for this data: a blank is 0 in arithmetic and ""
    in text, text compares without case, a division by zero is an error (blank in the sink),
    an aggregate is over the tenant's rows (a window in SQL)."""
    a = ((k + index) % 7 + 1) / 10
    n = (k + index) % 17
    x = 50 + (k * 13 + index) % 900
    name = f"r{k:03d}"
    spend, clicks, views = _num("spend"), _num("clicks"), _num("impressions")
    position = k - 4
    if position % 100 >= 100 - CHAIN_DEPTH and previous is not None:
        link = (position % 100) % 3
        if position % 100 == 100 - CHAIN_DEPTH:  # a chain starts from the source
            return Rule(name, f"{name} = spend * {a} + clicks", f"({spend} * {a} + {clicks})")
        prev = previous.name
        if link == 0:
            return Rule(name, f"{name} = {prev} * {a} + {n}", f"({previous.sql} * {a} + {n})")
        if link == 1:
            return Rule(
                name,
                f"{name} = {prev} + IF(qty > {n}, {a}, -{a})",
                f"({previous.sql} + CASE WHEN qty > {n} THEN {a} ELSE -{a} END)",
            )
        return Rule(name, f"{name} = ROUND({prev}, 4)", _round(previous.sql, 4))
    match position % 8:
        case 0:  # a division, its error caught
            return Rule(
                name,
                f"{name} = IFERROR(clicks / impressions, 0) * {a}",
                f"(CASE WHEN {views} = 0 THEN 0 ELSE {clicks} / {views} END * {a})",
            )
        case 1:  # a share of the tenant's total
            return Rule(
                name,
                f"{name} = IFERROR(spend / SUM(spend), 0) * {x}",
                f"(CASE WHEN sum({spend}) OVER () = 0 THEN 0 "
                f"ELSE {spend} / sum({spend}) OVER () END * {x})",
            )
        case 2:  # days between two dates
            return Rule(
                name,
                f"{name} = DAYS(last_on, first_on) + {n}",
                f"((last_on - first_on)::float8 + {n})",
            )
        case 3:  # an IF chain over a blank-able number
            return Rule(
                name,
                f'{name} = IF(spend > {x}, "gold", IF(spend > {x // 2}, "silver", '
                f'IF(ISBLANK(spend), "none", "bronze")))',
                f"CASE WHEN {spend} > {x} THEN 'gold' WHEN {spend} > {x // 2} THEN 'silver' "
                "WHEN spend IS NULL THEN 'none' ELSE 'bronze' END",
            )
        case 4:  # text built from blank-able text
            return Rule(
                name,
                f'{name} = UPPER(LEFT(COALESCE(channel, "none"), {1 + k // 8 % 4})) & "-" & region',
                f"(upper(left(coalesce(channel, 'none'), {1 + k // 8 % 4})) || '-' || "
                "coalesce(region, ''))",
            )
        case 5:  # a text comparison (without case) choosing a number
            return Rule(
                name,
                f'{name} = IF(channel = "EMAIL", clicks * {a}, IF(region = "north", {n}, 0))',
                f"CASE WHEN lower(coalesce(channel, '')) = 'email' THEN {clicks} * {a} "
                f"WHEN lower(coalesce(region, '')) = 'north' THEN {n} ELSE 0 END",
            )
        case 6:  # a division that may be an error, and the distance to the channel's mean
            if (position // 8) % 2:
                return Rule(
                    name,
                    f"{name} = spend / impressions * 1000",
                    f"(CASE WHEN {views} = 0 THEN NULL ELSE {spend} / {views} END * 1000)",
                )
            return Rule(
                name,
                f"{name} = ROUND(spend - AVERAGE(spend BY channel), 2)",
                _round(f"{spend} - avg(spend) OVER (PARTITION BY channel)", 2),
            )
        case _:  # a date's parts, and a rule using the tenant's typed rules
            if (position // 8) % 2:
                return Rule(
                    name,
                    f'{name} = IF(MONTH(first_on) >= 7, "H2", "H1") & "-" & YEAR(last_on)',
                    "(CASE WHEN extract(month FROM first_on) >= 7 THEN 'H2' ELSE 'H1' END || "
                    "'-' || extract(year FROM last_on)::int::text)",
                )
            return Rule(name, f"{name} = MAX(total - {x}, 0)", "")


def realistic_rules(index: int, count: int) -> list[Rule]:
    """``count`` realistic rules (at least 3) of the tenant numbered ``index``: the simple
    set's typed rules, then :func:`_realistic_rule` s; tenants differ."""
    rules = tenant_rules(index, 3)
    total = next(r.sql for r in rules if r.name == "total")
    for k in range(4, count + 1):
        rule = _realistic_rule(k, index, rules[-1])
        if not rule.sql:  # uses the typed rule ``total``: inline its SQL
            x = 50 + (k * 13 + index) % 900
            rule = Rule(rule.name, rule.formula, f"greatest({total} - {x}, 0)")
        rules.append(rule)
    return rules[:count]


def rule_set(kind: str, index: int, count: int) -> list[Rule]:
    """The rules of tenant ``index`` of one kind (:data:`RULE_KINDS`)."""
    if kind == "simple":
        return tenant_rules(index, count)
    if kind == "realistic":
        return realistic_rules(index, count)
    raise ValueError(f"unknown kind of rules {kind!r}; known: {', '.join(RULE_KINDS)}")


def baseline_expressions(rules: Sequence[Rule]) -> dict[str, Any]:
    """Sink column -> SQL expression of one tenant's rules: the typed columns, and the other
    rules as one ``jsonb`` object (built 50 keys at a time: a function takes 100 arguments)."""
    from psycopg import sql

    typed = {r.name: sql.SQL(r.sql) for r in rules if r.name in TYPED}
    others = [r for r in rules if r.name not in TYPED]
    parts = []
    for lo in range(0, len(others), 50):
        pairs = sql.SQL(", ").join(
            sql.SQL("{}, {}").format(sql.Literal(r.name), sql.SQL(r.sql))
            for r in others[lo : lo + 50]
        )
        parts.append(sql.SQL("jsonb_build_object({})").format(pairs))
    results = sql.SQL(" || ").join(parts) if parts else sql.SQL("'{}'::jsonb")
    return {
        "id": sql.Identifier("id"),
        "tenant": sql.Identifier("tenant"),
        **typed,
        "results": results,
    }


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds (user + system) of process ``root`` and all its descendants, exited ones
    included (a process's children's times count in its own once they exited and were waited
    for). None if ``root`` is gone or ``/proc`` cannot be read."""
    tree = proctree.read()
    if tree is None or root not in tree:
        return None
    ticks = 0
    for pid in (root, *proctree.descendants(root, tree)):
        try:
            ticks += sum(int(v) for v in tree[pid][11:15])  # utime stime cutime cstime
        except (ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


class DatabaseCpu:
    """CPU seconds of the PostgreSQL server behind ``using``: its postmaster's process tree
    (:func:`tree_cpu_seconds`). None when the server is not on this machine."""

    def __init__(self, using: str) -> None:
        backend = datastore.backend_pid(using)
        self.postmaster: int | None = None
        try:
            postmaster = int(proctree.stat(backend)[1])
            with open(f"/proc/{postmaster}/comm", encoding="ascii") as comm:
                if "postgres" in comm.read():
                    self.postmaster = postmaster
        except (OSError, ValueError, IndexError):
            pass  # not this machine's process (or not readable): not measured

    def seconds(self) -> float | None:
        return None if self.postmaster is None else tree_cpu_seconds(self.postmaster)


def spark_cpu_seconds() -> float | None:
    """CPU seconds of Spark's JVM and its Python workers (local mode), of this process, and of
    the executors of this application that run on this machine (a standalone cluster's
    executor JVMs, each with its Python workers: :func:`local_executor_pids`)."""
    jvm = _jvm_pid()
    spark = tree_cpu_seconds(jvm) if jvm is not None else None
    if spark is None:
        return None
    own = resource.getrusage(resource.RUSAGE_SELF)
    executors = sum(tree_cpu_seconds(pid) or 0.0 for pid in local_executor_pids())
    return spark + own.ru_utime + own.ru_stime + executors


def _application_id() -> str | None:
    from django_fairqueue.contrib.pipeline import spark

    session = spark.current_session()
    if session is None:
        return None
    try:
        return str(session.sparkContext.applicationId)
    except Exception:
        return None


def local_executor_pids() -> list[int]:
    """Process ids of this application's executor JVMs on this machine (none in local mode,
    where the driver's JVM runs the tasks): the processes started with Spark's executor class
    and ``--app-id`` of this application."""
    app = _application_id()
    if app is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except OSError:
            continue
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" not in args:
            continue
        with contextlib.suppress(ValueError, IndexError):
            if args[args.index(b"--app-id") + 1].decode() == app:
                found.append(int(entry))
    return found


def executor_count() -> int:
    """Executors of this process's Spark application (0 in local mode)."""
    from django_fairqueue.contrib.pipeline import spark

    session = spark.current_session()
    return len(spark.executor_ids(session)) if session is not None else 0


@contextlib.contextmanager
def spark_overrides(
    master: str | None = None,
    partitions: int | None = None,
    conf: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """``FAIRQUEUE_PIPELINE['SPARK']`` with ``MASTER``, ``PARTITIONS`` and ``CONF`` entries
    replaced for the benchmark's session (the same run on another master). ``ValueError`` if
    they are invalid, or if this process already runs a Spark session on another master."""
    from django.test.utils import override_settings

    from django_fairqueue.contrib.pipeline import appconf, spark

    if master is None and partitions is None and not conf:
        yield
        return
    raw = dict(appconf.get()["SPARK"])
    if master is not None:
        raw["MASTER"] = master
    if partitions is not None:
        raw["PARTITIONS"] = partitions
    if conf:
        raw["CONF"] = {**raw.get("CONF", {}), **conf}
    from django.conf import settings

    current = getattr(settings, "FAIRQUEUE_PIPELINE", None) or {}
    with override_settings(FAIRQUEUE_PIPELINE={**current, "SPARK": raw}):
        settings_now = spark.spark_settings()
        plan = spark.session_plan(settings_now)  # a master naming no host fails here
        session = spark.current_session()
        if session is not None and master is not None:
            running = str(session.sparkContext.master)
            if running != plan.master:
                raise ValueError(
                    f"this process already runs a Spark session on {running}: the benchmark "
                    f"cannot use {plan.master} (run it in a process of its own)"
                )
        yield


@dataclass
class BenchResult:
    rows: int
    tenants: int
    rules: int  # per tenant
    rules_kind: str  # RULE_KINDS
    interleaved: bool
    batches: int  # per Spark run
    sql_serial_seconds: float | None  # one connection, tenant after tenant
    sql_parallel_seconds: float | None  # one connection per core, tenants side by side
    sql_seconds: float  # the best of the baselines run: "the baseline"
    spark_seconds: float  # atomic sink
    direct_seconds: float | None  # Sink(atomic=False)
    sql_rows_per_second: float
    spark_rows_per_second: float
    direct_rows_per_second: float | None
    ratio: float  # atomic seconds / baseline seconds
    direct_ratio: float | None  # atomic=False seconds / baseline seconds
    plan_seconds: float  # of the atomic run
    spark_phase_seconds: float  # of the atomic run's batches: read, formulas, staging
    merge_seconds: float  # of the atomic run's batches: the fenced merge (one backend each)
    #: Database server CPU per row (microseconds), None where not measured.
    sql_db_cpu_us_per_row: float | None
    spark_db_cpu_us_per_row: float | None
    direct_db_cpu_us_per_row: float | None
    #: CPU per row (microseconds) of Spark's JVM, its Python workers and the driver process.
    spark_cpu_us_per_row: float | None
    results_match: bool  # the Spark runs wrote what the baseline wrote
    driver_peak_rss_mb: float
    jvm_peak_rss_mb: float
    python_workers_peak_rss_mb: float
    load_average: list[float] = field(default_factory=list)  # 1-min, at start and end
    master: str = ""  # the Spark master the pipeline ran on
    executors: int = 0  # its executors (0: local mode, the driver's JVM runs the tasks)
    #: Executors whose CPU is in spark_cpu_us_per_row (those on this machine).
    executors_measured: int = 0
    #: Each batch of the atomic run: rows, seconds in all, Spark phase, merge (in run order).
    batch_timings: list[list[float]] = field(default_factory=list)
    #: With one runner, the Spark and driver CPU (seconds) of each of those batches: with one
    #: batch per tenant, a tenant's fixed cost (its plan) plus its rows. Empty with more
    #: runners (their batches overlap). None where not measured.
    batch_cpu_seconds: list[float | None] = field(default_factory=list)
    #: The same CPU of the warm-up before the measured runs: what a process's first jobs cost
    #: beyond a later tenant's (Spark's start, the JIT compiling Spark's own code).
    warmup_cpu_seconds: float | None = None
    #: Runners (threads sharing the Spark session) of the pipeline runs.
    runners: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _workers_rss_bytes() -> int:
    """Resident memory of the Python processes Spark started (children of the JVM)."""
    jvm = _jvm_pid()
    if jvm is None:
        return 0
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != jvm:  # ppid
                continue
            with open(f"/proc/{entry}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def _jvm_pid() -> int | None:
    from django_fairqueue.contrib.pipeline import spark

    session = spark.current_session()
    if session is None:
        return None
    try:
        return int(session.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:
        return None


def _bench_pipeline(
    name: str,
    batch_size: int,
    using: str,
    rules: dict[str, list[Rule]],
    *,
    atomic: bool = True,
    kind: str = "simple",
) -> Pipeline:
    columns = REALISTIC_COLUMNS if kind == "realistic" else SIMPLE_COLUMNS
    return Pipeline(
        name=name,
        source=Source(SOURCE, columns=list(columns), tenant_column="tenant"),
        sink=Sink(
            SINK,
            key=["id"],
            columns=["tenant", *TYPED],
            results="results",
            atomic=atomic,
        ),
        formulas=lambda tenant: [r.formula for r in rules[tenant]],
        tenants=list(rules),
        batch_size=batch_size,
        database=using,
    )


def _forget(using: str, name: str, channels: Sequence[str]) -> None:
    """Delete the benchmark's jobs, work batches and channels: they must not stay in the admin."""
    from django_fairqueue.contrib.pipeline.models import PipelineJob
    from django_fairqueue.models import Channel, WorkBatch

    WorkBatch.objects.using(using).filter(job_name__startswith=name).delete()
    PipelineJob.objects.using(using).filter(pipeline__startswith=name).delete()
    Channel.objects.using(using).filter(name__in=list(channels)).delete()


def checked_results(kind: str, rules: int) -> list[str]:
    """The rules (keys of the results column) whose sums the benchmark compares: the first
    three, and of realistic rules also the first tenant aggregate BY a column, a second
    division and the last rule of the first chain (when there are that many rules)."""
    names = list(CHECKED_RESULTS)
    if kind == "realistic":
        names += ["r010", "r012", f"r{103:03d}"]
    return [name for name in names if int(name[1:]) <= rules]


def _checksums(using: str, checked: Sequence[str]) -> tuple[Any, ...]:
    count, total = datastore.checksum(using, SINK, "total")
    return (count, total, *(datastore.results_checksum(using, SINK, "results", k) for k in checked))


def _same(got: tuple[Any, ...], expected: tuple[Any, ...]) -> bool:
    if got[0] != expected[0]:
        return False
    return all(
        abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(got[1:], expected[1:], strict=True)
    )


def _baseline(using: str, statements: dict[str, str], hi: int, connections: int) -> float:
    """Run each tenant's statement, on ``connections`` connections at once; seconds taken."""
    import psycopg

    conninfo = datastore.connection_string(using)
    pending = list(statements.items())
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                while True:
                    with lock:
                        if not pending or errors:
                            return
                        tenant, statement = pending.pop(0)
                    conn.execute(statement, {"lo": 1, "hi": hi, "tenant": tenant})
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(max(1, connections))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.monotonic() - started


def _timing(outcome: Any) -> list[float]:
    """A batch's rows, seconds in all, Spark phase and merge."""
    return [
        outcome.rows,
        round(outcome.seconds, 2),
        round(outcome.spark_seconds, 2),
        round(outcome.merge_seconds, 2),
    ]


def _spent(before: float | None, after: float | None) -> float | None:
    """CPU seconds between two readings, None unless both were measured."""
    return None if before is None or after is None else after - before


def _per_row(seconds: float | None, rows: int) -> float | None:
    return None if seconds is None else round(seconds / rows * 1e6, 2)


def run(
    rows: int,
    *,
    using: str,
    batch_size: int | None = None,
    tenants: int = 10,
    rules: int = 3,
    rules_kind: str = "simple",
    contiguous: bool = False,
    direct: bool = True,
    sql_connections: Sequence[int] = (),
    say: Callable[[str], None] = print,
    master: str | None = None,
    partitions: int | None = None,
    spark_conf: Mapping[str, str] | None = None,
    runners: int = 1,
) -> BenchResult:
    """One benchmark run (see the module doc). ``master``, ``partitions`` and ``spark_conf``
    replace ``FAIRQUEUE_PIPELINE['SPARK']``'s ``MASTER``, ``PARTITIONS`` and ``CONF`` entries
    for the run (the Spark session is built with them if this process has none yet).
    ``rules_kind``: ``"simple"`` (five kinds of arithmetic over four numeric columns) or
    ``"realistic"`` (:func:`realistic_rules`)."""
    if tenants < 1 or rows < tenants:
        raise ValueError("the benchmark needs at least one tenant and one row per tenant")
    if rules < 3:
        raise ValueError("the benchmark's tenants have at least 3 rules")
    if rules_kind not in RULE_KINDS:
        raise ValueError(f"unknown kind of rules {rules_kind!r}; known: {', '.join(RULE_KINDS)}")
    if runners < 1:
        raise ValueError("the benchmark needs at least one runner")
    with spark_overrides(master, partitions, spark_conf):
        return _run(
            rows,
            using=using,
            batch_size=batch_size,
            tenants=tenants,
            rules=rules,
            rules_kind=rules_kind,
            contiguous=contiguous,
            direct=direct,
            sql_connections=sql_connections,
            say=say,
            runners=runners,
        )


def _run(
    rows: int,
    *,
    using: str,
    batch_size: int | None,
    tenants: int,
    rules: int,
    rules_kind: str,
    contiguous: bool,
    direct: bool,
    sql_connections: Sequence[int],
    say: Callable[[str], None],
    runners: int = 1,
) -> BenchResult:
    from django_fairqueue.contrib.pipeline.batch_run import BatchOutcome
    from django_fairqueue.contrib.pipeline.runner import PipelineRunner, RunnerGroup, plan

    spark = get_session()
    load = [round(os.getloadavg()[0], 1)]
    name = f"fqbench-{uuid.uuid4().hex[:8]}"
    names = [f"{name}-t{i:02d}" for i in range(tenants)]
    by_tenant = {t: rule_set(rules_kind, i, rules) for i, t in enumerate(names)}
    checked = checked_results(rules_kind, rules)
    cpu = DatabaseCpu(using)
    datastore.drop_table(using, SOURCE)
    datastore.drop_table(using, SINK)
    datastore.create_bench_tables(using, source=SOURCE, sink=SINK)
    layout = "contiguous" if contiguous else "interleaved"
    try:
        say(f"{rows:,} rows: generating the source table ({tenants} tenants, {layout})")
        step = 1_000_000
        for lo in range(1, rows + 1, step):
            datastore.fill_bench_source(
                using, SOURCE, lo, min(rows, lo + step - 1), rows=rows, tenants=names,
                contiguous=contiguous,
            )  # fmt: skip
        datastore.index_bench_source(using, SOURCE)
        datastore.vacuum_analyze(using, SOURCE)

        share = rows // tenants  # a tenant's rows, give or take the hash's spread:
        size = batch_size or share + share // 10 + 1  # one batch per tenant
        pipeline = registry.register(_bench_pipeline(name, size, using, by_tenant, kind=rules_kind))
        other = registry.register(
            _bench_pipeline(f"{name}-direct", size, using, by_tenant, atomic=False, kind=rules_kind)
        )
        try:
            # Warm up: a process's first job costs seconds more than later ones (Spark's
            # start, and the JIT compiling its analyser and code generator for the kinds of
            # rules). The warm-up's rules are of the measured kind but no measured tenant's, so
            # the JVM is warmed and no measured plan is built ahead (plans are per tenant).
            first = {names[0]: rule_set(rules_kind, tenants, rules)}
            warm_before = spark_cpu_seconds()
            for atomic in (True, False):
                warmed = _bench_pipeline(
                    f"{name}-warm{int(atomic)}", 5_000, using, first, atomic=atomic, kind=rules_kind
                )
                warm = registry.register(warmed)
                plan(warm.name)
                PipelineRunner(
                    worker_id=f"bench:{os.getpid()}", pipelines=[warm.name], burst=True,
                    max_batches=2, spark=spark,
                ).run()  # fmt: skip
                registry.unregister(warm.name)
            warm_after = spark_cpu_seconds()
            warm_cpu = _spent(warm_before, warm_after)

            statements = {
                tenant: datastore.insert_with_sql_statement(
                    using,
                    source=SOURCE,
                    id_column="id",
                    tenant_column="tenant",
                    sink=SINK,
                    expressions=baseline_expressions(by_tenant[tenant]),
                )
                for tenant in names
            }
            cores = os.cpu_count() or 1
            timings: dict[int, tuple[float, float | None]] = {}
            for connections in sql_connections or (1, cores):
                if connections in timings:
                    continue
                datastore.truncate(using, SINK)
                say(f"{rows:,} rows: SQL baseline, INSERT ... SELECT per tenant on "
                    f"{connections} connection(s)")  # fmt: skip
                before = cpu.seconds()
                seconds = _baseline(using, statements, rows, connections)
                after = cpu.seconds()
                used = _spent(before, after)
                timings[connections] = (seconds, used)
            expected = _checksums(using, checked)
            serial = timings[1][0] if 1 in timings else None
            parallel = timings[cores][0] if cores in timings else None
            sql_seconds, sql_cpu = min(timings.values(), key=lambda t: t[0])

            def run_spark(chosen: Pipeline) -> dict[str, Any]:
                datastore.truncate(using, SINK)
                outcomes: list[BatchOutcome] = []
                batch_cpu: list[float | None] = []
                before = cpu.seconds()
                spark_before = spark_cpu_seconds()
                last = spark_before

                def finished(outcome: BatchOutcome) -> None:
                    # One runner runs one batch at a time: the CPU since the last batch ended
                    # (or the run began: planning included) is this batch's.
                    nonlocal last
                    outcomes.append(outcome)
                    now = spark_cpu_seconds()
                    batch_cpu.append(_spent(last, now))
                    last = now

                started = time.monotonic()
                planned = plan(chosen.name).planned
                planning = time.monotonic() - started
                say(f"{rows:,} rows: planned in {planning:.1f} s")
                runner = RunnerGroup(
                    runners, worker_id=f"bench:{os.getpid()}", pipelines=[chosen.name],
                    burst=True, spark=spark, on_batch=finished,
                )  # fmt: skip
                stats = runner.run()
                seconds = time.monotonic() - started
                after = cpu.seconds()
                spark_after = spark_cpu_seconds()
                if stats.failed or stats.lost:
                    raise RuntimeError(f"benchmark batches failed: {stats}")
                return {
                    "seconds": seconds,
                    "planning": planning,
                    "batches": sum(p.created for p in planned),
                    "spark": sum(o.spark_seconds for o in outcomes),
                    "merge": sum(o.merge_seconds for o in outcomes),
                    "cpu": _spent(before, after),
                    "spark_cpu": _spent(spark_before, spark_after),
                    "match": _same(_checksums(using, checked), expected) and expected[0] == rows,
                    "timings": [_timing(o) for o in outcomes],
                    "batch_cpu": batch_cpu if runners == 1 else [],
                }

            say(f"{rows:,} rows: Spark pipeline, atomic sink (Spark, staging, fenced merge)")
            atomic_run = run_spark(pipeline)
            direct_run = None
            if direct:
                say(f"{rows:,} rows: Spark pipeline, Sink(atomic=False) (tasks write, fenced)")
                direct_run = run_spark(other)
        finally:
            registry.unregister(name)
            registry.unregister(other.name)
            _forget(using, name, names)
        load.append(round(os.getloadavg()[0], 1))
        return BenchResult(
            rows=rows,
            tenants=tenants,
            rules=rules,
            rules_kind=rules_kind,
            interleaved=not contiguous,
            batches=atomic_run["batches"],
            sql_serial_seconds=round(serial, 2) if serial is not None else None,
            sql_parallel_seconds=round(parallel, 2) if parallel is not None else None,
            sql_seconds=round(sql_seconds, 2),
            spark_seconds=round(atomic_run["seconds"], 2),
            direct_seconds=round(direct_run["seconds"], 2) if direct_run else None,
            sql_rows_per_second=round(rows / sql_seconds),
            spark_rows_per_second=round(rows / atomic_run["seconds"]),
            direct_rows_per_second=round(rows / direct_run["seconds"]) if direct_run else None,
            ratio=round(atomic_run["seconds"] / sql_seconds, 2),
            direct_ratio=round(direct_run["seconds"] / sql_seconds, 2) if direct_run else None,
            plan_seconds=round(atomic_run["planning"], 2),
            spark_phase_seconds=round(atomic_run["spark"], 2),
            merge_seconds=round(atomic_run["merge"], 2),
            sql_db_cpu_us_per_row=_per_row(sql_cpu, rows),
            spark_db_cpu_us_per_row=_per_row(atomic_run["cpu"], rows),
            direct_db_cpu_us_per_row=_per_row(direct_run["cpu"], rows) if direct_run else None,
            spark_cpu_us_per_row=_per_row(atomic_run["spark_cpu"], rows),
            results_match=atomic_run["match"] and (direct_run is None or direct_run["match"]),
            driver_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            jvm_peak_rss_mb=round(jvm_peak_rss_bytes() / 2**20),
            python_workers_peak_rss_mb=round(_workers_rss_bytes() / 2**20),
            load_average=load,
            master=str(spark.sparkContext.master),
            executors=executor_count(),
            executors_measured=len(local_executor_pids()),
            batch_timings=atomic_run["timings"],
            batch_cpu_seconds=[None if c is None else round(c, 2) for c in atomic_run["batch_cpu"]],
            warmup_cpu_seconds=None if warm_cpu is None else round(warm_cpu, 2),
            runners=runners,
        )
    finally:
        datastore.drop_table(using, SOURCE)
        datastore.drop_table(using, SINK)
