-- The due rows of one claim, in claim order, locked, each with the octets of
-- its text columns (addresses, subject, bodies, headers): the claim brings
-- the columns of the rows within its inline limit and only the sizes of the
-- others, read here once per row while the row is at hand.
--
-- The claim walks the pending index in that order and stops after `batch`
-- rows, whatever the planner believes about the table: without fresh
-- statistics (a backlog that arrived in a burst, before autoanalyze saw it)
-- it estimates a few dozen queued rows and would rather fetch them all and
-- sort them, which for a real backlog means sorting all of it on every
-- claim. With sorting disabled while this function runs, the ordered index
-- scan is the one plan left.
CREATE FUNCTION tablemail_due(batch integer)
RETURNS TABLE (id bigint, content_bytes bigint)
LANGUAGE sql VOLATILE ROWS 100
SET enable_sort = off
AS $$
    SELECT id,
           (COALESCE(octet_length(body), 0) + COALESCE(octet_length(body_html), 0)
            + COALESCE(octet_length(from_name), 0) + COALESCE(octet_length(from_address), 0)
            + octet_length(to_address) + COALESCE(octet_length(cc), 0)
            + COALESCE(octet_length(bcc), 0) + COALESCE(octet_length(reply_to), 0)
            + octet_length(subject) + COALESCE(pg_column_size(headers), 0))::int8
    FROM mail_queue
    WHERE status = 'queued' AND send_at <= now()
    ORDER BY priority DESC, send_at, id
    LIMIT batch
    FOR UPDATE SKIP LOCKED
$$;
