"""Every repository path cited in the code and the docs exists: a moved or renamed file leaves no
stale pointer behind (`operators/correction.py` after it moved to operators/trainer/, `DESIGN.md`
for docs/design.md)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED_CODE = ("trajflow", "schemas", "algorithms", "engines", "tasks", "operators", "pipelines", "jobs",
                "benchmarks", "scripts")
EXTENSIONS = {"py", "md", "yaml", "yml", "json", "parquet", "png", "sh", "ipynb", "toml", "txt", "jsonl",
              "safetensors"}
# a path token (`operators/trainer/correction.py`, `benchmarks/results/`) or a bare top-level file (`README.md`)
TOKEN = re.compile(r"(?<![\w./\-])((?:[\w\-]+/)+[\w\-.]*|[A-Z][A-Z0-9_\-]*\.(?:md|toml|txt)|pyproject\.toml)"
                   r"(?![\w/\-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a markdown link's target, relative to the doc's folder
URL = re.compile(r"\w+://\S+")
BUILT_AT_RUN_TIME = ("RUN/", "OUT/", "DIR", "*", "{", "<", "$", "~", "/tmp", "site-packages")


def top_level_folders(root: Path) -> set[str]:
    """The repository's folders; not the ones git ignores (`runs/` once the quickstart has run:
    the docs' example run dirs are not citations)."""
    import subprocess

    folders = {p.name for p in root.iterdir()
               if p.is_dir() and not p.name.startswith((".", "_")) and not p.name.endswith(".egg-info")}
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", *sorted(folders)], capture_output=True,
                             text=True).stdout.split()
    return folders - {Path(name).name for name in ignored}


def _cites(token: str, folders: set[str]) -> bool:
    """Whether a token names a repository path: under a top-level folder, ending in a file
    extension (or naming a folder or module), or a bare top-level file."""
    if "/" not in token:
        return True  # TOKEN matches only the bare top-level files' shape without a '/'
    last = token.rstrip("/").rsplit("/", 1)[-1]
    return token.split("/")[0] in folders and ("." not in last or last.rsplit(".", 1)[1] in EXTENSIONS)


def _exists(token: str, bases: list[Path]) -> bool:
    """Resolved against each base; a token without an extension may name a folder or a module."""
    token = token.rstrip("/")
    return any((base / token).exists() or (base / f"{token}.py").exists() for base in bases)


def broken_citations(path: Path, root: Path = REPO) -> list[str]:
    """`file:line: token` for each cited path of `path` that does not exist. A token resolves
    against the repository's root or the citing file's folder (markdown links are relative)."""
    folders, bases = top_level_folders(root), [root, path.parent]
    broken = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        chunks = line.split()
        line = URL.sub(" ", line)
        tokens = [m.group(1).rstrip(".") for m in TOKEN.finditer(line) if _cites(m.group(1).rstrip("."), folders)]
        if path.suffix == ".md":
            tokens += [t.split("#")[0] for t in LINK.findall(line) if not t.startswith("#")]
        for token in tokens:
            chunk = next((c for c in chunks if token in c), token)
            if any(marker in chunk for marker in BUILT_AT_RUN_TIME) or _exists(token, bases):
                continue
            broken.append(f"{path.relative_to(root)}:{number}: {token}")
    return broken


def citing_files(root: Path = REPO) -> list[Path]:
    code = [p for folder in SCANNED_CODE for p in sorted((root / folder).rglob("*.py"))]
    return code + sorted((root / "docs").glob("*.md")) + [root / "README.md"]


def test_every_cited_path_exists():
    files = citing_files()
    assert len(files) > 100 and REPO / "docs" / "design.md" in files
    broken = [entry for path in files for entry in broken_citations(path)]
    assert not broken, "cited paths that do not exist:\n" + "\n".join(broken)


def test_the_scan_finds_a_stale_citation_and_ignores_what_is_built_at_run_time(tmp_path):
    """The scan on a small tree: what it must flag, and what it must leave alone."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "operators" / "trainer").mkdir(parents=True)
    (tmp_path / "operators" / "trainer" / "correction.py").write_text("")
    (tmp_path / "docs" / "design.md").write_text("")
    (tmp_path / "docs" / "recovery.md").write_text("")
    (tmp_path / "README.md").write_text("")
    cited = tmp_path / "docs" / "guide.md"
    cited.write_text(
        "the ranges of operators/correction.py, as DESIGN.md §6 says\n"                 # 1: both stale
        "operators/trainer/correction.py, docs/design.md §6, operators/trainer/, README.md\n"  # 2: all exist
        "[recovery](recovery.md), [gone](missing.md#part), [web](https://x.org/docs/a.md)\n"   # 3: missing.md
        "RUN/docs/x.md, $OUT/operators/y.py, /tmp/docs/z.md, docs/{a,b}.md, operators/trainer\n"  # 4: none
        "reward/mean, 1/c, tokens/s, operators/nothing.so, operators/trainer/correction\n")  # 5: none
    assert broken_citations(cited, root=tmp_path) == [
        "docs/guide.md:1: operators/correction.py", "docs/guide.md:1: DESIGN.md", "docs/guide.md:3: missing.md"]
