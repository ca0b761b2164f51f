"""``python -m duplex_actors.bench [--quick] [--out DIR] [--only NAME]``."""

import typer

from .cli_commands import bench

if __name__ == "__main__":
    from ..logconfig import ensure_configured

    ensure_configured()
    typer.run(bench)
