-- Smaller rows. A row over 2 KB (a text part and an HTML alternative of a
-- few KB: most transactional mail) was compressed by PostgreSQL only as far
-- as needed to fit 2 KB, one column with pglz, and every claim and every
-- outcome copied the row's new version, bodies and all, into the table and
-- into the WAL. Now the bodies are compressed with lz4 until the row fits
-- 1 KB, and a body that still does not fit goes out of line, compressed:
-- for a German order confirmation with its HTML the text stays in the row
-- and the HTML goes to the TOAST table, a row of 0.6 KB instead of 1.5 KB.
-- A mail then writes 1.9 KB of WAL instead of 3.8 KB, an UPDATE of its row
-- is a quarter cheaper, the application's INSERT and the claim's read of
-- the bodies too (measured: README, Performance). Kept in the row, both
-- compressed (a target of 1280 bytes), the rows were 1.1 KB and the drain
-- cost the database more. Only values written from now on are stored so.
ALTER TABLE mail_queue SET (toast_tuple_target = 1024);

-- lz4 needs PostgreSQL 14 built with it (Debian's PostgreSQL 15, used
-- here, is); without it the bodies stay with pglz.
DO $$
BEGIN
    IF current_setting('server_version_num')::int >= 140000 THEN
        EXECUTE 'ALTER TABLE mail_queue
                     ALTER COLUMN body SET COMPRESSION lz4,
                     ALTER COLUMN body_html SET COMPRESSION lz4';
    END IF;
EXCEPTION WHEN feature_not_supported THEN
    NULL;
END
$$;
