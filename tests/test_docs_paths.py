"""Every repository path the README, the docs pages and the results index name exists in the tree.

A newcomer follows these names; a file that was moved or renamed leaves a dead one. Checked: paths in
inline code (`node/net/relay.py`, `tests/test_tied.py::test_x`, `net/serve.serve` under node/) and
markdown link targets (`[nat](bench/results/nat.md)`, resolved from the page's own folder, as a
renderer does). Not checked, because they are not files of the tree: fenced code blocks (commands,
whose paths are what a run writes), URLs, absolute paths (`/ip4/...`, `/data/state`), anything
outside the repository (`../shared/DESIGN.md`), runtime outputs (`runs/...`) and placeholders or
globs (`FILE`, `OWNER/NAME`, `loss_<task>.png`, `*.md`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A backticked name is a repository path when its first part is one of these (anything else, such as
# OWNER/NAME or report/data/train.jsonl, is a placeholder or a path a run creates).
ROOTS = {"node", "protocol", "compression", "bench", "tests", "docs", "docker", ".ci"}
ROOT_FILES = {"README.md", "Makefile", "pyproject.toml"}
# docs/ARCHITECTURE.md names modules by their path under node/ (`stage/compute.py`, `net/serve.serve`).
NODE_ROOMS = {"net", "model", "swarm", "stage", "dp", "watch", "local"}
# Paths the docs name that a run creates, not the tree.
ALLOW = {
    "bench/results/volunteer_net",  # bench.network.volunteer_net's --report prefix: .md, .json and .png
}

FILE_SUFFIXES = {".md", ".py", ".json", ".png", ".yml", ".yaml", ".txt", ".sh", ".toml", ".html", ".jsonl"}
PATHLIKE = re.compile(r"[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)*/?")
FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "bench" / "results" / "README.md",
    ]


def _exists(path: Path) -> bool:
    """A file or folder, or a module named with an attribute (`net/serve.serve` -> net/serve.py)."""
    if path.exists():
        return True
    if path.suffix in FILE_SUFFIXES:  # a file by its name: no module fallback (harness.md is not harness.py)
        return False
    module = path.with_name(path.name.split(".")[0] + ".py")
    return module.exists() or path.with_name(path.name + ".py").exists()


def named_paths(text: str, page: Path) -> list[tuple[str, Path]]:
    """(as written, where it should be) for every repository path `text` names."""
    text = FENCE.sub("", text)
    found = []
    for span in INLINE.findall(text):
        for token in span.split():
            token = token.split("::")[0].rstrip(",;:)")
            if not PATHLIKE.fullmatch(token) or token in ALLOW:
                continue
            first = token.split("/")[0]
            if first in ROOTS and "/" in token or token in ROOT_FILES:
                found.append((token, ROOT / token))
            elif first in NODE_ROOMS and "/" in token and page.name == "ARCHITECTURE.md":
                found.append((token, ROOT / "node" / token))
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            continue
        if re.search(r"[<>*{}]", target) or target in ALLOW:
            continue
        where = (page.parent / target).resolve()
        if where.is_relative_to(ROOT) and where.relative_to(ROOT).parts[:1] != ("runs",):
            found.append((target, where))
    return found


def missing_paths(text: str, page: Path) -> list[str]:
    return [
        f"{page.relative_to(ROOT)}: {name}" for name, where in named_paths(text, page) if not _exists(where)
    ]


def test_every_path_the_docs_name_exists():
    pages = _pages()
    assert all(p.exists() for p in pages), [str(p) for p in pages if not p.exists()]
    missing, named = [], 0
    for page in pages:
        text = page.read_text()
        named += len(named_paths(text, page))
        missing += missing_paths(text, page)
    assert named > 100, f"only {named} paths found: has the extraction stopped matching?"
    assert not missing, "named but not in the tree:\n" + "\n".join(missing)


def test_the_check_sees_a_dead_name():
    """The extraction finds a planted dead name in each form it checks, and skips what it must."""
    page = ROOT / "docs" / "links.md"
    text = (
        "see `node/net/no_such_file.py`, [x](../bench/results/no_such.md), `stage/no_such.py`,\n"
        "`bench/results/nat.md`, `runs/demo/report.json`, `OWNER/NAME`, [y](https://example.org/a/b),\n"
        "`loss_<task>.png`, `/ip4/1.2.3.4/tcp/1`\n"
        "```bash\npython -m node join --out bench/nothing_here\n```\n"
    )
    assert missing_paths(text, page) == [
        "docs/links.md: node/net/no_such_file.py",
        "docs/links.md: ../bench/results/no_such.md",
    ]
    architecture = ROOT / "docs" / "ARCHITECTURE.md"
    assert missing_paths("`stage/no_such.py`, `net/serve.serve`, `bench/harness.md`", architecture) == [
        "docs/ARCHITECTURE.md: stage/no_such.py",
        "docs/ARCHITECTURE.md: bench/harness.md",
    ]
