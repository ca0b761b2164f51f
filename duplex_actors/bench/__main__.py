"""``python -m duplex_actors.bench [--quick] [--out DIR] [--only NAME]``."""

import typer

from .cli_commands import bench

if __name__ == "__main__":
    typer.run(bench)
