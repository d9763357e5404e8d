-- The retention index holds finished rows only, as PostgreSQL's partial
-- index does. Here, without partial indexes, it led with status, so a claim
-- (queued -> sending) and an outcome (sending -> sent) each moved the row's
-- entry in it: four index entries rewritten a mail in the pending and the
-- retention index together. Keyed on a generated column that is NULL until
-- the row is finished, the claim, a retry and a release leave its entry
-- alone; only the outcome that finishes a row moves it. The rows in flight
-- are still found by the status prefix of the pending index (DESIGN §1: the
-- pending rows in claim order, the sending rows for stale-lock sweeps,
-- retention and the unique dedupe key).
--
-- The column is INVISIBLE (MariaDB 10.3+, MySQL 8.0.23+): `SELECT *` and an
-- INSERT without a column list see the table's columns as before, and no
-- one writes it. Two statements, so that the server can take each without
-- blocking writes: adding a virtual column is immediate, and the new index
-- is built by one read of the table while applications' INSERTs go on (a
-- single ALTER that did both would block them on MariaDB).
ALTER TABLE mail_queue
    ADD COLUMN finished_status VARCHAR(16)
        AS (CASE WHEN status NOT IN ('queued', 'sending') THEN status END) VIRTUAL INVISIBLE;
ALTER TABLE mail_queue
    DROP INDEX mail_queue_finished_idx,
    ADD INDEX mail_queue_finished_idx (finished_status, processed_at);
