"""Checks shared by the cluster-manifest tests: files a manifest names exist, commands it runs exist,
and nothing in it is open to the whole internet."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# A repo-relative path as manifests write them (in commands and in comments alike).
_PATH = re.compile(
    r"(?<![\w/~.])((?:experiments|search_spaces|deploy|service|tests)/[\w./-]*\w"
    r"(?:\.yaml|\.yml|\.py|\.sh|\.json|\.gz|/Dockerfile))"
)
_COMMAND = re.compile(r"python3? -m service ([a-z][\w-]*)")
_OPEN_TO_ALL = ("0.0.0.0/0", "::/0")


def referenced_paths(text: str) -> list[str]:
    return sorted(set(_PATH.findall(text)))


def missing_paths(text: str) -> list[str]:
    return [p for p in referenced_paths(text) if not (ROOT / p).exists()]


def service_commands(text: str) -> list[str]:
    return sorted(set(_COMMAND.findall(text)))


def unknown_commands(text: str) -> list[str]:
    from service.cli.main import COMMANDS

    return [c for c in service_commands(text) if c not in COMMANDS]


def open_to_all(text: str) -> list[str]:
    return [cidr for cidr in _OPEN_TO_ALL if cidr in text]


def walk(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (dotted path, value) pair of a YAML document."""
    out = [(path, node)]
    if isinstance(node, dict):
        for k, v in node.items():
            out += walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += walk(v, f"{path}[{i}]")
    return out
