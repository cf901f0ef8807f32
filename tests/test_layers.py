"""The package's layering, read from its imports: no upward import and no import cycle.

Layers, bottom to top (docs/design.md): models, sandbox, traces, registry, errors, shapes |
envs, sampling | algos, workflows | parallel | training. A module may import from its own layer
or below. Every `import` statement counts, including those inside functions (a function-level
import is still a dependency: it only hides a cycle from Python, not from a reader) and those
under `if TYPE_CHECKING:` (a module that needs another's types depends on it).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "marl_jax"
LAYERS = {
    "models": 0, "sandbox": 0, "traces": 0, "registry": 0, "errors": 0, "shapes": 0,
    "envs": 1, "sampling": 1,
    "algos": 2, "workflows": 2,
    "parallel": 3,
    "training": 4,
}


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """marl_jax modules that `name` imports (a `from pkg import mod` names the module)."""
  found = set()
  tree = ast.parse(path.read_text(), str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                 for a in node.names]
    else:
      continue
    found.update(t for t in targets if t.startswith("marl_jax.") and t in known and t != name)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  known = set(modules)
  return {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(module: str) -> int | None:
  parts = module.split(".")
  return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
  top = {m.split(".")[1] for m in _modules() if m.count(".") >= 1}
  assert top <= set(LAYERS), f"give these a layer in LAYERS: {sorted(top - set(LAYERS))}"


def test_no_upward_imports():
  upward = sorted(f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
                  for a, deps in _graph().items() for b in deps
                  if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
  assert not upward, "\n".join(upward)


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, int] = {}  # 1 on the stack, 2 done
  cycles = []

  def visit(node: str, stack: list[str]) -> None:
    state[node] = 1
    stack.append(node)
    for dep in sorted(graph[node]):
      if state.get(dep) == 1:
        cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, stack)
    stack.pop()
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [])
  assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from marl_jax.parallel import sharding", {"marl_jax.parallel.sharding"}),
    ("from marl_jax.algos.batch import GroupSpace", {"marl_jax.algos.batch"}),
    ("def f():\n  import marl_jax.training.trainer", {"marl_jax.training.trainer"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from marl_jax.parallel import sharding",
     {"marl_jax.parallel.sharding"}),
])
def test_the_import_reader(tmp_path, source, expected):
  """The reader sees module imports, `from package import module`, function-level imports and
  annotation-only ones (they are cycle edges too)."""
  path = tmp_path / "m.py"
  path.write_text(source)
  assert _imports("marl_jax.x", path, set(_modules())) == expected
