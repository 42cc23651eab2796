"""The repository stands alone: what its code and docs cite is inside it. Every citation of
``docs/ARCHITECTURE.md`` names a section the page has, and no tracked file reads or cites a folder
beside the checkout (the data and design notes once lived in one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
#: What code, tests, docs, build and config files are written in (data files are not scanned).
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sql", ".cfg", ".ini", ".sh", ""}


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the tracked files")
    files = [REPO / name for name in out.decode().split("\0") if name]
    return [f for f in files if f.suffix in TEXT_SUFFIXES and f.is_file() and not f.is_symlink()
            and f.relative_to(REPO).parts[0] != "data"]


def _sections() -> set[str]:
    return {m.strip() for m in re.findall(r"^## (.+)$", ARCHITECTURE.read_text(), flags=re.M)}


def test_every_citation_of_the_architecture_page_names_one_of_its_sections():
    sections = _sections()
    assert {"Data flow", "Metering rules", "Vocabulary", "Conventions"} <= sections
    cited = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        for m in re.finditer(r'docs/ARCHITECTURE\.md,?\s+"([^"]+)"', text):
            name = re.sub(r"\s+", " ", m.group(1)).strip()
            cited.append((path.relative_to(REPO).as_posix(), name))
    assert cited, "nothing cites docs/ARCHITECTURE.md"
    unknown = [(p, n) for p, n in cited if n not in sections]
    assert not unknown, f"citations of sections docs/ARCHITECTURE.md does not have: {unknown}"


def test_no_tracked_file_reads_or_cites_a_folder_beside_the_checkout():
    # the shared folder beside the checkout (its data and design notes), and a bare citation of the
    # design notes' two pages; this repository's docs page and a quoted file name are fine
    outside = re.compile(r"\.\./" + "shared" + r"|\bshared/(?:data|design)\b|\bSTYLE\.md"
                         r'|(?<![\w/"])ARCHITECTURE\.md')
    hits = [f"{path.relative_to(REPO).as_posix()}:{lineno}: {line.strip()}"
            for path in _tracked_text_files()
            for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if outside.search(line)]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
