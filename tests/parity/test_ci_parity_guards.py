"""Under CI=1 the side-by-side parity checks cannot silently not run: a failed TRL install fails scripts/setup.sh,
`scripts/trl_testsuite.sh --ci` without TRL's reference tests fails, and tests/_trl.py fails instead of skipping."""

import os
import stat
import subprocess
from pathlib import Path

import pytest
from _trl import in_ci, trl_module

ROOT = Path(__file__).resolve().parents[2]


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _setup_env(tmp_path: Path, ci: str | None) -> dict:
    """A stand-in venv whose python succeeds at everything but installing or importing trl, and stand-ins for the
    optional system tools so setup.sh never reaches apt."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    _stub(venv / "python", 'for a in "$@"; do case "$a" in trl==*|"import trl") exit 1 ;; esac; done\nexit 0\n')
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("bwrap", "chromium"):
        _stub(tools / name, "exit 0\n")
    _stub(tools / "apt-get", "exit 1\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(POSTTRAIN_VENV=str(tmp_path / "venv"), PATH=f"{tools}:{env['PATH']}")
    if ci is not None:
        env["CI"] = ci
    return env


def test_setup_fails_in_ci_when_trl_does_not_install(tmp_path):
    run = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=ROOT, env=_setup_env(tmp_path, "1"), capture_output=True, text=True
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "trl==1.16.0 did not install or import" in run.stderr
    assert not (tmp_path / "venv" / ".posttrain-installed").exists()


@pytest.mark.parametrize("ci", [None, "0"])
def test_setup_goes_on_outside_ci_when_trl_does_not_install(tmp_path, ci):
    run = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=ROOT, env=_setup_env(tmp_path, ci), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "setup: trl not installed" in run.stdout
    assert (tmp_path / "venv" / ".posttrain-installed").exists()


def test_trl_testsuite_ci_fails_without_reference_tests(tmp_path):
    env = dict(os.environ, TRL_TESTS=str(tmp_path / "absent"), CI="1")
    run = subprocess.run(
        ["bash", "scripts/trl_testsuite.sh", "--ci"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "FAILED (--ci)" in run.stderr and "trl-tests" in run.stderr


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("", False), ("0", False)])
def test_in_ci_reads_the_ci_variable(monkeypatch, value, expected):
    monkeypatch.setenv("CI", value)
    assert in_ci() is expected


def test_side_by_side_helper_fails_instead_of_skipping_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI=1 refuses to skip"):
        trl_module("trl_absent_for_this_test")


def test_side_by_side_helper_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="trl_absent_for_this_test cannot be imported"):
        trl_module("trl_absent_for_this_test")


def _tracked_test_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "tests/*.py", "tests/**/*.py"], cwd=ROOT, capture_output=True, text=True
    )
    return (
        listed.stdout.split()
        if listed.returncode == 0
        else [str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/*.py")]
    )


def test_no_test_skips_on_a_missing_trl_by_itself():
    """Every side-by-side test goes through tests/_trl.py, so CI=1 reaches it."""
    offenders = [
        f"{path.name}:{n}"
        for path in sorted(ROOT / f for f in _tracked_test_files())
        if path.name != Path(__file__).name
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if 'importorskip("trl' in line
    ]
    assert offenders == []
