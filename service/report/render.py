"""Renders the memo's blocks (("h1", text), ("p", text), ("ul", items), ("table", header, rows),
("img", chart name, caption)) as Markdown and as one self-contained HTML page (charts inlined as base64
PNG), so both say exactly the same numbers."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

Block = tuple[Any, ...]


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(bl: list[Block], charts: dict[str, Path], folder: Path) -> str:
    lines: list[str] = []
    for b in bl:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + b[1], ""]
        elif kind == "p":
            lines += [b[1], ""]
        elif kind == "ul":
            lines += [f"- {item}" for item in b[1]] + [""]
        elif kind == "table":
            lines.append("| " + " | ".join(_md_cell(h) for h in b[1]) + " |")
            lines.append("|" + "---|" * len(b[1]))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b[2]]
            lines.append("")
        elif kind == "img" and b[1] in charts:
            lines += [f"![{b[2]}]({charts[b[1]].relative_to(folder)})", ""]
    return "\n".join(lines)


def _inline(text: str) -> str:
    escaped = html.escape(str(text))
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 6px;"
    "vertical-align:top}th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}"
    "code{background:#f6f6f6}"
)


def to_html(bl: list[Block], charts: dict[str, Path], title: str) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>"
    ]
    for b in bl:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{_inline(b[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in b[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img" and b[1] in charts:
            data = base64.b64encode(charts[b[1]].read_bytes()).decode()
            parts.append(
                f"<figure><img id='chart-{b[1]}' alt='{html.escape(b[2])}' "
                f"src='data:image/png;base64,{data}'><figcaption>{html.escape(b[2])}</figcaption></figure>"
            )
    parts.append("</body></html>")
    return "".join(parts)
