"""The shape of the source stays as docs/layout.md draws it: narrow signatures, keyword-built records, and imports
that point down the layers (an `ast` walk over src/memo, so that these stay true after the change that made them)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "memo"
# each folder's layer: a module imports from its own layer or those below, never above (docs/layout.md)
LAYERS = {"": 0, "plan": 1, "parallel": 1, "cost": 2, "train": 3}
APPLICATIONS = ("cli.py", "eval.py", "__main__.py")  # the verbs: above every library layer
KEYWORD_BUILT = ("cost", "train", "config.py", "job.py")  # where records are written by keyword (presets included)


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _parameters(node: ast.FunctionDef) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (bool(names) and names[0].arg in ("self", "cls"))


def _functions():
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(SRC)}:{node.name}", _parameters(node)


def _layer(path: Path) -> int:
    parts = path.relative_to(SRC).parts
    if len(parts) == 1 and parts[0] in APPLICATIONS:
        return max(LAYERS.values()) + 1
    return LAYERS.get(parts[0] if len(parts) > 1 else "", 0)


def _imported_layer(path: Path, node: ast.ImportFrom) -> int | None:
    """Returns the layer of what a relative import names (None for an import within its own folder)."""
    if node.level == 0:
        return None
    package = path.relative_to(SRC).parts[:-1][: len(path.relative_to(SRC).parts) - node.level]
    target = [*package, *(node.module.split(".") if node.module else [])]
    if not target:  # `from .. import device`: top-level modules by name
        names = [alias.name for alias in node.names]
        return max(LAYERS.get(n, 0) for n in names)
    if len(target) == 1 and f"{target[0]}.py" in APPLICATIONS:
        return max(LAYERS.values()) + 1
    return LAYERS.get(target[0], 0) if target[0] in LAYERS else 0


def upward_imports() -> list[str]:
    """Returns every import that points up a layer, as 'file -> module'."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                layer = _imported_layer(path, node)
                if layer is not None and layer > _layer(path):
                    found.append(f"{path.relative_to(SRC)} -> {'.' * node.level}{node.module or ''}")
    return found


def _dataclasses() -> set[str]:
    names = set()
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def positional_records() -> list[str]:
    """Returns the calls that build a dataclass from more than five positional arguments where records are written
    by keyword."""
    records, found = _dataclasses(), []
    for path, tree in _modules():
        where = path.relative_to(SRC).parts[0]
        if where not in KEYWORD_BUILT and path.name != "hardware.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and len(node.args) > 5:
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in records or name == "cls":
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    return found


def test_few_functions_take_ten_parameters_or_more():
    wide = [f"{name} ({n})" for name, n in _functions() if n >= 10]
    assert len(wide) <= 4, wide


def test_the_estimate_takes_at_most_six_parameters():
    counts = dict(_functions())
    assert counts["cost/estimate.py:estimate"] <= 6
    others = ("estimate.py:max_seq", "sweep.py:sweep", "predict.py:predict_run")
    assert all(counts[f"cost/{name}"] <= 6 for name in others)


def test_records_are_built_by_keyword_where_they_are_written():
    assert positional_records() == []


def test_no_import_points_up_a_layer():
    assert upward_imports() == []


def test_the_walk_sees_what_it_counts():
    """The counters are not vacuous: a wide function, an upward import and a positional record are all seen."""
    wide = ast.parse("def f(a, b, c, d, e, f, g, h, i, j): pass").body[0]
    assert _parameters(wide) == 10
    up = ast.parse("from ..train.data import x").body[0]
    assert _imported_layer(SRC / "cost" / "flops.py", up) == LAYERS["train"] > _layer(SRC / "cost" / "flops.py")
    assert _imported_layer(SRC / "model.py", ast.parse("from .plan.phases import x").body[0]) == LAYERS["plan"]
    assert "Job" in _dataclasses() and "GPUSpec" in _dataclasses()
