"""`mstar-engine serve` with a bad model path or bad flags: a clear message and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar.engine.cli import main


def test_missing_model_path_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["serve", str(missing), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot load the model" in err and str(missing) in err


def test_folder_without_config_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path), "--device", "cpu"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_invalid_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--page-size", "0"])
    assert exit_info.value.code == 2
    assert "--page-size" in capsys.readouterr().err


def test_unavailable_attention_backend_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Checked before the weights load: the (missing) model is never reached.
    argv = ["serve", str(tmp_path), "--device", "cpu", "--attention-backend", "flashinfer"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--attention-backend flashinfer needs a CUDA device" in err
    assert "cannot load the model" not in err
