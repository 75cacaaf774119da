"""One class per name across ``pd_fsm``: two classes that share a name make a reader (and a
traceback, a log line, a ``repr``) guess which one is meant. Read from every module's source, so
a class defined inside a function or under ``if TYPE_CHECKING`` counts too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pd_fsm

ROOT = Path(pd_fsm.__file__).parent


def class_sites(root: Path = ROOT) -> dict[str, list[str]]:
    """Class name -> where each class of that name is defined ("path:line")."""
    sites: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        where = path.relative_to(root.parent).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                sites[node.name].append(f"{where}:{node.lineno}")
    return dict(sites)


def duplicates(sites: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: where for name, where in sorted(sites.items()) if len(where) > 1}


def test_no_two_classes_share_a_name() -> None:
    found = duplicates(class_sites())
    assert not found, "class names defined more than once in pd_fsm (rename one of each):\n" + (
        "\n".join(f"{name}: {', '.join(where)}" for name, where in found.items()))


def test_the_scan_finds_a_duplicate(tmp_path: Path) -> None:
    """Not vacuous: two modules' classes of one name, one of them nested in a function, are
    reported; distinct names are not."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("class Link:\n    pass\n\nclass Only:\n    pass\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    class Link:\n        pass\n")
    assert duplicates(class_sites(pkg)) == {"Link": ["toy/a.py:1", "toy/sub/b.py:2"]}
