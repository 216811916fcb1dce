"""docs/hooks.py shows a script's code in a page: a name with the comment lines right above
it, not those a blank line away nor a file's #! line, and a name that is not there, or a
run that goes backwards, stops the build."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))

import hooks  # noqa: E402
from mkdocs.exceptions import PluginError  # noqa: E402

SCRIPT = '''#!/usr/bin/env python
ONE = 1
# ---------------------------------------------------------------- a section

# Why the constant is 3,
# in two lines.
THREE = 3  # its own comment
FOUR = 4


# Right above the decorator.
@staticmethod
def five():
    return 5


class Six:
    # Right above the method.
    def seven(self):
        return 7
'''


@pytest.fixture
def root(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    return tmp_path


def shown(root, *names):
    return hooks.excerpt(root, "script.py", list(names), "page")


def test_a_constant_comes_with_the_comment_lines_right_above_it(root):
    assert shown(root, "THREE") == "# Why the constant is 3,\n# in two lines.\nTHREE = 3  # its own comment"


def test_a_statement_with_no_comment_right_above_it_comes_alone(root):
    assert shown(root, "FOUR") == "FOUR = 4"
    assert shown(root, "ONE") == "ONE = 1"  # the file's #! line is the file's, not ONE's


def test_a_run_a_decorated_function_and_a_method(root):
    assert shown(root, "THREE..FOUR").splitlines()[0] == "# Why the constant is 3,"
    assert shown(root, "five").splitlines()[:2] == ["# Right above the decorator.", "@staticmethod"]
    assert shown(root, "Six.seven") == "# Right above the method.\ndef seven(self):\n    return 7"


def test_a_name_that_is_not_there_or_a_run_backwards_stops_the_build(root):
    with pytest.raises(PluginError, match="no 'EIGHT' in the file"):
        shown(root, "EIGHT")
    with pytest.raises(PluginError, match="runs backwards"):
        shown(root, "FOUR..THREE")
