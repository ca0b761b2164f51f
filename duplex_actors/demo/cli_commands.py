"""``duplex-actors demo``: the main job."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        sessions: int = typer.Option(4, help="simulated callers talking at once"),
        seconds: float = typer.Option(45.0, help="how long the callers talk"),
        seed: int = typer.Option(7, help="seeds every random choice of the callers"),
        engine: str = typer.Option("embedded", help="embedded | scripted | vllm"),
        model: str | None = typer.Option(None, help="model path for --engine vllm"),
        json_path: Path | None = typer.Option(Path("out/demo.json"), "--json", help="JSON report path"),
        plot: Path | None = typer.Option(Path("out/demo-timeline.png"), "--plot", help="PNG timeline path"),
        live: bool = typer.Option(True, help="show the live progress view"),
        device: str = typer.Option(
            "cpu", help="where the embedded thinker runs: cpu | cuda | cuda:N | auto (cuda if present)"
        ),
    ) -> None:
        """Run simulated callers in full-duplex conversation with an engine on this machine."""
        import os

        from ..logconfig import ensure_configured

        ensure_configured()  # an entry point: its logging (warnings and up) goes to stderr

        import anyio
        from rich.console import Console

        from .report import print_report
        from .run import DemoOptions, run_demo

        # make_embedded_engine reads it (the demo's engine is built deep inside run_demo).
        os.environ["DUPLEX_EMBEDDED_DEVICE"] = check_device(device)
        console = Console()
        options = DemoOptions(
            sessions=sessions,
            seconds=seconds,
            seed=seed,
            engine=engine,
            model=model,
            json_path=json_path,
            plot_path=plot,
            live=live,
        )
        console.print(
            f"[bold]duplex_actors demo[/]: {sessions} callers, {seconds:.0f} s, engine {engine}, seed {seed}"
            + (f", device {device}" if engine == "embedded" else "")
        )
        report = anyio.run(lambda: run_demo(options, console=console))
        print_report(console, report)
        if json_path:
            console.print(f"JSON report: {json_path}")
        if plot:
            console.print(f"timeline: {plot}")


def check_device(device: str) -> str:
    """``--device``'s value as given, once its form is known good (torch is not imported here:
    the engine resolves "auto" and refuses "cuda" where torch sees none)."""
    if device in ("cpu", "cuda", "auto") or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise typer.BadParameter(f"--device must be cpu, cuda, cuda:N or auto, not {device!r}")
