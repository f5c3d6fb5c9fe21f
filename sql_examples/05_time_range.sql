-- A time range on the region column of `logs` (identity(day) regions): days outside the
-- range are pruned.
SELECT day, count(*) AS n, max(level) AS worst
FROM logs
WHERE day >= DATE '2026-01-03' AND day < DATE '2026-01-05'
GROUP BY day
ORDER BY day;
