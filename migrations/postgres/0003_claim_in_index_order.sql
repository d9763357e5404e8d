-- The due rows of one claim, in claim order, locked. The claim walks the
-- pending index in that order and stops after `batch` rows, whatever the
-- planner believes about the table: without fresh statistics (a backlog that
-- arrived in a burst, before autoanalyze saw it) it estimates a few dozen
-- queued rows and would rather fetch them all and sort them, which for a real
-- backlog means sorting all of it on every claim. With sorting disabled while
-- this function runs, the ordered index scan is the one plan left.
CREATE FUNCTION tablemail_due(batch integer) RETURNS SETOF bigint
LANGUAGE sql VOLATILE ROWS 100
SET enable_sort = off
AS $$
    SELECT id FROM mail_queue
    WHERE status = 'queued' AND send_at <= now()
    ORDER BY priority DESC, send_at, id
    LIMIT batch
    FOR UPDATE SKIP LOCKED
$$;
