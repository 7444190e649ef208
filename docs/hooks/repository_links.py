"""An mkdocs hook for links from the manual to the repository's own files (benchmarks/README.md,
examples/*.py, tests/README.md): they work where the Markdown is read in the repository, but lie outside
the site, where mkdocs would call them not found. This hook checks each one instead: the file must exist
in the repository, and an anchor into a Markdown file must name one of its headings (GitHub's slugs),
else the build warns, which `mkdocs build --strict` makes an error. In the site the link becomes the
file's path in code (and the heading's title for an anchor): there is no repository host to link to.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.repository_links")

FENCE = re.compile(r"^( *)(```|~~~).*?^\1\2[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()  # the rendered text: no code or emphasis marks
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> dict[str, str]:
    """A Markdown file's headings outside code blocks, by GitHub slug (repeats get -1, -2, ...)."""
    found: dict[str, str] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6} +(.+?) *#* *$", line)
        if match:
            slug = base = github_slug(match.group(1))
            count = 0
            while slug in found:
                count += 1
                slug = f"{base}-{count}"
            found[slug] = match.group(1)
    return found


def outside_link(match: re.Match[str], page_dir: Path, docs: Path, repo: Path, where: str) -> str:
    text, target = match.group("text"), match.group("target")
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return match.group(0)  # a URL, an anchor on this page, an absolute path: mkdocs's business
    path_part, _, anchor = target.partition("#")
    resolved = (page_dir / path_part).resolve()
    if resolved == docs or docs in resolved.parents:
        return match.group(0)  # a page of the site: mkdocs checks it
    if repo not in resolved.parents:
        log.warning("%s: link %r leaves the repository", where, target)
        return match.group(0)
    relative = resolved.relative_to(repo).as_posix()
    if not resolved.exists():
        log.warning("%s: link %r names %s, which is not in the repository", where, target, relative)
        return match.group(0)
    title = ""
    if anchor:
        if resolved.suffix != ".md":
            log.warning("%s: link %r has an anchor into a file that is not Markdown", where, target)
        else:
            found = headings(resolved)
            if anchor not in found:
                log.warning(
                    "%s: link %r: %s has no heading with the anchor #%s", where, target, relative, anchor
                )
                return match.group(0)
            title = found[anchor]
    shown = f"`{relative}`" + (f", *{title}*" if title else "")
    if text.strip("`") == relative:
        return shown
    return f"{text} ({shown})"


def rewrite(markdown: str, page_dir: Path, docs: Path, repo: Path, where: str) -> str:
    """Every link out of the site checked and shown as a path, outside code blocks and code spans."""

    def prose(part: str) -> str:
        pieces, last = [], 0
        for span in CODE_SPAN.finditer(part):
            pieces.append(
                LINK.sub(lambda m: outside_link(m, page_dir, docs, repo, where), part[last : span.start()])
            )
            pieces.append(span.group(0))
            last = span.end()
        pieces.append(LINK.sub(lambda m: outside_link(m, page_dir, docs, repo, where), part[last:]))
        return "".join(pieces)

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(prose(markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(prose(markdown[last:]))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    source = docs / page.file.src_path
    return rewrite(markdown, source.parent, docs, repo, page.file.src_path)
