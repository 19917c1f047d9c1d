"""Every table the controller stores, in one place: the schema steps, in order, that
`store.SQLiteStore` and `store.PostgresStore` run once each (`fleet_migrations` records
them). The queries that read and write these tables are `sql.SQLStore` (devices,
messages, commands), `rollout_queries.RolloutQueries` (rollouts) and
`retention.RetentionQueries` (what retention removed) and `slo.SLOQueries` (the
service levels over time).

| table | one row per | written by |
|---|---|---|
| `devices` | box: online, bdseq, boot, birth, models, retired | ingest, `fleet devices retire` |
| `messages` | message a box sent (device, boot_id, seq) | ingest |
| `dropped` | range of seqs a box's outbox dropped | ingest (outbox.dropped) |
| `duplicates` | box and boot: messages delivered twice | ingest |
| `command_streams` | stream (a device or `all`): its last seq | `fleet send`, the rollout engine |
| `commands` | signed command sent | `fleet send`, the rollout engine |
| `command_results` | command and device: its outcome | ingest (`cmd/result`) |
| `rollouts` | rollout: policy, state, wave | `fleet rollout`, the rollout engine |
| `rollout_devices` | rollout and device: wave, state, progress | the rollout engine, ingest |
| `rollout_commands` | command a rollout sent | the rollout engine |
| `retired` | box and boot: the last seq retention removed | retention |
| `operators` | operator token: name, role, its hash, revoked or not | `fleet operators` |
| `operator_actions` | operator action: who, role, from where, what, outcome | API, CLI |
| `device_registrations` | box expected: its fleet, when and by whom | `fleet devices register` |
| `controllers` | `fleet serve` of the store: leading or not, since when, last seen | itself |
| `slo_intervals` | metrics message and model: requests, TTFT/TPOT, feedback | ingest (`slo`) |
| `slo_errors` | errors event, model, status and type: how many failed | ingest (`slo`) |
| `slo_minutes` | minute, fleet and model: the boxes' figures added up | ingest (`slo`) |
| `slo_degradations` | minute, fleet, tier, cause and action: degraded requests | ingest (`slo`) |
| `slo_baselines` | production release's rollout: its figures once completed | `review` |
| `slo_totals` | box and model: running sums, latest percentiles (the export's) | ingest (`slo`) |

Types are the ones both databases understand (SQLite maps BIGINT to INTEGER, DOUBLE
PRECISION to REAL); bodies are JSON text, so the two stores read back the same thing. A
step is never edited once released: a change is a new step at the end.
"""

from __future__ import annotations

from edge_agent.fleet.controller.slo import SCHEMA as SLO_SCHEMA

