"""``kvmeter gpu``: a capture that is missing or not an nvidia-smi capture is a one-line error
(exit 2), never a traceback; a real capture still prints its GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmeter.cli import build_parser
from kvmeter.collectors import gpu_cli

H200 = "linux-x86_64__nvidia-h200__590.48.01.txt"


def _run(*argv: str) -> int:
    return gpu_cli.run(build_parser(["gpu"]).parse_args(["gpu", *argv]))


def _bad_captures(tmp_path: Path) -> list[tuple[Path, str]]:
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    xml = tmp_path / "other.xml"
    xml.write_text("<?xml version='1.0'?><html/>")
    return [(tmp_path / "nope", "No such file or directory"), (tmp_path, "is a directory, not a capture file"),
            (text, "not an nvidia-smi capture"), (binary, "not an nvidia-smi capture"),
            (xml, "not an nvidia-smi capture")]


def test_a_bad_capture_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    for path, why in _bad_captures(tmp_path):
        assert _run("--capture", str(path)) == gpu_cli.EXIT_USAGE, path
        out = capsys.readouterr()
        err = out.err.strip()
        assert err.startswith(f"kvmeter gpu: error: --capture {path}: ") and why in err, err
        assert "\n" not in err and not out.out


def test_a_negative_xid_wait_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser(["gpu"]).parse_args(["gpu", "--xid-wait-ms", "-5"])
    assert exit_.value.code == 2 and "argument --xid-wait-ms" in capsys.readouterr().err


def test_a_real_capture_still_reads(data_dir: Path, capsys) -> None:
    assert _run("--capture", str(data_dir / "gpu" / "nvidia_smi" / H200), "--require-gpu") == 0
    assert "H200" in capsys.readouterr().out


@pytest.mark.parametrize("folder, known", [("dcgm", "dcgm_v100_4gpu_issue250.prom"), ("nvidia_smi", H200)])
def test_a_directory_is_refused_naming_the_files_in_it(data_dir: Path, folder: str, known: str, capsys) -> None:
    # once "No such file or directory" / "Is a directory", with nothing saying what to pass instead
    path = data_dir / "gpu" / folder
    assert _run("--capture", str(path)) == gpu_cli.EXIT_USAGE
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.startswith(f"kvmeter gpu: error: --capture {path}: is a directory, not a capture file: "
                          "--capture takes one nvidia-smi capture"), err
    listed = err.split("; files in it: ", 1)[1].split(", ")
    assert known in listed and listed == sorted(p.name for p in path.iterdir() if p.is_file()), err
    assert "\n" not in err and not out.out


def test_an_empty_directory_says_so(tmp_path: Path, capsys) -> None:
    (tmp_path / "sub").mkdir()
    assert _run("--capture", str(tmp_path)) == gpu_cli.EXIT_USAGE
    assert capsys.readouterr().err.strip().endswith("; it holds no files")
