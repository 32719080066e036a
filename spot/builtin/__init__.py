"""Files that ship inside the package: the bundled tokenizer, trained targets and prompt sets.

`builtin:<name>` in a job file or on the command line names one of them; `resolve_builtin`
turns the name into a local path, so bundled targets load like any checkpoint directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from spot.drafters.registry import drafter_kind

PREFIX = "builtin:"
_KINDS = ("targets", "prompts", "tokenizer", "drafters")


def builtin_root() -> Path:
    """The folder of the bundled files (tokenizer, prompts, targets, drafters)."""
    return Path(str(resources.files(__package__)))


def resolve_builtin(name: str) -> Path:
    """Path of a bundled resource.

    `name` is `<target>` (e.g. "sdar-tiny", a checkpoint directory under targets/), or
    `<kind>/<file or dir>` (e.g. "prompts/heldout.jsonl", "tokenizer"); a leading "builtin:"
    is accepted. Raises FileNotFoundError naming what is available.
    """
    name = name.removeprefix(PREFIX).strip("/")
    root = builtin_root()
    candidates = [root / name] if name.split("/")[0] in _KINDS else [root / "targets" / name]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(
        f"no bundled resource {name!r}; bundled targets: {', '.join(builtin_targets()) or 'none'}"
    )


def builtin_targets() -> list[str]:
    """Names of the bundled target checkpoints."""
    targets = builtin_root() / "targets"
    if not targets.is_dir():
        return []
    return sorted(p.name for p in targets.iterdir() if (p / "config.json").is_file())


def is_builtin(reference: str) -> bool:
    return reference.startswith(PREFIX)


def builtin_drafter(target: str, kind: str, block_length: int, rule: str = "static") -> Path:
    """The bundled drafter of `kind` for a bundled target, its block length and rule."""
    target = target.removeprefix(PREFIX)
    name = drafter_kind(kind).file_name(block_length, rule)
    path = builtin_root() / "drafters" / target / name
    if not path.is_file():
        have = sorted(p.name for p in path.parent.glob("*")) if path.parent.is_dir() else []
        raise FileNotFoundError(
            f"no bundled {kind} drafter for {target} with block length {block_length} and the "
            f"{rule} rule (bundled for {target}: {', '.join(have) or 'none'})"
        )
    return path
