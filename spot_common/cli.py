"""The click group both command-line tools (`spot-pipeline`, `spot-factory`) are built on."""

from __future__ import annotations

import importlib

import click
from click.utils import make_default_short_help


class LazyGroup(click.Group):
    """A group whose commands live in modules imported on first use, so `--help` starts
    fast: `lazy_commands` maps a command name to "module:attribute", and `summaries` a
    command name to the line the group's `--help` lists it with (the command's own short
    help; a command without one there is imported to list it)."""

    def __init__(
        self,
        *args,
        lazy_commands: dict[str, str],
        summaries: dict[str, str] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands
        self.summaries = summaries or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            module, attribute = self.lazy_commands[name].split(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their short help, as click lists them, importing none of the
        lazy commands that `summaries` describes."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in self.lazy_commands and name in self.summaries:
                rows.append((name, make_default_short_help(self.summaries[name], limit)))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)
