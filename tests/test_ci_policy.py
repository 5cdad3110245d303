"""The test suite's own policy (tests/conftest.py): no silent skips, no missing test dependency.

Each case runs pytest in a fresh process on a throw-away test directory that uses this suite's conftest.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")


def run_pytest(tmp_path: Path, test_source: str, env: dict, block: str | None = None):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(test_source)
    prelude = f"import sys; sys.modules[{block!r}] = None; " if block else "import sys; "
    code = prelude + "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '.']))"
    env = {k: v for k, v in {**os.environ, "HF_TOKRED_CI": None, **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


SKIPPING = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="triton is not installed")
def test_needs_triton():
    pass
"""


def test_ci_fails_on_a_skipped_test_and_prints_the_count(tmp_path):
    local = run_pytest(tmp_path, SKIPPING, {"HF_TOKRED_CI": None})
    assert local.returncode == 0, local.stdout[-2000:]
    assert "hf_tokred: 1 test(s) skipped" in local.stdout
    assert "test_needs_triton: Skipped: triton is not installed" in local.stdout
    ci = run_pytest(tmp_path, SKIPPING, {"HF_TOKRED_CI": "1"})
    assert ci.returncode == 1, ci.stdout[-2000:]
    assert "hf_tokred: 1 test(s) skipped" in ci.stdout and "failing the run" in ci.stdout


def test_ci_allows_a_skip_for_missing_hardware(tmp_path):
    source = 'import pytest\n\n@pytest.mark.skipif(True, reason="needs a CUDA device")\ndef test_gpu():\n    pass\n'
    ci = run_pytest(tmp_path, source, {"HF_TOKRED_CI": "1"})
    assert ci.returncode == 0, ci.stdout[-2000:]
    assert "hf_tokred: 1 test(s) skipped" in ci.stdout


def test_a_missing_test_dependency_is_an_error(tmp_path):
    """Without triton the kernel tests would skip; the run stops instead (hypothesis: conftest imports it)."""
    module = "triton"
    out = run_pytest(tmp_path, "def test_ok():\n    pass\n", {}, block=module)
    assert out.returncode != 0, out.stdout[-2000:]
    assert f"missing test dependencies: {module}" in out.stdout + out.stderr
    allowed = run_pytest(tmp_path, "def test_ok():\n    pass\n", {"HF_TOKRED_ALLOW_MISSING_TEST_DEPS": "1"},
                         block=module)
    assert allowed.returncode == 0, allowed.stdout[-2000:]


def test_undeclared_markers_are_errors(tmp_path):
    out = run_pytest(tmp_path, "import pytest\n\n@pytest.mark.not_a_marker\ndef test_ok():\n    pass\n", {})
    assert out.returncode != 0 and "not_a_marker" in out.stdout + out.stderr
