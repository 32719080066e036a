"""The click group both command-line tools (`spot-pipeline`, `spot-factory`) are built on."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """A group whose commands live in modules imported on first use (so `--help` starts
    fast): `lazy_commands` maps a command name to "module:attribute"."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            module, attribute = self.lazy_commands[name].split(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)
