"""Running planned image builds with progress, for ``build-images`` and ``build-images --swe``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.markup import escape

from prorl_cli.cli.application import App
from prorl_cli.cli.common import interrupt_signals, interruption

if TYPE_CHECKING:
    from prorl_cli.images.build import Result


def size_text(n: int) -> str:
    """A size in bytes as megabytes."""
    return f"{n / 1e6:.1f} MB"


def run_builds(app: App, plans: list[Any], cache: Any, settings: Any, console: Any) -> list[Result]:
    """Build (or reuse) every planned image, with a live line per image; print each outcome."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from prorl_cli.images.build import Builder

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                        disable=not console.is_terminal)
    tasks: dict[str, Any] = {}

    def on_event(name: str, message: str) -> None:
        progress.console.print(f"[bold]{name}[/]: {escape(message)}", markup=True, highlight=False, soft_wrap=True)
        if name in tasks:
            progress.update(tasks[name], description=f"{name}: {message[:80]}")

    builder = Builder(cache, apptainer=settings.apptainer, timeout_s=settings.build_timeout_s, on_event=on_event)
    with interrupt_signals():
        try:
            with progress:
                for p in plans:
                    tasks[p.spec.name] = progress.add_task(f"{p.spec.name}: waiting", total=None)
                results = builder.run(plans, settings.jobs)
        except KeyboardInterrupt as e:
            how, code = interruption(e)
            app.abort(f"{how}: running builds stopped, no image published", code=code)
    for r in results:
        if r.action == "built":
            console.print(f"[bold]{r.name}[/]: [green]built[/] in {r.build_s:.1f} s, {size_text(r.size_bytes)} → {r.path}", soft_wrap=True)
        elif r.action == "reused":
            waited = f" after waiting {r.waited_s:.1f} s ({escape(r.reasons[0])})" if r.waited_s >= 0.05 else ""
            console.print(f"[bold]{r.name}[/]: [green]reused[/]{waited} → {escape(r.path)}", soft_wrap=True)
        elif r.action == "skipped":
            console.print(f"[bold]{r.name}[/]: [yellow]skipped[/]: {escape('; '.join(r.reasons))}", soft_wrap=True)
        else:
            console.print(f"[bold]{r.name}[/]: [bold red]FAILED[/]: {escape(r.error or '')}", markup=True, soft_wrap=True)
            if r.log_tail:
                console.rule(f"last {len(r.log_tail)} lines of apptainer's output")
                console.print("\n".join(r.log_tail), markup=False, soft_wrap=True)
                console.rule()
                console.print(f"full log: {r.log}", markup=False, soft_wrap=True)
    return results
