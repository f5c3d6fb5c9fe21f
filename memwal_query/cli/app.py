"""The ``memwal`` click group, its error handling and the helpers every command uses.

Every error a user can cause prints one line, ``error: TypeName: message`` (the message
with its causes, see :func:`error_text`), and exits with status 1; a usage error prints
``error: message (see 'memwal CMD -h')`` and exits with status 2; Ctrl-C (or SIGTERM)
prints ``interrupted`` with what was already done (:func:`record_done`) and exits with
status 130. ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from memwal_query.exceptions import without_source_locations

_CAUSED_BY = re.compile(r"^\s*caused by:?\s*$", re.IGNORECASE)


def _clean(text: str) -> str:
    """``text`` on one line: source locations and ``caused by`` lines dropped, the other
    lines joined with ``": "``."""
    lines = [without_source_locations(line).strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not _CAUSED_BY.match(line)]
    return ": ".join(line.rstrip(":") if i < len(kept) - 1 else line for i, line in enumerate(kept))


def error_text(e: BaseException) -> str:
    """``TypeName: message`` of ``e``, with the messages of its causes, on one line.

    A multi-line message (DataFusion's ``... failed\\ncaused by\\nCast error: ...``)
    keeps every line; an explicit cause (``raise ... from cause``) whose message the error
    does not already quote follows as ``(caused by TypeName: message)``. Library source
    locations are left out.
    """
    text = _clean(str(e)) or repr(e)
    seen = {id(e)}
    cause = e.__cause__
    while cause is not None and id(cause) not in seen and len(seen) < 8:
        seen.add(id(cause))
        more = _clean(str(cause))
        if more and more not in text:
            text += f" (caused by {type(cause).__name__}: {more})"
        cause = cause.__cause__
    return f"{type(e).__name__}: {text}"


def record_done(what: str) -> None:
    """Note that the running command finished ``what`` (e.g. ``merged region r1``): an
    interruption (Ctrl-C) then says what was already done."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        obj = ctx.find_root().obj
        if isinstance(obj, dict):
            obj.setdefault("done", []).append(what)


def _interrupted(obj: Any) -> str:
    done = (obj or {}).get("done", []) if isinstance(obj, dict) else []
    if not done:
        return "error: interrupted (nothing was completed)"
    shown = "; ".join(done[:10]) + (f"; and {len(done) - 10} more" if len(done) > 10 else "")
    return f"error: interrupted; already done: {shown}"


def _handle_errors(fn: Callable) -> Callable:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, BrokenPipeError):
            raise
        except BaseException as e:  # noqa: BLE001
            # Exceptions, and a panic of Lance's Rust side (pyo3's PanicException is a
            # BaseException); not an interrupt or an exit
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            if (ctx.find_root().obj or {}).get("debug"):
                raise
            click.echo(f"error: {error_text(e)}", err=True)
            sys.exit(1)

    return wrapper


class _Command(click.Command):
    """A command whose ``--help`` shows its docstring without reST's double backticks
    (the docstring is written for the API docs too: ``--region`` reads --region)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = self.help.replace("``", "")


class _OneLineErrorGroup(click.Group):
    """A command group whose usage errors also print one line and exit non-zero.

    Click's own rendering of a usage error (bad option value, unknown command, missing
    argument) is three lines; here it is ``error: <message> (see 'memwal CMD -h')`` on
    stderr with click's exit status (2). ``memwal`` without a command prints the help.
    Its commands are :class:`_Command`, its subgroups of this class.
    """

    command_class = _Command
    group_class = type

    def main(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        """Run the command line; exit with its status (see the class docs).

        ``--debug`` is accepted anywhere before a ``--`` (``memwal sql --debug URI``): it
        is moved in front of the subcommand, where the group reads it. A closed output
        pipe (``memwal sql ... | head``) ends the command quietly.
        """
        args = _debug_first(list(sys.argv[1:] if args is None else args))
        if kwargs.get("standalone_mode", True) is False:
            return super().main(args, *rest, **kwargs)
        kwargs["standalone_mode"] = False
        obj: dict[str, Any] = {}
        kwargs.setdefault("obj", obj)
        try:
            rv = super().main(args, *rest, **kwargs)
        except BrokenPipeError:
            _quiet_broken_pipe()
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            hint = ""
            ctx = getattr(e, "ctx", None)
            if isinstance(e, click.UsageError) and ctx is not None:
                hint = f" (see '{ctx.command_path} -h')"
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(e.exit_code)
        except (click.Abort, KeyboardInterrupt):
            click.echo(_interrupted(kwargs["obj"]), err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


def _debug_first(args: list[str]) -> list[str]:
    """``args`` with every ``--debug`` before a ``--`` moved to the front."""
    end = args.index("--") if "--" in args else len(args)
    head = [a for a in args[:end] if a != "--debug"]
    if len(head) == end:
        return args
    return ["--debug", *head, *args[end:]]


def _quiet_broken_pipe() -> None:
    """The reader of our stdout went away (``| head``): exit 0 without a traceback (and
    without Python's complaint when it flushes stdout at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (e.g. CliRunner): nothing to silence
        pass
    sys.exit(0)


@click.group(cls=_OneLineErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks (accepted anywhere).")
@click.version_option(package_name="memwal_query", prog_name="memwal")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """memwal: LSM (MemWAL) tables on Lance, queried with SQL."""
    if not isinstance(ctx.obj, dict):
        ctx.obj = {}
    ctx.obj["debug"] = debug


def _open(uri: str):
    from memwal_query.table import MemWalTable

    return MemWalTable.open(uri)


def _regions(table: Any, region: str | tuple[str, ...] | None) -> list[str]:
    """Every region of ``table``, or just the ``--region`` ones (valid ids of existing
    regions; the option may be repeated)."""
    from memwal_query.exceptions import RegionNotFoundError

    wanted = (region,) if isinstance(region, str) else tuple(region or ())
    if not wanted:
        return table.catalog.region_ids()
    try:
        return table.catalog.check_region_ids(wanted)
    except RegionNotFoundError as e:  # a usage error here: exit status 2
        raise click.BadParameter(str(e), param_hint="--region") from e


def _progress(iterable: Any = None, **kwargs: Any) -> Any:
    """A click progress bar on stderr, shown on a terminal only (stdout stays data)."""
    return click.progressbar(iterable, file=sys.stderr, hidden=not sys.stderr.isatty(), **kwargs)
