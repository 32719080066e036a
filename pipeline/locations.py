"""Where a user's path points: the one resolver of every path a job or a command names.

A path is `builtin:<name>` (a file shipped with the package), a local path (`~` expanded,
relative to the working directory), a URI (`s3://...`, any pyarrow file system) or, for a
model, a hub id (`org/name`, when no local directory has that name). `Location.parse` tells
which once, when the job is loaded, and keeps both the text as written (what summaries and
the output's `model` column show) and what it resolves to on this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import pyarrow.fs as pafs

from spot.builtin import is_builtin, resolve_builtin
from spot.models import hub


class Kind(StrEnum):
    BUILTIN = "builtin"  # a bundled file, resolved to its path in the installed package
    LOCAL = "local"  # a path on this machine's file system
    URI = "uri"  # scheme://...: a pyarrow file system (object storage, HDFS, ...)
    HUB = "hub"  # a model's hub id, downloaded into the Hugging Face cache where needed


GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class Location:
    """A resolved user path."""

    text: str  # as the user wrote it
    kind: Kind
    resolved: str  # absolute local path (builtin, local), the URI, or the hub id

    @classmethod
    def parse(cls, text: object, *, hub_id: bool = False) -> Location:
        """`text` resolved; `hub_id`: it names a model, so `org/name` without a local
        directory of that name is a hub id. Raises ValueError naming what cannot resolve."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"expected a path, got {text!r}")
        if is_builtin(text):
            try:
                return cls(text, Kind.BUILTIN, os.path.abspath(resolve_builtin(text)))
            except (OSError, ValueError) as error:
                reason = error.args[0] if error.args else type(error).__name__
                raise ValueError(f"cannot resolve {text!r}: {reason}") from error
        if "://" in text:
            return cls(text, Kind.URI, text)
        local = os.path.abspath(os.path.expanduser(text))
        if hub_id and hub.is_hub_id(text) and not os.path.isdir(local):
            return cls(text, Kind.HUB, text)
        return cls(text, Kind.LOCAL, local)

    @property
    def is_local(self) -> bool:
        """On this machine's file system (a bundled file or a local path)."""
        return self.kind in (Kind.BUILTIN, Kind.LOCAL)

    @property
    def is_glob(self) -> bool:
        return self.is_local and any(ch in self.resolved for ch in GLOB_CHARACTERS)

    @property
    def portable(self) -> str:
        """How another machine of the cluster finds the same thing: builtins, URIs and hub
        ids as written, local paths absolute."""
        return self.resolved if self.kind == Kind.LOCAL else self.text

    def made_portable(self) -> Location:
        """This location written as `portable` (what a job sent to a cluster holds)."""
        return Location(self.portable, self.kind, self.resolved)

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """The pyarrow file system and the path on it."""
        return pafs.FileSystem.from_uri(self.resolved)

    def cached_checkpoint(self) -> Path | None:
        """The checkpoint directory this machine holds (a hub id from the local Hugging
        Face cache), None when it holds none."""
        if self.kind == Kind.HUB:
            return hub.cached_snapshot(self.resolved)
        if self.is_local and os.path.isdir(self.resolved):
            return Path(self.resolved)
        return None

    def checkpoint(self) -> Path:
        """The checkpoint directory, a hub id downloaded first when this machine has none."""
        found = self.cached_checkpoint()
        if found is not None:
            return found
        if self.kind == Kind.HUB:
            return hub.download(self.resolved)
        raise FileNotFoundError(f"no checkpoint directory at {self.resolved}")

    def __str__(self) -> str:
        return self.text
