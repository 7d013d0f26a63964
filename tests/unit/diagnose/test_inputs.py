"""What mbx diagnose is given -> the files it reads: directories walked to every depth, hidden entries skipped."""

from __future__ import annotations

import pytest

from megatron_bridge_ext.diagnose.inputs import InputError, expand

pytestmark = pytest.mark.unit


def _write(path, text="x\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_directory_yields_every_file_below_it_at_every_depth_in_name_order(tmp_path):
    """A launcher's log tree: <job>/attempt_0/<local rank>/stderr.log sits three folders below the one named."""
    files = [_write(tmp_path / "a.log"),
             _write(tmp_path / "job" / "attempt_0" / "0" / "stderr.log"),
             _write(tmp_path / "job" / "attempt_0" / "1" / "stderr.log"),
             _write(tmp_path / "z" / "deep" / "er" / "still" / "rank7.log")]
    assert list(expand([str(tmp_path)])) == [(f, False) for f in files]


def test_hidden_files_and_folders_are_skipped_at_every_depth(tmp_path):
    kept = _write(tmp_path / "run" / "rank0.log")
    _write(tmp_path / "run" / ".rank0.log.swp")
    _write(tmp_path / "run" / ".cache" / "rank1.log")
    _write(tmp_path / ".git" / "HEAD")
    assert list(expand([str(tmp_path)])) == [(kept, False)]


def test_named_files_are_explicit_and_a_directory_of_only_folders_is_refused(tmp_path):
    named = _write(tmp_path / "one.log")
    (tmp_path / "empty" / "inner").mkdir(parents=True)
    assert list(expand([named, "-"])) == [(named, True), ("-", True)]
    with pytest.raises(InputError, match="the directory holds no file"):
        list(expand([str(tmp_path / "empty")]))
