"""``python -m memwal_query`` is the ``memwal`` command line."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
