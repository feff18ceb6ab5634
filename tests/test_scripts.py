"""The front-door scripts (scripts/setup.sh, test.sh, serve.sh, .ci/run), run in a scratch copy of the
repository with a stand-in interpreter that records what it is asked to do instead of installing anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Stands in for both the base interpreter (PYTHON) and .venv/bin/python: logs its arguments, "creates" a
# venv, "installs" torch (a marker file), fails pip when FAKE_PIP_FAIL is set, and exits PYTEST_RC for pytest.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1 $2" in
  "--version ") echo "Python 3.99.0" ;;
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-S -c") [[ "$3" == *sys.version* ]] && echo "3.99.0 (fake)" ;;
  "-c import torch") [ -f .venv/torch ]; exit $? ;;
  "-m pip")
    [ -z "${FAKE_PIP_FAIL:-}" ] || exit 1
    [[ "$*" == *torch==* ]] && touch .venv/torch ;;
  "-m pytest") echo "DISAGG_DIFFUSION_CACHE=$DISAGG_DIFFUSION_CACHE"; exit "${PYTEST_RC:-0}" ;;
esac
exit 0
"""


@pytest.fixture
def repo(tmp_path):
    """A scratch checkout: the real scripts and pyproject.toml, a fake interpreter, no .venv yet."""
    work = tmp_path / "repo"
    for rel in ("scripts/setup.sh", "scripts/test.sh", "scripts/serve.sh", ".ci/run", "pyproject.toml"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, work / rel)
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    # CHROMIUM: a browser that is there (scripts/test.sh installs none).
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "CHROMIUM": str(fake)}
    for name in ("SETUP_FORCE", "TORCH_VERSION", "FAKE_PIP_FAIL", "DISAGG_DIFFUSION_CACHE", "SETUP_BROWSER"):
        env.pop(name, None)

    class Repo:
        path = work

        @staticmethod
        def run(script="scripts/setup.sh", **extra_env):
            log.write_text("")
            r = subprocess.run(["bash", script], cwd=work, env={**env, **extra_env}, capture_output=True,
                               text=True, timeout=60)
            return r, [line for line in log.read_text().splitlines() if line]

    return Repo()


def _pip(calls):
    return [c for c in calls if c.startswith("-m pip")]


def test_scripts_parse():
    for rel in ("scripts/setup.sh", "scripts/test.sh", "scripts/serve.sh", ".ci/run"):
        subprocess.run(["bash", "-n", str(ROOT / rel)], check=True)


def test_first_run_says_what_it_does_and_second_run_installs_nothing(repo):
    r, calls = repo.run()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for line in ("setup: first run", "a few minutes", "setup: creating .venv with Python 3.99.0",
                 "setup: installing torch==2.13.0", "setup: installing disagg-diffusion", "setup: done in"):
        assert line in out, out
    assert _pip(calls) == ["-m pip install -q torch==2.13.0", "-m pip install -q -e .[test]"]
    assert (repo.path / ".venv/.setup-stamp").is_file()

    r, calls = repo.run()
    assert r.returncode == 0 and r.stdout == "setup: up to date (.venv)\n"
    assert _pip(calls) == [] and not [c for c in calls if "import torch" in c]


def test_a_change_to_what_the_install_is_made_from_installs_again(repo):
    assert repo.run()[0].returncode == 0
    pyproject = repo.path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# a new dependency\n")
    r, calls = repo.run()
    assert "setup: first run" not in r.stdout  # the venv is there: only the engine's install again
    assert _pip(calls) == ["-m pip install -q -e .[test]"]  # torch is present: kept
    assert repo.run()[1] == ["-S -c import sys; print(sys.version)"]  # up to date again
    for extra in ({"TORCH_VERSION": "2.12.0"}, {"SETUP_FORCE": "1"}):
        assert _pip(repo.run(**extra)[1]) == ["-m pip install -q -e .[test]"], extra


def test_a_failed_install_leaves_no_stamp(repo):
    r, _ = repo.run(FAKE_PIP_FAIL="1")
    assert r.returncode != 0 and "setup: done" not in r.stdout
    assert not (repo.path / ".venv/.setup-stamp").exists()
    r, calls = repo.run()
    assert r.returncode == 0 and len(_pip(calls)) == 2  # tried again, torch included


@pytest.mark.parametrize("rc", [0, 1])
def test_ci_runs_the_tests_and_fails_when_they_fail(repo, rc):
    r, calls = repo.run(".ci/run", PYTEST_RC=str(rc))
    assert r.returncode == rc, r.stdout + r.stderr
    assert calls[-1] == "-m pytest -q"  # pyproject.toml's testpaths: tests/
    assert f"DISAGG_DIFFUSION_CACHE={repo.path / '.cache'}" in r.stdout


def test_the_tests_install_chromium_only_where_it_is_missing(repo, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    apt = fake_bin / "apt-get"
    apt.write_text('#!/usr/bin/env bash\necho "apt-get $*" >> "$FAKE_LOG"\n')
    apt.chmod(0o755)
    path = f"{fake_bin}:{os.environ['PATH']}"
    apt_calls = lambda calls: [c for c in calls if c.startswith("apt-get")]  # noqa: E731
    r, calls = repo.run("scripts/test.sh", PATH=path)  # chromium is there: nothing to do
    assert r.returncode == 0 and apt_calls(calls) == [] and calls[-1] == "-m pytest -q", r.stdout + r.stderr
    missing = str(tmp_path / "no-chromium")
    r, calls = repo.run("scripts/test.sh", PATH=path, CHROMIUM=missing)
    assert r.returncode == 0 and calls[-1] == "-m pytest -q", r.stdout + r.stderr
    as_root = ["apt-get update -qq", "apt-get install -y -qq chromium"]
    assert apt_calls(calls) == (as_root if os.geteuid() == 0 else [])
    r, calls = repo.run("scripts/test.sh", PATH=path, CHROMIUM=missing, SETUP_BROWSER="0")
    assert r.returncode == 0 and apt_calls(calls) == []
