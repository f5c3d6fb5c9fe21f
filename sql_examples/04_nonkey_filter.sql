-- A filter on a non-key column is evaluated on the newest version of each row (the
-- first 20 matches by id: about two thirds of the demo's rows match).
SELECT id, amount
FROM events
WHERE amount > 900
ORDER BY id
LIMIT 20;
