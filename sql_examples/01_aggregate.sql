-- Totals per user over the deduplicated view (newest row per event id).
SELECT user_id, count(*) AS events, round(sum(amount), 2) AS total
FROM events
GROUP BY user_id
ORDER BY user_id;
