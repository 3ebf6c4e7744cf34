"""The documents speak of the product as it is: short pages, no history, links that resolve."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"session\s[0-9]+|before\ssession|since\ssession", re.IGNORECASE)  # the grep
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def project_files(*suffixes):
    """The project's own files: virtualenvs, git's folder and caches are not walked into."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("__pycache__", "mlartifacts", "node_modules")]
        found += [Path(folder) / f for f in files if Path(f).suffix in suffixes]
    return found


def test_the_readmes_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) <= 300


def test_no_page_or_comment_tells_the_project_s_history():
    told = [f"{p.relative_to(ROOT)}:{n}" for p in project_files(".md", ".py")
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert not told, told[:10]


def test_every_relative_link_in_the_pages_points_at_a_file():
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in pages for target, _ in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, broken
