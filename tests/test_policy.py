"""Policy files: defaults, validation, one clear error line."""

import pytest

from nonstop import policy
from nonstop.errors import UsageError


def test_defaults_without_a_file():
    p = policy.load(None)
    assert p.timeouts.teardown_s > 0 and p.budgets.user_error_retries >= 1


def test_file_overrides_and_cli_overrides(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("timeouts:\n  hang_s: 5\nbudgets:\n  job_restarts: 1\n")
    p = policy.load(f).with_overrides(**{"timeouts.teardown_s": 0.5, "timeouts.hang_s": None})
    assert p.timeouts.hang_s == 5 and p.timeouts.teardown_s == 0.5 and p.budgets.job_restarts == 1


@pytest.mark.parametrize("text, words", [
    ("timeouts:\n  hang_seconds: 5\n", "unknown key 'timeouts.hang_seconds'"),
    ("timeouts:\n  hang_s: -1\n", "timeouts.hang_s"),
    ("timeouts: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("budgets:\n  job_restarts: many\n", "budgets.job_restarts"),
])
def test_bad_policies_are_one_line(tmp_path, text, words):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(UsageError, match=words) as info:
        policy.load(f)
    assert "\n" not in str(info.value)


def test_missing_policy_file(tmp_path):
    with pytest.raises(UsageError, match="No such file"):
        policy.load(tmp_path / "nope.yaml")
