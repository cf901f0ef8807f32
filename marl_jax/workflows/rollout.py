"""The episode engine: runs a workflow over many problems, batching every live prompt.

Three rollout modes (docs/papers.md sections 1 and 3):
  independent  K trajectories per problem, each stepping its own environment (evaluation, GRPO
               baselines, one-turn MAGRPO groups).
  tree         AT-GRPO tree sampling: one state per problem; at each agent step K replies are
               sampled from that same state, each is stepped on its own clone and rewarded, and
               the clone with the best reward for the acting agent becomes the state every
               branch continues from. Every (problem, turn, agent) group thus holds K samples
               with an identical prompt. The state stepped next is always the selected *clone*
               (PettingLLMs kept stepping the original after the first copy: not copied here).
  magrpo_tree  MAGRPO's multi-turn tree: at the start of every turn each live branch forks into
               K = G branches, each taking its own joint action (the turn's agents, in order, one
               reply each) and evolving on its own from there, so a problem grows G^T leaves.
               Node and parent ids follow `batch.child_traj` / `batch.parent_node`; the `magrpo`
               estimator turns them into `R = r + gamma * mean(children)` minus the sibling mean.

Episodes advance independently. Each live episode submits its next request(s) (one, or K in
tree mode and at a magrpo_tree fork) to a `Responder` once its previous reply is stepped;
replies come back as they finish, a tree group is stepped once its own K siblings are in, and a
tool agent's program and every env step (a code env's judge runs programs too) run in worker
threads while the engine keeps decoding the other episodes (`_Run`: rounds in an order that
does not depend on thread timing). An engine-backed policy (`training/llm_policy.py`) streams
replies from the continuous engine; a plain `Generate` function is served in lock-step waves
(`Waves`: every pending request in one call per policy, once every running job has returned),
which is also what the static engine does. Every request carries its identity (episode, turn,
agent, sample), from which an engine-backed policy derives its sampling key, so replies do not
depend on the order in which episodes advance; the rollout's samples are put in one canonical
order at the end (the order of lock-step waves: by step, then episode lineage, then candidate),
so a rollout returns the same samples whichever responder served it.

Rewards: an environment step returns additive agent-keyed contributions. The acting agent's entry
goes to the sample just produced; entries for other agents go to those agents' samples of the same
turn (in tree mode to all K samples of that group: they share the state the contribution is about,
and a constant shift within a group leaves its advantages unchanged).

Decision rewards (learned orchestration): an env whose agents make orchestration decisions (when to
stop, ...) is an `envs.base.RewardsDecisions`; its `final_rewards()`, settled when the episode ends,
is added to every sample of that agent in the trajectory, since a decision is judged by the episode
it led to; the trace records the sum as the `orchestration` channel. A step's info drives the
orchestration events: "decision" an `orchestrator_decision`, "spawn" (worker names) one `spawn`
each, "aggregate" (worker names) an `aggregate` event with edges from those workers' replies, then
their `despawn`. Only independent rollouts may carry decision rewards: in the tree modes a sample's
branch is not the episode's. Each sample keeps the discrete `state` its agent observed
(`envs.base.Observation.state`, checked against the workflow's `num_states`), so independent
trajectories' decisions can be grouped with the decisions taken in the same state (`group_by`
"problem_turn_agent_state"); a workflow with states records it on each decision event
(`observed_state`).

Team rewards (the global term, `alpha * team + local`): in the tree modes each sample carries the
team reward (1 if solved) of *its own branch's* state right after its step, as PettingLLMs adds it
per branch when the branch is stepped; a group's K candidates thus differ where their states do.
Independent trajectories carry the episode's final outcome on every sample (Dr. MAS).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from marl_jax.algos import batch as batch_lib
from marl_jax.envs import actions as actions_lib
from marl_jax.envs import base as envs_base
from marl_jax.sandbox import runner as sandbox
from marl_jax.traces.recorder import ORCHESTRATION, TEAM, TraceRecorder, agent_channel
from marl_jax.workflows import registry
from marl_jax.workflows.spec import Cursor, WorkflowSpec, advance, first_cursor

MODES = ("independent", "tree", "magrpo_tree")
ORCHESTRATOR = "orchestrator"
@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance: the registered env name and the keyword arguments that rebuild it."""

  task: str
  kwargs: dict[str, Any]
  problem_id: int

  def make(self) -> Any:
    return registry.make_env(self.task, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt for a policy. `env` is the state it came from; only scripted policies read it.
  `ids`: (episode, turn, agent id, sample), unique within a rollout; an engine-backed policy
  draws the reply with a key derived from them (`sampling.engine.request_key`)."""

  messages: list[dict[str, str]]
  agent: str
  env: Any
  ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Generation:
  """A policy's reply; token ids and log-probs are empty for scripted policies."""

  text: str
  prompt_ids: tuple[int, ...] = ()
  token_ids: tuple[int, ...] = ()
  logprobs: tuple[float, ...] = ()
  finish_reason: str = "stop"
  policy_version: int = 0  # the weights that produced it (the engine's `load` version)


# generate(requests, policy_id, params) -> one Generation per request, in order.
Generate = Callable[[Sequence[Request], int, Any], Sequence[Generation]]
# (ticket, request, policy id): a request submitted to a Responder; its reply comes back with
# the ticket.
Ticket = tuple[Hashable, Request, int]


class Responder(Protocol):
  """What the rollout talks to: takes requests, hands back replies as they are ready."""

  streams: bool  # replies arrive while others are pending (else all at once, in waves)

  def submit(self, tickets: Sequence[Ticket]) -> None: ...

  def collect(self) -> list[tuple[Hashable, Generation]]:
    """Advances the pending requests; returns the replies that are ready (possibly none)."""

  @property
  def pending(self) -> int: ...


@runtime_checkable
class Serving(Protocol):
  """A policy backed by engines: `serve(params)` loads weights and returns its Responder."""

  def serve(self, params: Any) -> Responder: ...


class Waves:
  """A `Generate` function as a Responder: every pending request in one call per policy (in
  policy order, requests in submission order), all replies at once."""

  streams = False

  def __init__(self, generate: Generate, params: Any):
    self.generate, self.params = generate, params
    self._queue: list[Ticket] = []

  def submit(self, tickets: Sequence[Ticket]) -> None:
    self._queue.extend(tickets)

  @property
  def pending(self) -> int:
    return len(self._queue)

  def collect(self) -> list[tuple[Hashable, Generation]]:
    by_policy: dict[int, list[Ticket]] = defaultdict(list)
    for ticket in self._queue:
      by_policy[ticket[2]].append(ticket)
    self._queue = []
    out = []
    for policy_id, items in sorted(by_policy.items()):
      replies = list(self.generate([r for _, r, _ in items], policy_id, self.params))
      if len(replies) != len(items):
        raise ValueError(f"generate returned {len(replies)} replies for {len(items)} prompts "
                         f"(policy {policy_id})")
      out += [(ticket, reply) for (ticket, _, _), reply in zip(items, replies)]
    return out


@dataclasses.dataclass
class Sample:
  """One LLM call: the unit of training (AT-GRPO). `reward` accumulates over its turn."""

  problem_id: int
  traj_id: int
  turn: int
  agent: str
  agent_id: int
  policy_id: int
  branch: int  # which of the K candidates (tree) or trajectories (independent) produced it
  parent: int  # index of the selected sample this prompt's state came from; -1 at the start
  messages: list[dict[str, str]]
  generation: Generation
  reward: float = 0.0
  team_reward: float = 0.0  # task success: of the branch after this step (tree modes) or episode
  selected: bool = True  # tree mode: whether this candidate's state was continued
  trained: bool = True  # False: in its group's statistics, in no loss (config.train.agents)
  state: int = 0  # the state the agent observed (`envs.base.Observation.state`)
  action: str | None = None  # what the env parsed from the reply (`envs.base.parsed_action`)


@dataclasses.dataclass
class Episode:
  problem_id: int
  traj_id: int
  solved: bool
  turns: int
  rewards: dict[str, float]
  trace: dict[str, Any] | None
  content: dict[str, str]


@dataclasses.dataclass
class RolloutResult:
  samples: list[Sample]
  episodes: list[Episode]
  safety_events: int = 0  # env steps that raised on a reply (each scored as a failed sample)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  mode: str = "independent"
  k: int = 4  # branches (tree), trajectories (independent) or joint actions per node (magrpo_tree)
  tool_timeout_s: float = 5.0
  tool_memory_mb: int = 512
  record_traces: bool = True
  trace_clock: str = "wall"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown rollout mode {self.mode!r}; expected one of {MODES}")
    if self.k < 1:
      raise ValueError(f"k must be >= 1; got {self.k}")


@dataclasses.dataclass
class _Episode:
  """A live episode: one env state and its workflow cursor, plus bookkeeping."""

  problem: Problem
  traj_id: int
  env: Any
  cursor: Cursor
  recorder: TraceRecorder | None
  lineage: tuple[int, ...] = ()  # its place among the live episodes of lock-step waves
  steps: int = 0  # agent steps taken so far (the wave it is in)
  # this turn's samples; empty exactly at the start of a turn (where magrpo_tree forks)
  open: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  channels: dict[str, float] = dataclasses.field(default_factory=dict)
  samples: list[int] = dataclasses.field(default_factory=list)
  parent: int = -1
  last_event: str | None = None
  replies: dict[str, str] = dataclasses.field(default_factory=dict)  # agent -> its last message


def check_decision_rewards(env: Any, task: str, mode: str) -> None:
  """An env that credits decisions with the episode they led to (`final_rewards`) needs each
  episode on its own: ValueError naming `rollout.mode` otherwise."""
  if isinstance(env, envs_base.RewardsDecisions) and mode != "independent":
    raise ValueError(f"rollout.mode={mode!r}: {task!r} credits decisions with the episode they "
                     "led to, which shared tree branches cannot carry; expected "
                     "rollout.mode='independent'")


def rollout(problems: Sequence[Problem], spec: WorkflowSpec, policy: Generate | Serving,
            params: Any, cfg: RolloutConfig) -> RolloutResult:
  """Runs every problem to the end of its episode(s); returns all samples and episodes.
  `policy`: an engine-backed policy (`Serving`, fed `params`) or a `Generate` function."""
  responder = policy.serve(params) if isinstance(policy, Serving) else Waves(policy, params)
  trajs, branching = batch_lib.id_layout(cfg.mode, cfg.k, spec.max_turns)
  starts = [_start(p, spec, cfg, traj_id=batch_lib.traj_id(p.problem_id, j, trajs))
            for p in problems for j in range(cfg.k if cfg.mode == "independent" else 1)]
  if starts:
    check_decision_rewards(starts[0].env, starts[0].problem.task, cfg.mode)
  run = _Run(spec, cfg, responder)
  for i, ep in enumerate(starts):
    ep.lineage = (i,)
    run.launch(ep)
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    run.pool = pool
    run.loop()
  order = sorted(range(len(run.samples)), key=run.order.__getitem__)
  at = {old: new for new, old in enumerate(order)}
  samples = [dataclasses.replace(run.samples[i], parent=at.get(run.samples[i].parent, -1))
             for i in order]
  run.episodes.sort(key=lambda e: e.traj_id)
  return RolloutResult(samples, run.episodes, run.safety_events)


class _Run:
  """One rollout's live state: episodes waiting for replies, programs or env steps, and what
  they made. Programs and env steps run in worker threads (`jobs`); everything that touches the
  shared records runs here, in the rollout's thread, in an order that does not depend on thread
  timing (so a rollout is reproducible run to run, a resumed run's included):

    each round: submit the requests launched last round (sorted by ticket), run one responder
    step while last round's jobs run in their threads, apply those jobs' results in the order
    they were submitted, then this step's replies (which submit the next round's jobs).

  The jobs of one round thus overlap the next engine step; an episode's next request waits one
  round for its env step. A responder that serves in waves (`streams` False) is only asked once
  no job runs, so its next wave holds every episode's next request, as lock-step waves did."""

  def __init__(self, spec: WorkflowSpec, cfg: RolloutConfig, responder: Responder):
    self.spec, self.cfg, self.responder = spec, cfg, responder
    self.samples: list[Sample] = []
    self.order: list[tuple] = []  # each sample's canonical sort key (see the module docstring)
    self.episodes: list[Episode] = []
    self.safety_events = 0
    self.pool: concurrent.futures.ThreadPoolExecutor | None = None
    # (steps, lineage) -> the episode, its observation and its replies so far
    self.waiting: dict[tuple, tuple[_Episode, envs_base.Observation, list[Generation | None]]] = {}
    self.launched: list[Ticket] = []  # requests to submit at the next round
    self.jobs: list[tuple[concurrent.futures.Future, Callable[[Any], None]]] = []

  def launch(self, ep: _Episode) -> None:
    """Queues the request(s) of ep's next step: K at a tree step or a magrpo_tree fork."""
    spec, agent = self.spec, ep.cursor.agent
    obs = ep.env.observe(agent)
    if not (isinstance(obs.state, int) and 0 <= obs.state < spec.num_states):
      raise ValueError(f"{type(ep.env).__name__}.observe({agent!r}) gave state {obs.state!r}; "
                       f"expected an int in [0, {spec.num_states}) (the workflow's num_states)")
    fork = self.cfg.mode == "magrpo_tree" and not ep.open
    count = self.cfg.k if self.cfg.mode == "tree" or fork else 1
    uid = (ep.steps, ep.lineage)  # unique among waiting episodes, and their canonical order
    self.waiting[uid] = (ep, obs, [None] * count)
    messages = obs.messages()
    ids = (ep.traj_id, ep.cursor.turn, spec.agent_id(agent))
    self.launched += [((uid, j), Request(messages, agent, ep.env, ids + (j,)),
                       spec.policy_id(agent)) for j in range(count)]

  def loop(self) -> None:
    """Rounds (see the class docstring) until every episode has finished."""
    while self.waiting:
      if self.launched:
        self.responder.submit(sorted(self.launched, key=lambda t: t[0]))
        self.launched = []
      running, self.jobs = self.jobs, []
      ask = self.responder.pending and (self.responder.streams or not running)
      replies = self.responder.collect() if ask else []
      for future, done in running:
        done(future.result())
      for (uid, j), reply in replies:
        self._reply(uid, j, reply)

  def _submit(self, fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
    self.jobs.append((self.pool.submit(fn), done))

  def _reply(self, uid: tuple, j: int, reply: Generation) -> None:
    ep, _, replies = self.waiting[uid]
    replies[j] = reply
    if any(r is None for r in replies):
      return  # a tree group waits for its own K siblings
    if ep.cursor.agent not in self.spec.tool_agents:
      self._step(uid, [None] * len(replies))
      return
    outputs = [""] * len(replies)  # a reply with no program yields no output
    programs = [(i, actions_lib.extract_code(gen.text)) for i, gen in enumerate(replies)]
    programs = [(i, code) for i, code in programs if code is not None]
    if not programs:
      self._step(uid, outputs)
      return
    left = [len(programs)]
    run = functools.partial(sandbox.run, timeout_s=self.cfg.tool_timeout_s,
                            memory_mb=self.cfg.tool_memory_mb)
    for i, code in programs:
      def done(result, i=i):
        outputs[i] = result.stdout if result.ok else f"{result.stdout}\n[error: {result.error}]"
        left[0] -= 1
        if not left[0]:
          self._step(uid, outputs)
      self._submit(functools.partial(run, code), done)

  def _step(self, uid: tuple, tool_outputs: list[str | None]) -> None:
    """Steps the episode with its replies (each branch with its own at a fork) in a worker,
    then records the steps and launches what follows or finishes the episode(s)."""
    ep, obs, replies = self.waiting[uid]
    cfg = self.cfg
    if cfg.mode == "magrpo_tree" and not ep.open:  # one branch per joint action
      _, branching = batch_lib.id_layout(cfg.mode, cfg.k, self.spec.max_turns)
      steps = [(b, [replies[g]], [tool_outputs[g]])
               for g, b in enumerate(_fork(ep, cfg.k, branching, self.spec.max_turns))]
    else:
      steps = [(ep, replies, tool_outputs)]
    self._submit(lambda: [_env_steps(*step) for step in steps],
                 lambda stepped: self._record(uid, steps, stepped))

  def _record(self, uid: tuple, steps: list, stepped: list[list[Stepped]]) -> None:
    ep, obs, _ = self.waiting.pop(uid)
    per_branch_team = self.cfg.mode != "independent"
    for g, ((branch, gens, outs), results) in enumerate(zip(steps, stepped)):
      first = len(self.samples)
      self.safety_events += _step_episode(branch, self.spec, obs, gens, outs, results,
                                          self.samples, self.cfg.mode == "tree",
                                          per_branch_team)
      self.order += [(ep.steps, ep.lineage, g + j) for j in range(len(self.samples) - first)]
      branch.steps = ep.steps + 1
      if len(steps) > 1:
        branch.lineage = ep.lineage + (g,)
      if branch.cursor.agent is None:
        self.episodes.append(_finish(branch, self.samples, per_branch_team))
      else:
        self.launch(branch)


def _fork(ep: _Episode, k: int, branching: int, max_turns: int) -> list[_Episode]:
  """The K branches of `ep` at the start of its turn (magrpo_tree): same state and history, each
  its own trajectory id and trace. The env is shared: every step runs on a clone of it. No sample
  of the new turn exists yet, so each branch starts with an empty `open`."""
  turn = ep.cursor.turn
  return [dataclasses.replace(
      ep, traj_id=batch_lib.child_traj(ep.traj_id, turn, g, branching, max_turns),
      recorder=None if ep.recorder is None else ep.recorder.fork(), open={},
      channels=dict(ep.channels), samples=list(ep.samples), replies=dict(ep.replies))
      for g in range(k)]


def _start(problem: Problem, spec: WorkflowSpec, cfg: RolloutConfig, traj_id: int) -> _Episode:
  env = problem.make()
  recorder = None
  if cfg.record_traces:
    recorder = TraceRecorder(problem.task, json.dumps(problem.kwargs, sort_keys=True),
                             topology=spec.topology, clock=cfg.trace_clock)
  ep = _Episode(problem, traj_id, env, first_cursor(spec), recorder)
  if recorder is not None:
    ep.last_event = recorder.event("orchestrator_decision", ORCHESTRATOR,
                                   env_kwargs=problem.kwargs, mode=cfg.mode, k=cfg.k,
                                   agents=list(spec.agents), traj_id=traj_id)
  return ep


# (the env after the step, its StepResult or None, the exception the step raised or None)
Stepped = tuple[Any, envs_base.StepResult | None, Exception | None]


def _env_steps(ep: _Episode, replies: list[Generation], tool_outputs: list[str | None]
               ) -> list[Stepped]:
  """Steps each reply on its own clone of ep's env (a worker thread runs this: the envs are the
  episode's own, and a code env's judge runs in the sandbox meanwhile)."""
  agent, out = ep.cursor.agent, []
  for gen, tool_output in zip(replies, tool_outputs):
    env = ep.env.clone()
    kwargs = {} if tool_output is None else {"tool_output": tool_output}
    try:
      out.append((env, env.step(agent, gen.text, **kwargs), None))
    except sandbox.IsolationUnavailable:
      raise  # the run's configuration, not the reply, is at fault
    except Exception as e:  # a reply must never stop the run: a failed sample, ending its branch
      out.append((ep.env.clone(), None, e))
  return out


def _step_episode(ep: _Episode, spec: WorkflowSpec, obs: envs_base.Observation,
                  replies: list[Generation], tool_outputs: list[str | None],
                  stepped: list[Stepped], samples: list[Sample], tree: bool,
                  per_branch_team: bool) -> int:
  """Records each reply (to the prompt `obs`) stepped on its own clone (`_env_steps`), keeps the
  best (tree) or the only one; returns how many of the steps raised (safety events).
  With `per_branch_team` each sample's team reward is its own clone's success after the step."""
  agent, turn, messages = ep.cursor.agent, ep.cursor.turn, obs.messages()
  candidates, raised = [], 0
  for j, (gen, (env, result, error)) in enumerate(zip(replies, stepped)):
    if error is not None:
      result = _safety_event(ep, agent, error)
      raised += 1
    samples.append(Sample(ep.problem.problem_id, ep.traj_id, turn, agent, spec.agent_id(agent),
                          spec.policy_id(agent), j if tree else ep.traj_id, ep.parent,
                          messages, gen, reward=result.rewards.get(agent, 0.0),
                          team_reward=_team_reward(env) if per_branch_team else 0.0,
                          state=obs.state, action=envs_base.parsed_action(result)))
    candidates.append((len(samples) - 1, env, result))
  best = max(range(len(candidates)),  # on a tie, a branch whose step did not raise
             key=lambda j: (candidates[j][2].rewards.get(agent, float("-inf")),
                            "safety_event" not in candidates[j][2].info))
  chosen_index, env, result = candidates[best]
  for index, _, _ in candidates:
    samples[index].selected = index == chosen_index
  ep.samples += [index for index, _, _ in candidates]
  ep.open[agent] = [index for index, _, _ in candidates]
  for other, value in result.rewards.items():
    if other != agent:
      for index in ep.open.get(other, ()):
        samples[index].reward += value
  for name, value in result.rewards.items():
    ep.channels[agent_channel(name)] = ep.channels.get(agent_channel(name), 0.0) + value
  if ep.recorder is not None:
    _record_step(ep, spec, replies[best], tool_outputs[best], len(candidates), best, result.info,
                 obs.state)
  ep.env, ep.parent = env, chosen_index
  ep.cursor = advance(spec, ep.cursor, replies[best].text, result.done)
  if ep.cursor.turn != turn:
    ep.open = {}
  return raised


def _safety_event(ep: _Episode, agent: str, error: Exception) -> envs_base.StepResult:
  """The step result standing in for an env step that raised: reward 0 (a format failure), the
  episode ends there (the env state is unknown), a `safety_event` in the trace."""
  message = f"{type(error).__name__}: {error}"[:500]
  if ep.recorder is not None:
    ep.recorder.event("safety_event", agent, content=message, after=[(ep.last_event, "causal")],
                      turn=ep.cursor.turn, reason="env_step_raised")
  return envs_base.StepResult(agent, None, {agent: 0.0}, True,
                              {"format_error": True, "safety_event": message})


def _record_step(ep: _Episode, spec: WorkflowSpec, gen: Generation, tool_output: str | None,
                 num_candidates: int, chosen: int, info: dict[str, Any], observed: int) -> None:
  rec = ep.recorder
  agent = ep.cursor.agent
  reply = rec.event("message", agent, content=gen.text, after=[(ep.last_event, "causal")],
                    role=agent, sender=agent, tokens=len(gen.prompt_ids) + len(gen.token_ids),
                    turn=ep.cursor.turn, candidates=num_candidates, selected=chosen)
  ep.last_event = ep.replies[agent] = reply
  if "decision" in info:  # the reply was an orchestration decision: what and in which state
    state = {k: info[k] for k in ("correct", "round") if k in info}
    if "round" in info:  # a stop/continue decision: the rounds the cap still allowed
      state["rounds_left"] = spec.max_turns - ep.cursor.turn - 1
    if spec.num_states > 1:  # what the decider observed (its group's state factor)
      state["observed_state"] = observed
    ep.last_event = rec.event("orchestrator_decision", agent, after=[(reply, "causal")],
                              turn=ep.cursor.turn, decision=info["decision"],
                              channel=ORCHESTRATION, **state)
  decided = ep.last_event
  for worker in info.get("spawn", ()):
    rec.event("spawn", agent, after=[(decided, "spawn")], receiver=worker, turn=ep.cursor.turn,
              channel=ORCHESTRATION)
  if "aggregate" in info:  # the aggregator's reply combines the spawned workers' replies
    workers = info["aggregate"]
    ep.last_event = rec.event(
        "aggregate", agent, after=[(ep.replies[w], "aggregate") for w in workers],
        turn=ep.cursor.turn, workers=list(workers), correct=bool(info.get("correct")),
        any_worker_correct=bool(info.get("any_worker_correct")), channel=ORCHESTRATION,
        **{k: info[k] for k in ("speedup",) if k in info})
    for worker in workers:
      rec.event("despawn", worker, after=[(ep.last_event, "causal")], turn=ep.cursor.turn)
  if tool_output is not None:
    call = rec.event("tool_call", agent, content=actions_lib.extract_code(gen.text) or "",
                     after=[(reply, "tool_dependency")], tool="python_sandbox")
    ep.last_event = rec.event("tool_result", "python_sandbox", content=tool_output,
                              after=[(call, "return")], tool="python_sandbox", trusted=False,
                              reply=reply)


def _team_reward(env: Any) -> float:
  """The team's (global) reward of a state: task success."""
  return 1.0 if env.solved else 0.0


def _finish(ep: _Episode, samples: list[Sample], per_branch_team: bool) -> Episode:
  solved = bool(ep.env.solved)
  team = _team_reward(ep.env)
  if not per_branch_team:  # independent trajectories: the episode's outcome on every sample
    for index in ep.samples:
      samples[index].team_reward = team
  rewards = dict(ep.channels, **{TEAM: team})
  if isinstance(ep.env, envs_base.RewardsDecisions):  # judged by the episode they led to
    final = ep.env.final_rewards()
    for index in ep.samples:
      samples[index].reward += final.get(samples[index].agent, 0.0)
    rewards[ORCHESTRATION] = sum(final.values())
  trace, content = None, {}
  if ep.recorder is not None:
    ep.recorder.event("return", ORCHESTRATOR, after=[(ep.last_event, "return")], solved=solved)
    for channel, value in rewards.items():
      ep.recorder.set_reward(channel, value)
    ep.recorder.set_metric("task_success", team)
    trace, content = ep.recorder.finish()
  turns = 1 + max(samples[index].turn for index in ep.samples)
  return Episode(ep.problem.problem_id, ep.traj_id, solved, turns, rewards, trace, content)
