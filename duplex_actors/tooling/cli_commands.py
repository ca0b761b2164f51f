"""``duplex-actors statechart`` and ``duplex-actors trace``."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

CHART_FORMATS = ("mermaid", "dot", "svg", "scxml", "json", "review-md")
TRACE_FORMATS = ("mermaid-sequence", "timeline")


def statechart(
    format: str = typer.Option(
        "mermaid", "--format", "-f", help="mermaid | dot | svg | scxml | json | review-md"
    ),
    machine: str | None = typer.Option(
        None,
        "--machine",
        "-m",
        help="session | engine_request | lease | connection; all only with --out (one file per machine)",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="write <machine>.<ext> files into this directory (and a split chart's Mermaid views)",
    ),
    view: str | None = typer.Option(
        None, "--view", help="with --format mermaid: print one state's view of a split chart (session)"
    ),
    check: bool = typer.Option(
        False, "--check", help="fail if statecharts/ or docs/design-review.md drift from the code"
    ),
    write: bool = typer.Option(False, "--write", help="regenerate statecharts/ and docs/design-review.md"),
    root: Path = typer.Option(Path("."), "--root", help="repository root for --check and --write"),
) -> None:
    """Export the runtime's statecharts, drawn from the live transitions Machines."""
    from . import statechart_export as export

    if check:
        problems = export.check(root)
        if problems:
            typer.echo(f"{len(problems)} statechart file(s) drift from the code:", err=True)
            for problem in problems:
                typer.echo(f"  {problem}", err=True)
            typer.echo("regenerate with: duplex-actors statechart --write", err=True)
            raise typer.Exit(1)
        typer.echo("statecharts and docs/design-review.md match the code")
        return
    if write:
        for path in export.write_all(root):
            typer.echo(f"wrote {path}")
        return
    if format not in CHART_FORMATS:
        raise typer.BadParameter(f"unknown format {format!r}; choose from {', '.join(CHART_FORMATS)}")
    if format == "review-md":
        text = export.review_markdown()
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "design-review.md").write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
        return
    if machine is None or (machine == "all" and out is None):
        # Standard output carries one document: several back to back are no valid SCXML, JSON,
        # DOT or Mermaid document, so a reader would choke on the second one.
        typer.echo(
            f"choose one machine with --machine ({', '.join(export.MACHINES)}), "
            "or --machine all with --out DIR for one file each",
            err=True,
        )
        raise typer.Exit(2)
    names = list(export.MACHINES) if machine == "all" else [machine]
    for name in names:
        if name not in export.MACHINES:
            raise typer.BadParameter(
                f"unknown machine {name!r}; choose from {', '.join(export.MACHINES)} or all"
            )
    if view is not None:
        chart = export.spec(names[0])
        states = export.view_states(chart)
        if format != "mermaid" or len(names) != 1 or view not in states:
            raise typer.BadParameter(
                f"--view takes --format mermaid, one split machine and one of its states "
                f"({', '.join(states) or 'this machine has no views'})"
            )
        sys.stdout.write(export.mermaid_view(chart, view))
        return
    for name in names:
        try:
            text = export.render(export.spec(name), format)
        except RuntimeError as exc:  # e.g. Graphviz missing for SVG
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        if out:
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{name}.{export.EXTENSIONS[format]}"
            path.write_text(text, encoding="utf-8")
            typer.echo(f"wrote {path}")
            if format == "mermaid":
                for view_path, view_text in export.view_files(out, export.spec(name)).items():
                    view_path.write_text(view_text, encoding="utf-8")
                    typer.echo(f"wrote {view_path}")
        else:
            sys.stdout.write(text)


def trace(
    logfile: Path = typer.Argument(..., help="JSON-lines structlog output ('-' for stdin)"),
    session: str | None = typer.Option(
        None, "--session", "-s", help="session id (omit to list the sessions in the log)"
    ),
    format: str = typer.Option("mermaid-sequence", "--format", "-f", help="mermaid-sequence | timeline"),
) -> None:
    """Draw one session's recorded transitions as a Mermaid sequence diagram or a timeline."""
    from . import trace as tracing

    if format not in TRACE_FORMATS:
        raise typer.BadParameter(f"unknown format {format!r}; choose from {', '.join(TRACE_FORMATS)}")
    if str(logfile) == "-":
        records = list(tracing.read_records(sys.stdin))
    else:
        with open(logfile, encoding="utf-8") as handle:
            records = list(tracing.read_records(handle))
    if session is None:
        for sid in tracing.sessions_in(records):
            typer.echo(sid)
        return
    try:
        sys.stdout.write(tracing.render_trace(records, session, format))
    except LookupError as exc:
        typer.echo(str(exc.args[0]), err=True)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    app.command("statechart")(statechart)
    app.command("trace")(trace)
