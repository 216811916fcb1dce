"""
An mkdocs hook (mkdocs.yml: hooks) that shows the series' code in the pages, straight from
the scripts, so a page never holds a stale copy. A line of its own in a page,

    ::: code finetune.py collate

becomes a fenced Python block titled with the file's name, holding the source of `collate`
as it stands in finetune.py now. The name can be

- a function or class: `collate`, `Config` (with its decorators);
- a method: `GPT.generate`;
- a module-level constant: `LR` (with its comment on the line);
- a run of top-level statements: `BATCH..CLIP`, from the first to the last, with the
  comments between them.

Comment lines right above a name (the first of a run), with no blank line between, come
with it: the why of a constant or a step, as the scripts write it above the line. A file's
first lines (#! or a coding line) never do.

Several names, separated by spaces, are shown one after the other in one block. The
directive may be indented (in a list or an admonition); the block keeps that indentation.
A file or name that is not there stops the build with a message, so a page can't silently
point at code that has gone. (The line is replaced wherever it stands, even in a fenced
block: a page can't show the directive itself as an example.) The scripts are read with
Python's ast module: no markers in them, nothing to keep in step by hand.

The same for the series' results: a line of its own

    ::: report models

becomes that table of results/README.md, the report of the series' own run of course.py, as
course.py wrote it: `steps` (each step's command and minutes), `models` (the table of
models, each a mean over the training seeds), `video` (the video's figures) or `each` (each
model on its own). A page that shows the course's figures shows them word for word, and a
new run of the course changes every page at once. A table that is not there stops the build.
"""
import ast
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

FILE_HEADER = ("#!", "# -*-")  # comment lines that speak for the file, not for the statement below them
DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)::: code (?P<file>\S+\.py)(?P<names>(?: +\S+)+) *$", re.MULTILINE)
REPORT_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)::: report (?P<table>\S+) *$", re.MULTILINE)
REPORT = Path("results") / "README.md"
# Each table of the report, by a column that only its header has.
REPORT_TABLES = {"steps": "| minutes |", "models": "| training seeds |", "video": "| KL per story at the end |",
                 "each": "| uses of a used word |"}


def top_level_name(node):
    """The name a top-level statement defines, or None."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def first_line(node, lines):
    """A definition's first line: its decorators, and the comment lines right above it, included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    while first > 1 and is_comment_on_what_follows(lines[first - 2]):
        first -= 1
    return first


def is_comment_on_what_follows(line):
    return line.lstrip().startswith("#") and not line.startswith(FILE_HEADER)


def find(tree, dotted, where):
    """The node that a name (or Class.method) defines."""
    body = tree.body
    node = None
    for part in dotted.split("."):
        node = next((n for n in body if top_level_name(n) == part), None)
        if node is None:
            raise PluginError(f"{where}: no {dotted!r} in the file")
        body = getattr(node, "body", [])
    return node


def dedent(lines):
    """Lines without the indentation they share (a method's, say)."""
    margin = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return [line[margin:] for line in lines]


def excerpt(root, file, names, where):
    path = root / file
    if not path.is_file():
        raise PluginError(f"{where}: no file {file}")
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source, filename=file)
    parts = []
    for name in names:
        first, _, last = name.partition("..")
        start, end = find(tree, first, where), find(tree, last or first, where)
        a, b = first_line(start, lines), end.end_lineno
        if a > b:
            raise PluginError(f"{where}: {name!r} runs backwards in the file")
        parts.append("\n".join(dedent(lines[a - 1:b])))
    return "\n\n".join(parts)


def tables(text):
    """The markdown tables of a text, each as its lines."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    return found


def report_table(root, name, where):
    """One table of the course's report, by its name in REPORT_TABLES."""
    if name not in REPORT_TABLES:
        raise PluginError(f"{where}: no table {name!r}; the report's are {', '.join(REPORT_TABLES)}")
    path = root / REPORT
    if not path.is_file():
        raise PluginError(f"{where}: no {REPORT.as_posix()}")
    table = next((t for t in tables(path.read_text(encoding="utf-8")) if REPORT_TABLES[name] in t[0]), None)
    if table is None:
        raise PluginError(f"{where}: {REPORT.as_posix()} has no table of {name}")
    return "\n".join(table)


def on_page_markdown(markdown, page, config, files):
    root = Path(config.config_file_path).parent

    def replace(match):
        indent, file, names = match["indent"], match["file"], match["names"].split()
        where = f"{page.file.src_uri}: ::: code {file} {' '.join(names)}"
        code = excerpt(root, file, names, where)
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", code)), default=0))
        block = [f'{fence}python title="{file}"', *code.splitlines(), fence]
        return "\n".join(indent + line if line else line for line in block)

    def replace_report(match):
        table = report_table(root, match["table"], f"{page.file.src_uri}: ::: report {match['table']}")
        return "\n".join(match["indent"] + line for line in table.splitlines())

    return REPORT_DIRECTIVE.sub(replace_report, DIRECTIVE.sub(replace, markdown))


def on_serve(server, config, builder):
    """mkdocs serve: rebuild when a script or the course's report changes, not only a page."""
    root = Path(config.config_file_path).parent
    for watched in [*sorted(root.glob("*.py")), root / REPORT]:
        server.watch(str(watched))
    return server
