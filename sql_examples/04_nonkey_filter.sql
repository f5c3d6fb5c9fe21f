-- A filter on a non-key column is evaluated on the newest version of each row.
SELECT id, amount
FROM events
WHERE amount > 900
ORDER BY id;
