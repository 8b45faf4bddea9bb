"""The migrate component's tables in the agent's store (created by
:meth:`laminar.migrate.reclaim.ReclaimComponent.start`; :mod:`laminar.migrate.reclaim` re-exports them)."""

from __future__ import annotations

REPLICAS_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS migrate_replicas (
        key TEXT PRIMARY KEY,
        src_node INTEGER NOT NULL,
        src_job TEXT NOT NULL,
        request TEXT NOT NULL,
        ckpt TEXT NOT NULL,
        state TEXT NOT NULL,
        job_id TEXT,
        updated REAL NOT NULL)""",
    # A guard whose source is dead but that found no room yet: when it looks again (survives a
    # restart of the guard's agent).
    """CREATE TABLE IF NOT EXISTS migrate_retry (
        key TEXT PRIMARY KEY,
        attempts INTEGER NOT NULL,
        next_at REAL NOT NULL,
        why TEXT NOT NULL,
        last_error TEXT NOT NULL,
        updated REAL NOT NULL)""",
    # A guard's questions to its source (control op ``needs``): when it was last asked, when it
    # last answered (wall clock), how many questions in a row went unanswered and the last error.
    # Each of this node's jobs' buddy (the node its guard was handed to last), so that a restarted
    # agent still releases it when the job ends or its guard goes elsewhere.
    """CREATE TABLE IF NOT EXISTS migrate_buddies (
        job_id TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        updated REAL NOT NULL)""",
    # A ``release`` this node owes ``node`` for ``key`` (:meth:`laminar.migrate.buddies.Prestage.release`), written
    # before its first try and deleted once ``node`` answered (or it was given up, RELEASE_GIVE_UP_S
    # after ``since``, or ``node`` guards the job again): a restarted agent sends it again.
    """CREATE TABLE IF NOT EXISTS migrate_releases (
        node INTEGER NOT NULL,
        key TEXT NOT NULL,
        since REAL NOT NULL,
        last_error TEXT NOT NULL,
        PRIMARY KEY (node, key))""",
    """CREATE TABLE IF NOT EXISTS migrate_guard_checks (
        key TEXT PRIMARY KEY,
        asked REAL NOT NULL,
        answered REAL,
        unanswered INTEGER NOT NULL,
        last_error TEXT NOT NULL)""",
    # Who handed this node the guard of ``key`` last (``node``: the key's own node, or a node
    # that passed the guard on or placed the taken-over job here): with the key's node, the only
    # one that may change or release the guard, send its checkpoints or have its job run here as
    # root (laminar.zone.authority). No row: the guard row's src_node handed it (an older agent's).
    """CREATE TABLE IF NOT EXISTS migrate_guard_from (
        key TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        updated REAL NOT NULL)""",
    # A guard's placement of the job it takes over whose hand-over to ``node`` (placement ``pid``,
    # ``request``) may have been sent and was not answered yet: a restart asks the node before
    # any other take-over of the key (:meth:`ReclaimComponent._restore_replica_handovers`).
    """CREATE TABLE IF NOT EXISTS migrate_replica_handovers (
        key TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        pid INTEGER NOT NULL,
        request TEXT NOT NULL,
        updated REAL NOT NULL)""",
]

RECLAIM_SCHEMA = [
    # This node's reclaim (one row): its window's end in wall-clock time, so that an agent
    # restarted inside the window restores it, and one started after it clears it.
    """CREATE TABLE IF NOT EXISTS migrate_reclaim (
        node INTEGER PRIMARY KEY,
        notice_s REAL NOT NULL,
        reason TEXT NOT NULL,
        announced REAL NOT NULL,
        deadline REAL NOT NULL)""",
    # What the reclaim did to a job that must not be done twice after a restart: ``frozen`` (its
    # move froze it), ``handover`` (its hand-over to ``node`` was sent), ``placing`` (a queued
    # job's placement elsewhere was asked for and not settled).
    """CREATE TABLE IF NOT EXISTS migrate_reclaim_jobs (
        job_id TEXT PRIMARY KEY,
        phase TEXT NOT NULL,
        node INTEGER,
        updated REAL NOT NULL)""",
    # A reclaimed job's copy to the archive that may go on past its window's wait (no holder, no
    # buddy: the archive is its only keeper; ArchiveMixin._archive_until with ``late_ok``), written
    # before the copy starts: ``late`` 1 once the job is stopped for it (its wait over),
    # ``publishing`` 1 (written on the archive's thread, committed) right before its record is
    # renamed into place. A restart takes up a late copy of a job still ``reclaimed`` whose record
    # was never put in place, and never publishes one twice (ArchiveMixin._restore_late_copies).
    """CREATE TABLE IF NOT EXISTS migrate_late_copies (
        key TEXT PRIMARY KEY,
        job_id TEXT NOT NULL,
        ckpt TEXT NOT NULL,
        record TEXT NOT NULL,
        late INTEGER NOT NULL,
        publishing INTEGER NOT NULL,
        since REAL NOT NULL)""",
    # A ``handover`` row's hand-over (its placement id ``pid`` at the node, the ``request`` sent):
    # a restart that settles a cancelled reclaim asks the node with it (:meth:`ReclaimComponent._settle_cancelled`).
    """CREATE TABLE IF NOT EXISTS migrate_reclaim_handovers (
        job_id TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        pid INTEGER NOT NULL,
        request TEXT NOT NULL,
        updated REAL NOT NULL)""",
]

MOVES_SCHEMA = [
    # A move without a window (a loan return's, Airlock's re-address: ``move_now``/``readdress``)
    # under way, so that a restart settles what a stop or crash cut (:meth:`ReclaimComponent._restore_moves`):
    # ``frozen`` (written before the freeze: it thaws the job, ``thaw`` 1 when the move froze it),
    # ``handover`` (its hand-over to ``node`` under placement ``pid`` may have been sent: ``request``
    # is what was handed over, asked again there until the node answers whether it runs the job).
    """CREATE TABLE IF NOT EXISTS migrate_moves (
        job_id TEXT PRIMARY KEY,
        phase TEXT NOT NULL,
        reason TEXT NOT NULL,
        thaw INTEGER NOT NULL,
        node INTEGER,
        pid INTEGER,
        request TEXT,
        updated REAL NOT NULL)""",
]
