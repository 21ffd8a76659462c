"""core.pack: committing a run directory (hidden files left out, paths spelled portably, raw records gzipped
deterministically) and restoring it, ready to resume; bad input exits 2 with one line and writes nothing."""

from __future__ import annotations

import gzip
import json

import pytest

import core.paths
from core.pack import main
from core.rundir import RunDir


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout, a home and a data directory at made-up places, and a run inside the checkout that recorded the
    absolute paths it read."""
    root, home, data = tmp_path / "checkout", tmp_path / "home", tmp_path / "data"
    monkeypatch.setattr(core.paths, "REPOSITORY", root)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(data))
    run = root / "runs" / "run"
    identity = {"reference": str(root / "runs/t.jsonl"), "data_source": str(data / "m.jsonl"),
                "source": str(home / ".cache/m.gguf"), "limit": 3}
    with RunDir(run, identity) as claimed:
        claimed.save_config(command=f"python -m tool --out {run}")
        claimed.store("generations.jsonl").append({"id": "p1", "text": "x"})
    (run / "cell").mkdir()
    (run / "cell" / "summary.csv").write_text(f"cell,path\na,{run}/cell\n")
    (run / "cell" / "figure.png").write_bytes(bytes(range(256)))
    (run / ".kvscope.lock").write_text("")
    return root, run, identity


def test_a_commit_spells_paths_portably_gzips_the_records_and_leaves_hidden_files_out(checkout, capsys):
    root, run, _ = checkout
    committed = root / "results" / "run"
    assert main(["--source", str(run), "--out", str(committed)]) == 0
    assert "committed 4 files (1 gzipped)" in capsys.readouterr().out
    config = json.loads((committed / "config.json").read_text())
    assert config["identity"] == {"reference": "runs/t.jsonl", "data_source": "$KVSCOPE_DATA_DIR/m.jsonl",
                                  "source": "~/.cache/m.gguf", "limit": 3}
    assert config["command"] == "python -m tool --out runs/run"
    assert (committed / "cell" / "summary.csv").read_text() == "cell,path\na,runs/run/cell\n"
    assert (committed / "cell" / "figure.png").read_bytes() == bytes(range(256))
    assert not (committed / "generations.jsonl").exists() and not (committed / ".kvscope.lock").exists()
    packed = (committed / "generations.jsonl.gz").read_bytes()
    assert gzip.decompress(packed) == (run / "generations.jsonl").read_bytes()
    assert main(["--source", str(run), "--out", str(committed)]) == 0  # committing again changes nothing
    assert "committed 0 files (0 gzipped)" in capsys.readouterr().out
    assert (committed / "generations.jsonl.gz").read_bytes() == packed
    (committed / "generations.jsonl.gz").unlink()
    assert main(["--source", str(run), "--out", str(committed)]) == 0
    assert (committed / "generations.jsonl.gz").read_bytes() == packed  # the same bytes from the same content
    other_gzip = gzip.compress(gzip.decompress(packed), compresslevel=1, mtime=123)  # as another tool packed it
    (committed / "generations.jsonl.gz").write_bytes(other_gzip)
    assert main(["--source", str(run), "--out", str(committed)]) == 0
    assert (committed / "generations.jsonl.gz").read_bytes() == other_gzip  # the same content: left as it is


def test_a_restored_run_resumes_with_the_absolute_identity_it_was_made_with(checkout, tmp_path, capsys):
    root, run, identity = checkout
    committed, restored = root / "results" / "run", tmp_path / "elsewhere" / "run"
    assert main(["--source", str(run), "--out", str(committed)]) == 0
    assert main(["--restore", "--source", str(committed), "--out", str(restored)]) == 0
    assert "restored 4 files (1 unpacked)" in capsys.readouterr().out
    assert (restored / "generations.jsonl").read_bytes() == (run / "generations.jsonl").read_bytes()
    with RunDir(restored, identity) as resumed:
        assert "p1" in resumed.store("generations.jsonl")


def test_a_later_commit_brings_the_destination_up_to_date(checkout):
    root, run, identity = checkout
    committed = root / "results" / "run"
    committed.mkdir(parents=True)
    (committed / "generations.jsonl").write_text("an earlier, uncompressed piece\n")
    (committed / "notes.md").write_text("kept\n")
    with RunDir(run, identity) as resumed:
        resumed.store("generations.jsonl").append({"id": "p2", "text": "y"})
    assert main(["--source", str(run), "--out", str(committed)]) == 0
    assert not (committed / "generations.jsonl").exists()
    assert gzip.decompress((committed / "generations.jsonl.gz").read_bytes()).count(b'"id"') == 2
    assert (committed / "notes.md").read_text() == "kept\n"


def test_a_run_still_running_is_not_committed(checkout, capsys):
    root, run, identity = checkout
    committed = root / "results" / "run"
    with RunDir(run, identity):
        assert main(["--source", str(run), "--out", str(committed)]) == 2
    assert "is in use by a running run (pid" in capsys.readouterr().err and not committed.exists()
    assert main(["--source", str(run), "--out", str(committed)]) == 0  # its lock released: committed


@pytest.mark.parametrize("arguments, message", [
    (["--source", "missing", "--out", "out"], "--source 'missing' is not a directory"),
    (["--source", "run/config.json", "--out", "out"], "--source 'run/config.json' is not a directory"),
    (["--source", "run", "--out", "run/inside"], "--out 'run/inside' overlaps --source 'run'"),
    (["--source", "run", "--out", "run/config.json/x"], "--out 'run/config.json/x' lies below a file"),
    (["--restore", "--gzip", "*.jsonl", "--source", "run", "--out", "out"], "--gzip only applies when committing"),
    (["--gzip", "a/b.jsonl", "--source", "run", "--out", "out"], "--gzip 'a/b.jsonl' holds a '/'"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["config.json", "run"]
