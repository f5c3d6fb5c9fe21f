-- Join the LSM table against an ordinary table.
SELECT u.name, count(*) AS events, round(sum(e.amount), 2) AS total
FROM events e JOIN users u ON e.user_id = u.user_id
GROUP BY u.name
ORDER BY u.name;
