"""The repository's own data folder (``data/``) and the one function that finds it
(:func:`kvmeter.traces.data_dir`): found beside the package, overridden only by
``$KVMETER_DATA_DIR``, every file documented in ``data/SOURCES.md``, a missing file named with
where kvmeter looked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmeter.serving.simulator.tenants import load_servegen_rates
from kvmeter.traces import (DATA_DIR_ENV, TRACE_FILES, DataNotFoundError, TraceNotFoundError, data_dir,
                            data_file, load_trace, trace_path)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


def _files() -> list[Path]:
    return sorted(p.relative_to(DATA) for p in DATA.rglob("*") if p.is_file() and p.name != "SOURCES.md")


def test_the_data_folder_is_the_repositorys_own_and_the_variable_only_overrides_it(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert data_dir() == DATA
    monkeypatch.setenv(DATA_DIR_ENV, "")            # empty: not set
    assert data_dir() == DATA
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data_dir() == tmp_path


def test_every_named_trace_is_in_the_repository(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    for name, relative in TRACE_FILES.items():
        assert trace_path(name) == DATA / relative


def test_every_data_file_is_listed_in_its_section_of_sources_md():
    sources = (DATA / "SOURCES.md").read_text()
    sections = dict(re.findall(r"^## (\w+)/ [^\n]*\n(.*?)(?=^## |\Z)", sources, flags=re.M | re.S))
    files = _files()
    assert files, "data/ holds no files"
    for f in files:
        top, rest = f.parts[0], Path(*f.parts[1:]).as_posix()
        assert top in sections, f"data/{top}/ has no section in data/SOURCES.md"
        assert f"`{rest}`" in sections[top], f"data/{f.as_posix()} is not listed in data/SOURCES.md"


def test_sources_md_states_the_folders_true_size():
    stated = re.search(r"^Total: (\d+) files .*?([\d,]+) bytes", (DATA / "SOURCES.md").read_text(), flags=re.M)
    assert stated, "data/SOURCES.md has no 'Total: N files ... B bytes' line"
    files = _files()
    size = sum((DATA / f).stat().st_size for f in files)
    assert (int(stated[1]), int(stated[2].replace(",", ""))) == (len(files), size)


def test_a_missing_data_file_says_where_kvmeter_looked_and_how_to_override(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(DataNotFoundError) as err:
        data_file("gpu/no_such_capture.txt")
    msg = str(err.value)
    assert str(DATA / "gpu" / "no_such_capture.txt") in msg and f"${DATA_DIR_ENV} overrides" in msg

    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))   # a folder without the files
    with pytest.raises(TraceNotFoundError) as err:
        load_trace("azure-conv")
    assert str(tmp_path / TRACE_FILES["azure-conv"]) in str(err.value) and DATA_DIR_ENV in str(err.value)
    with pytest.raises(DataNotFoundError, match=DATA_DIR_ENV):
        load_servegen_rates()
