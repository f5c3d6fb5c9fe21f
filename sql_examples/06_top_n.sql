-- Top-N with LIMIT over the deduplicated view.
SELECT id, amount
FROM events
ORDER BY amount DESC, id
LIMIT 5;
