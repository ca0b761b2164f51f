"""The ``duplex-actors`` command line.

Sub-commands live next to the part they drive (``server``, ``bench``, ``tooling``, ``demo``)
and register themselves here; a part whose extra is not installed simply has no command, and
says which extra to install when asked for.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="duplex_actors: a runtime for full-duplex speech sessions.",
)

# (module, register function, extra that provides it)
_PARTS = (
    ("duplex_actors.demo.cli_commands", "register", "embedded"),
    ("duplex_actors.server.cli_commands", "register", "server"),
    ("duplex_actors.bench.cli_commands", "register", None),
    ("duplex_actors.bench.soak", "register_soak", None),
    ("duplex_actors.tooling.cli_commands", "register", None),
)


@app.callback()
def _root() -> None:
    """duplex_actors: a runtime for full-duplex speech sessions."""
    # The command line is an application: it sets up logging (warnings and up, unless
    # structlog was configured already), which importing the library never does.
    from .logconfig import ensure_configured

    ensure_configured()


@app.command()
def version() -> None:
    """Print the installed version."""
    from . import __version__

    typer.echo(__version__)


def _register_parts() -> None:
    for module_name, function, _extra in _PARTS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A part that is not there, or whose extra is not installed, has no command.
            if exc.name and (exc.name.startswith("duplex_actors") or _extra is not None):
                continue
            raise
        getattr(module, function)(app)


_register_parts()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
