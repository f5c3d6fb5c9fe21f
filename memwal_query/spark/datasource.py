"""The ``memwal`` data source class, in a module that imports neither lance nor pyarrow.

Spark asks a Python process for the data source at ``.load()`` (PySpark's
``create_data_source`` worker): it imports the class from here, and, unless the caller
gave a schema (:func:`memwal_query.spark.read` gives the one it computed in the
driver), calls :meth:`MemWalDataSource.schema`, which opens the table. With a schema
that process imports no lance, pyarrow or reader module at all. The reader lives in
:mod:`memwal_query.spark.source`, imported when Spark asks for one.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader
from pyspark.sql.types import StructType

from memwal_query.exceptions import MemWalError
from memwal_query.spark._common import is_changes_read, option

FORMAT = "memwal"


class MemWalDataSource(DataSource):
    """The ``memwal`` data source (``spark.read.format("memwal").load(uri)``).

    Options: ``path`` (the ``load`` argument), ``columns`` (comma-separated subset),
    ``consistency`` (``latest`` (default)/``strong``/``eventual``), ``rows_per_split`` (rows per
    partition; partitions are balanced), ``push_filters`` (``true`` to enable filter
    pushdown: only for a DataFrame that runs a single query reading it once, see
    :mod:`memwal_query.spark.source`), ``as_of`` (time travel:
    a base version or ISO timestamp), ``changes_since`` (the change feed, see
    :mod:`memwal_query.spark.changes`; also a Structured Streaming source),
    ``storage.<key>`` (object-store options; Spark passes option names lower-cased).
    """

    @classmethod
    def name(cls) -> str:
        """Format name: ``memwal``."""
        return FORMAT

    def _uri(self) -> str:
        uri = self.options.get("path")
        if not uri:
            raise MemWalError('memwal data source: give the table URI: .load("/path")')
        return uri

    def schema(self) -> StructType:
        """The table schema (or the ``columns`` option's subset), as Spark types.

        Spark asks for it at ``.load()`` unless the caller gave a schema: the table and
        the options are checked here
        (:func:`~memwal_query.spark.source.check_read`), so a bad option or a missing
        table fails at ``.load()``, with a one-frame traceback ending in the typed error.
        """
        from memwal_query.spark import source
        from memwal_query.spark._common import _spark_schema

        try:
            table, schema = source.check_read(self._uri(), self.options)
        except MemWalError as e:
            raise e.with_traceback(None) from None  # Spark prints the traceback: keep it short
        if is_changes_read(self.options):
            from memwal_query.spark import changes as _changes

            return _changes.spark_changes_schema(table)
        return _spark_schema(schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader returning ``schema``'s columns."""
        from memwal_query.spark import source

        options = {k.lower(): v for k, v in self.options.items()}
        if is_changes_read(options):
            from memwal_query.spark import changes as _changes

            return _changes.MemWalChangesReader(self._uri(), options, schema)
        # Opt-in: Spark shares a pushed-down reader with later queries (module docs).
        pushdown = str(option(options, "push_filters", "pushfilters", "false")).lower() == "true"
        cls = source.MemWalPushdownReader if pushdown and source._FILTERS else source.MemWalReader
        return cls(self._uri(), options, schema)

    def streamReader(self, schema: StructType) -> Any:  # noqa: N802 - PySpark's name
        """Structured Streaming source of the change feed (:mod:`memwal_query.spark.changes`)."""
        from memwal_query.spark import changes as _changes

        return _changes.MemWalChangesStreamReader(self._uri(), dict(self.options), schema)
