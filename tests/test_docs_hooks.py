"""docs/hooks.py shows a script's code in a page: a name with the comment lines right above
it, not those a blank line away nor a file's #! line, and a name that is not there, or a
run that goes backwards, stops the build. It shows a table of the course's report
(results/README.md) in a page, word for word, and a table that is not there stops the build."""
import sys
from pathlib import Path
from types import SimpleNamespace

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


FENCE = """
```
"""
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


# The shape of course.py's report: a table of steps, then the models, the video's and each model's.
REPORT = """# The course, as it ran here

| step | command | minutes |
| --- | --- | --- |
| data | `python data.py` | 0.0 |

## The models

| model | training seeds | trained for | words used |
| --- | --- | --- | --- |
| fine-tuned | 1 | 1,000 steps | 31% |
| GRPO, KL 0 | 1 | 36 rollouts | 49% |

| model | words used | loss on plain stories | stories that end within 200 tokens | KL per story at the end |
| --- | --- | --- | --- | --- |
| fine-tuned | 27% | 2.38 | 48% | 0 |
"""


@pytest.fixture
def report_root(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "README.md").write_text(REPORT)
    return tmp_path


def test_a_report_table_is_the_report_s_own_lines(report_root):
    models = REPORT.split("## The models\n\n")[1].split("\n\n")[0]
    assert hooks.report_table(report_root, "models", "page") == models
    assert hooks.report_table(report_root, "steps", "page").splitlines()[-1] == "| data | `python data.py` | 0.0 |"
    assert hooks.report_table(report_root, "video", "page").splitlines()[-1].startswith("| fine-tuned | 27% |")


def test_a_page_shows_the_table_where_the_line_stands_with_its_indentation(report_root):
    page = SimpleNamespace(file=SimpleNamespace(src_uri="course.md"))
    config = SimpleNamespace(config_file_path=str(report_root / "mkdocs.yml"))
    shown = hooks.on_page_markdown("Before.\n\n  ::: report steps\n\nAfter.\n", page, config, None)
    assert shown == ("Before.\n\n  | step | command | minutes |\n  | --- | --- | --- |\n"
                     "  | data | `python data.py` | 0.0 |\n\nAfter.\n")


def test_a_report_table_that_is_not_there_stops_the_build(report_root, tmp_path_factory):
    with pytest.raises(PluginError, match="has no table of each"):
        hooks.report_table(report_root, "each", "page")
    with pytest.raises(PluginError, match="no table 'speed'"):
        hooks.report_table(report_root, "speed", "page")
    with pytest.raises(PluginError, match="no results/README.md"):
        hooks.report_table(tmp_path_factory.mktemp("empty"), "models", "page")


@pytest.fixture
def page(root):
    """A page's markdown as the docs build gives it, the directives shown from root's script."""
    where = SimpleNamespace(file=SimpleNamespace(src_uri="page.md"))
    config = SimpleNamespace(config_file_path=str(root / "mkdocs.yml"))
    return lambda markdown: hooks.on_page_markdown(markdown, where, config, None)


def test_several_names_come_one_after_the_other_in_one_block(page):
    assert page("::: code script.py ONE FOUR\n") == '```python title="script.py"\nONE = 1\n\nFOUR = 4\n```\n'


def test_an_indented_directive_gives_a_block_of_that_indentation(page):
    assert page("- a list\n\n    ::: code script.py FOUR\n") == \
        '- a list\n\n    ```python title="script.py"\n    FOUR = 4\n    ```\n'


def test_code_that_holds_a_fence_gets_a_longer_fence(page):
    shown = page("::: code script.py FENCE\n").splitlines()
    assert shown[0] == '````python title="script.py"' and shown[-1] == "````"
    assert shown[1:-1] == ['FENCE = """', "```", '"""']


def test_a_method_with_a_blank_line_comes_dedented_and_a_first_line_alone(tmp_path):
    # A blank line in a method has no indentation to share; the file's last line, a comment, is
    # no comment above a name on the first line.
    (tmp_path / "script.py").write_text("ONE = 1\n\n\nclass Two:\n    def three(self):\n        x = 3\n\n"
                                        "        return x\n# the file's last line\n")
    assert shown(tmp_path, "Two.three") == "def three(self):\n    x = 3\n\n    return x"
    assert shown(tmp_path, "ONE") == "ONE = 1"


def test_an_annotated_name_comes_as_a_constant_does(tmp_path):
    # Config's fields are annotated (context: int = 256): a page shows one as it shows LR.
    (tmp_path / "script.py").write_text("class Config:\n    # Positions.\n    context: int = 256\n\n\n"
                                        "LIMIT: int = 3\n")
    assert shown(tmp_path, "Config.context") == "# Positions.\ncontext: int = 256"
    assert shown(tmp_path, "LIMIT") == "LIMIT: int = 3"


def test_a_file_that_is_not_there_stops_the_build_naming_the_page(root):
    # A page that points at a script renamed or removed: mkdocs words a PluginError in one line,
    # with the page and its directive, where a FileNotFoundError would be a traceback.
    with pytest.raises(PluginError, match="^page: no file gone.py$"):
        hooks.excerpt(root, "gone.py", ["ONE"], "page")


def test_mkdocs_serve_rebuilds_when_a_script_or_the_course_s_report_changes(report_root):
    # A new run of course.py rewrites results/README.md: the pages that show its tables follow.
    (report_root / "script.py").write_text(SCRIPT)
    watched = []
    server = SimpleNamespace(watch=watched.append)
    config = SimpleNamespace(config_file_path=str(report_root / "mkdocs.yml"))
    assert hooks.on_serve(server, config, None) is server
    assert watched == [str(report_root / "script.py"), str(report_root / "results" / "README.md")]
