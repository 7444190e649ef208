"""An mkdocs hook: the repository's own pages in the site, and two checks that `mkdocs build --strict`
turns into errors.

- **Pages from the repository.** benchmarks/README.md (with every picture and file it links to under
  benchmarks/), tests/README.md, and each examples/*.py (its source, as a page) become pages of the
  site at the same paths, so that the figures behind every performance claim can be read there. A link
  from a page of docs/ to one of them (`../benchmarks/README.md#...`) is pointed at its page, and the
  links inside them that lead back into docs/ are pointed at those pages.
- **Links.** A relative link to a file that is neither a page of the site nor one of those is an error,
  as is an anchor into a page that names none of its headings: on the site such a link would be dead.
- **Code lines.** A line of a code block longer than CODE_WIDTH characters is an error: the content
  column (docs/stylesheets/wide.css) shows that many at 1400 pixels, and a longer line is cut off.
- **Docstring examples.** An example written as `>>>` lines outside a code block renders as three
  quotes in one another with the code run into one line: a quote inside a quote is an error.

Anchors are GitHub's (mkdocs.yml sets the same slugs), so a link works in the repository and the site.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.repository_links")

FENCE = re.compile(r"^( *)(```|~~~).*?^\1\2[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
# The longest code line the content column shows whole (the project's line length).
CODE_WIDTH = 110
# What becomes a page of the site, from outside docs/.
PAGES = ("benchmarks/README.md", "tests/README.md")
EXAMPLES = "examples"


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()  # the rendered text: no code or emphasis marks
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text: str) -> dict[str, str]:
    """A Markdown text's headings outside code blocks, by GitHub slug (repeats get -1, -2, ...)."""
    found: dict[str, str] = {}
    for line in FENCE.sub("", text).splitlines():
        match = re.match(r"#{1,6} +(.+?) *#* *$", line)
        if match:
            slug = base = github_slug(match.group(1))
            count = 0
            while slug in found:
                count += 1
                slug = f"{base}-{count}"
            found[slug] = match.group(1)
    return found


def _outside_code(markdown: str, replace: Any) -> str:
    """`markdown` with LINK.sub(replace) applied outside code blocks and code spans."""

    def prose(part: str) -> str:
        pieces, last = [], 0
        for span in CODE_SPAN.finditer(part):
            pieces.append(LINK.sub(replace, part[last : span.start()]))
            pieces.append(span.group(0))
            last = span.end()
        pieces.append(LINK.sub(replace, part[last:]))
        return "".join(pieces)

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(prose(markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(prose(markdown[last:]))
    return "".join(out)


def _linked_files(markdown: str, folder: Path, repo: Path) -> list[Path]:
    """The repository files under `folder` that `markdown` (a page of `folder`) links to."""
    found = []

    def note(match: re.Match[str]) -> str:
        target = match.group("target").partition("#")[0]
        if target and not re.match(r"^[a-z][a-z0-9+.-]*:|^/", target):
            path = (folder / target).resolve()
            if path.is_file() and folder in path.parents and path.suffix != ".md":
                found.append(path)
        return match.group(0)

    _outside_code(markdown, note)
    return found


def on_files(files: Files, config: Any) -> Files:
    """Adds the repository's pages, what they link to, and a page per example, at their own paths."""
    repo = Path(config["config_file_path"]).resolve().parent
    for page in PAGES:
        source = repo / page
        files.append(File.generated(config, page, abs_src_path=str(source)))
        for linked in _linked_files(source.read_text(), source.parent, repo):
            uri = linked.relative_to(repo).as_posix()
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(linked)))
    for script in sorted((repo / EXAMPLES).glob("*.py")):
        source = script.read_text().rstrip()
        content = f"# examples/{script.name}\n\n```python\n{source}\n```\n"
        files.append(File.generated(config, f"{EXAMPLES}/{script.stem}.md", content=content))
    return files


def _target_page(resolved: Path, repo: Path, docs: Path) -> str | None:
    """The site path of a repository file a link names, when it is a page of the site or one of its files."""
    if resolved == docs or docs in resolved.parents:
        return resolved.relative_to(docs).as_posix()
    if repo not in resolved.parents:
        return None
    relative = resolved.relative_to(repo).as_posix()
    if relative in PAGES or relative.startswith("benchmarks/"):
        return relative
    if relative.startswith(f"{EXAMPLES}/") and relative.endswith(".py"):
        return relative[: -len(".py")] + ".md"
    return None


def _relative(target: str, page: str) -> str:
    """`target` (a site path) as a link from the page at site path `page`."""
    up = len(Path(page).parent.parts)
    return "/".join([".."] * up + [target]) if up else target


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    src = page.file.src_uri
    # Where the page's own links are read from: its file in docs/, or its place in the repository.
    origin = (
        Path(page.file.abs_src_path).parent if page.file.abs_src_path else (repo / src).parent
    ).resolve()

    def point(match: re.Match[str]) -> str:
        target = match.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return match.group(0)  # a URL, an anchor on this page, an absolute path
        path_part, _, anchor = target.partition("#")
        resolved = (origin / path_part).resolve()
        site = _target_page(resolved, repo, docs)
        generated = files.get_file_from_path(site) if site else None
        if site is None or generated is None:
            log.warning("%s: link %r names a file outside the site: it would be dead there", src, target)
            return match.group(0)
        if anchor and site.endswith(".md"):
            if generated.abs_src_path:
                text = Path(generated.abs_src_path).read_text()
            else:
                text = generated.content_string
            if anchor not in headings(text):
                log.warning("%s: link %r: %s has no heading with the anchor #%s", src, target, site, anchor)
        link = _relative(site, src) + (f"#{anchor}" if anchor else "")
        return f"{match.group('bang')}[{match.group('text')}]({link})"

    for fence in FENCE.finditer(markdown):
        for line in fence.group(0).splitlines():
            if len(line.rstrip()) > CODE_WIDTH:
                log.warning(
                    "%s: a code line of %d characters, over %d: %r", src, len(line), CODE_WIDTH, line[:60]
                )
    return _outside_code(markdown, point)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    # Markdown reads `>>>` as three quotes in one another, and the prompt is gone from the text.
    if re.search(r"<blockquote>\s*<blockquote>", html):
        log.warning(
            "%s: a docstring example renders as quotes, not as code (write `Examples:` and indent the `>>>` "
            "lines under it)",
            page.file.src_uri,
        )
    return html