SCHEMA: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("m001_devices_and_messages", (
        """CREATE TABLE devices (
            device TEXT PRIMARY KEY, fleet TEXT NOT NULL, online INTEGER NOT NULL DEFAULT 0,
            bdseq BIGINT, boot_id TEXT, birth TEXT, first_seen DOUBLE PRECISION NOT NULL,
            last_seen DOUBLE PRECISION NOT NULL, last_birth DOUBLE PRECISION,
            last_death DOUBLE PRECISION)""",
        """CREATE TABLE messages (
            device TEXT NOT NULL, boot_id TEXT NOT NULL, seq BIGINT NOT NULL,
            fleet TEXT NOT NULL, kind TEXT NOT NULL, class TEXT NOT NULL,
            ts DOUBLE PRECISION NOT NULL, received DOUBLE PRECISION NOT NULL,
            body TEXT NOT NULL, PRIMARY KEY (device, boot_id, seq))""",
        "CREATE INDEX messages_by_kind ON messages (device, kind, ts)",
        """CREATE TABLE dropped (
            device TEXT NOT NULL, boot_id TEXT NOT NULL, first_seq BIGINT NOT NULL,
            last_seq BIGINT NOT NULL, reported DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (device, boot_id, first_seq, last_seq))""",
    )),
    ("m002_commands", (
        "CREATE TABLE command_streams (stream TEXT PRIMARY KEY, last_seq BIGINT NOT NULL)",
        """CREATE TABLE commands (
            id TEXT PRIMARY KEY, fleet TEXT NOT NULL, target TEXT NOT NULL,
            type TEXT NOT NULL, seq BIGINT NOT NULL, issued_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL,
            recorded DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE command_results (
            id TEXT NOT NULL, device TEXT NOT NULL, type TEXT, status TEXT NOT NULL,
            reason TEXT, result TEXT, received DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (id, device))""",
    )),
    ("m003_rollouts", (
        """CREATE TABLE rollouts (
            id TEXT PRIMARY KEY, name TEXT NOT NULL, version TEXT NOT NULL,
            selector TEXT NOT NULL, waves TEXT NOT NULL, abort_above DOUBLE PRECISION NOT NULL,
            min_executed BIGINT NOT NULL, soak_s DOUBLE PRECISION NOT NULL,
            device_timeout_s DOUBLE PRECISION NOT NULL, rollback_on_abort INTEGER NOT NULL,
            state TEXT NOT NULL, live INTEGER NOT NULL, settled INTEGER NOT NULL DEFAULT 0,
            wave BIGINT NOT NULL DEFAULT 0, waves_total BIGINT NOT NULL,
            devices_total BIGINT NOT NULL, reason TEXT, wave_started_at DOUBLE PRECISION,
            created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)""",
        "CREATE UNIQUE INDEX rollouts_one_live_per_name ON rollouts (name) WHERE live = 1",
        "CREATE INDEX rollouts_unsettled ON rollouts (settled, created_at)",
        """CREATE TABLE rollout_devices (
            rollout_id TEXT NOT NULL, device TEXT NOT NULL, fleet TEXT NOT NULL,
            wave BIGINT NOT NULL, state TEXT NOT NULL, retrying INTEGER NOT NULL DEFAULT 0,
            reason TEXT, command_id TEXT, started_at DOUBLE PRECISION,
            active_at DOUBLE PRECISION, finished_at DOUBLE PRECISION, outcome TEXT,
            reported_ts DOUBLE PRECISION, updated_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (rollout_id, device))""",
        "CREATE INDEX rollout_devices_by_command ON rollout_devices (command_id)",
        """CREATE TABLE rollout_commands (
            command_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, device TEXT NOT NULL,
            type TEXT NOT NULL, recorded DOUBLE PRECISION NOT NULL,
            published_at DOUBLE PRECISION, withdrawn_at DOUBLE PRECISION)""",
        "CREATE INDEX rollout_commands_by_rollout ON rollout_commands (rollout_id, device)",
    )),
    ("m004_rollout_progress", tuple(
        f"ALTER TABLE rollout_devices ADD COLUMN {column}" for column in (
            "progress_bytes BIGINT", "progress_total BIGINT",
            "progress_rate_bps DOUBLE PRECISION", "progress_eta_s DOUBLE PRECISION",
            "progress_ts DOUBLE PRECISION"))),
    ("m005_retention", (
        """CREATE TABLE retired (
            device TEXT NOT NULL, boot_id TEXT NOT NULL, last_seq BIGINT NOT NULL,
            PRIMARY KEY (device, boot_id))""",
        "CREATE INDEX messages_by_age ON messages (class, received)",
    )),
    # A box's models as its latest birth or models.state event says, and when it said
    # so (the box's clock): the newer of the two is the view.
    ("m006_device_models", (
        "ALTER TABLE devices ADD COLUMN models TEXT",
        "ALTER TABLE devices ADD COLUMN models_ts DOUBLE PRECISION",
    )),
    # Duplicates dropped, per device and boot: loss accounting's other half.
    ("m007_duplicates", (
        """CREATE TABLE duplicates (
            device TEXT NOT NULL, boot_id TEXT NOT NULL, count BIGINT NOT NULL,
            PRIMARY KEY (device, boot_id))""",
    )),
    # The people who run the fleet from their desks: one row per token (`operators`).
    ("m008_operators", (
        """CREATE TABLE operators (
            prefix TEXT PRIMARY KEY, name TEXT NOT NULL, role TEXT NOT NULL,
            hash TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
            revoked DOUBLE PRECISION)""",
        "CREATE UNIQUE INDEX operators_one_live_per_name ON operators (name) "
        "WHERE revoked IS NULL",
    )),
    # Who did what (`audit`): appended to, never updated, not purged by retention (which
    # removes the boxes' audit *messages*, a different thing).
    ("m009_audit", (
        """CREATE TABLE operator_actions (
            id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL, operator TEXT NOT NULL,
            role TEXT NOT NULL, source TEXT NOT NULL, action TEXT NOT NULL, target TEXT,
            request TEXT NOT NULL, status INTEGER NOT NULL, outcome TEXT NOT NULL)""",
        "CREATE INDEX operator_actions_by_time ON operator_actions (at)",
        "CREATE INDEX operator_actions_by_operator ON operator_actions (operator, at)",
    )),
    # A box an admin took out of service: kept, left out of rollouts (`fleet devices retire`).
    ("m010_device_retirement", (
        "ALTER TABLE devices ADD COLUMN retired DOUBLE PRECISION",
        "ALTER TABLE devices ADD COLUMN retired_by TEXT",
    )),
    # A box an admin expects before it first reports (`fleet devices register`): listed
    # as never seen until its birth, never selected by a rollout before it.
    ("m011_device_registrations", (
        """CREATE TABLE device_registrations (
            device TEXT PRIMARY KEY, fleet TEXT NOT NULL,
            registered DOUBLE PRECISION NOT NULL, registered_by TEXT NOT NULL)""",
    )),
    # Each `fleet serve` of the store, as it last said (`leadership`: `fleet controllers`).
    ("m012_controllers", (
        """CREATE TABLE controllers (
            controller TEXT PRIMARY KEY, leader INTEGER NOT NULL,
            leader_since DOUBLE PRECISION, started DOUBLE PRECISION NOT NULL,
            last_seen DOUBLE PRECISION NOT NULL, pid BIGINT, host TEXT)""",
    )),
    # A capacity release (`fleet rollout start … --capacity parallel=8`): the settings it
    # ships, as JSON text; NULL for a model release.
    ("m013_capacity_rollouts", (
        "ALTER TABLE rollouts ADD COLUMN config TEXT",
    )),
    # The service levels over time (`slo`): each metrics message's figures per model, the
    # errors events' counts, and per box and model the running sums and latest figures.
    ("m014_slo_series", SLO_SCHEMA),
)
