-- A filter on the primary key: region pruning reads only the key's region.
SELECT id, user_id, amount
FROM events
WHERE id IN (1, 2, 3, 500, 1500)
ORDER BY id;
