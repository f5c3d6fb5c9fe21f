"""``python -m memwal_query`` is the ``memwal`` command line."""

from __future__ import annotations

from memwal_query.cli.commands import main

if __name__ == "__main__":
    main()
