"""The ``memwal`` command line (click): see :mod:`memwal_query.cli.commands`."""

from memwal_query.cli.commands import main

__all__ = ["main"]
