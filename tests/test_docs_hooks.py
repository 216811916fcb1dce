"""docs/hooks.py shows a script's code in a page: a constant with the comment lines right
above it, not those a blank line away, and a name that is not there stops the build."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))

import hooks  # noqa: E402
from mkdocs.exceptions import PluginError  # noqa: E402

SCRIPT = '''"""A script."""
# ---------------------------------------------------------------- a section

# Why the constant is 3,
# in two lines.
THREE = 3  # its own comment
FOUR = 4


# Above the function, a blank line away from nothing.
@staticmethod
def five():
    return 5
'''


@pytest.fixture
def root(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    return tmp_path


def test_a_constant_comes_with_the_comment_lines_right_above_it(root):
    assert hooks.excerpt(root, "script.py", ["THREE"], "page") == (
        "# Why the constant is 3,\n# in two lines.\nTHREE = 3  # its own comment")


def test_a_statement_with_no_comment_right_above_it_comes_alone(root):
    assert hooks.excerpt(root, "script.py", ["FOUR"], "page") == "FOUR = 4"


def test_a_run_of_statements_and_a_decorated_function(root):
    assert hooks.excerpt(root, "script.py", ["THREE..FOUR"], "page").splitlines()[0] == "# Why the constant is 3,"
    assert hooks.excerpt(root, "script.py", ["five"], "page").splitlines()[:2] == [
        "# Above the function, a blank line away from nothing.", "@staticmethod"]


def test_a_name_that_is_not_there_stops_the_build(root):
    with pytest.raises(PluginError, match="no 'SIX' in the file"):
        hooks.excerpt(root, "script.py", ["SIX"], "page")
