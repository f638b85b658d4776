"""`OpenAIAgentExecutor`: episodes written as ordinary async Python against the OpenAI API (`--rollout.agent-file`).

The agent file defines

    async def agent(client: openai.AsyncOpenAI, example: dict) -> float:
        out = await client.completions.create(model="policy", prompt=example["prompt"])
        ...more calls, tools, environments...
        return reward

`client` is the official `openai.AsyncOpenAI`, its base URL pointing at this process's `agents.openai_server`
(which generates with the run's vLLM engines and records every call as token ids); `example` is a copy of the dataset
row (prompt, prompt_ids, label, datasource, ...). The returned number is the episode's reward (its 0-1 score for the
DAPO filter: the reward clipped to [0, 1]). The trained trajectory is rebuilt from the recorded calls
(`records.build_trajectory`): the model's tokens exactly as sampled, with action mask 1 and the engine's
log-probs, everything else in between with mask 0. Up to `--rollout.agent-concurrency` episodes run at once, and
their concurrent requests are batched into the engines.

The agents run on an event loop of their own in a thread of its own, all episodes on one loop, while the executor's loop
keeps their time and watches that loop (`LoopWatch`: why, how, and its limits). An agent that blocks it (a synchronous
`time.sleep`, `requests.get` or a CPU loop inside `async def agent`) for longer than `block_s` (0.5 s, or a quarter of
the timeout if that is less) gets the loop to itself, and the other episodes on it start again from the start (their
seeds give them the same samples) on a new shared loop; the second time an agent blocks, on loops and threads of their
own, as does every later episode (a warning says where the agent blocked). The blocking episode still ends at
`--rollout.agent-timeout-s`. So a blocking agent holds up the others for at most `block_s`, and agents that never block
pay for one thread, not one per episode. Loop-bound objects (asyncio locks, HTTP clients) belong inside the agent
function, and an agent closes the clients it makes (`async with`): one left to the garbage collector may be closed from
another thread's loop (the `openai` client's `__del__` schedules its `aclose` on whatever loop runs where the collection
happens): with agents/examples/pydantic_ai_agent.py's own client left open, about one episode in 1,000 waited until its
timeout.
State shared between episodes at module level needs a `threading.Lock`.

A failed episode ends without stopping the run: the agent raised (`raised`; an HTTP 4xx it did not catch:
`bad_request`), did not return within `--rollout.agent-timeout-s` (`timeout`; it is cancelled, and a thread still
running its Python code a second later gets `AgentAbandoned` raised inside it; the message says where in the agent
file it was blocking), returned something that is not a finite number (`bad_reward`), or made no model call
(`no_calls`: nothing to train on). Such an episode gets reward 0 (it counts as a failure in its group's baseline and
in rollout/reward_mean), a single masked token (action mask 0: nothing of it is trained on) and `finish_reason`
`agent_<kind>`; the step logs one warning line with the counts and the first error, and the metrics
`rollout/agent_errors` (failed episodes), `rollout/agent_timeouts`, `rollout/agent_bad_requests` (requests answered
4xx, caught or not), `rollout/agent_calls_mean`, `rollout/agent_dropped_calls` (calls outside the trained chain),
`rollout/agent_tool_calls_mean` (tool calls parsed per episode) and `rollout/tool_parse_errors_mean` (answers whose
tool-call markup did not parse, per episode; the first is logged). A batch where every episode fails raises
`AgentError` naming the agent file and the first error. An engine failure is not the agent's: it is raised as is.

Every trainer process that rolls out runs its own server (with `--train.ranks N`, each rank for its share).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import ctypes
import importlib.util
import inspect
import logging
import math
import ssl
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from agents.executor import Episode, Rollout
from agents.openai_server import OpenAIServer
from agents.records import build_trajectory, trajectory_routing
from agents.request_checks import MAX_REQUEST_BYTES

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """Every episode of a batch failed: the agent file is broken, not one episode unlucky."""


class AgentAbandoned(BaseException):
    """Raised inside the thread of an agent that was still running its code a second after its timeout (a blocked
    event loop; `LoopWatch.abandon`). A BaseException, so the agent's own `except Exception` does not swallow it."""


def load_agent(path: str):
    """`agent` from a Python file (`--rollout.agent-file`): `async def agent(client, example) -> float`. Errors name
    the file, and for a syntax error, an exception while importing it or an `agent` that is not `async def`, the
    line. The file checked before the run loads anything (`check_agent_file`) is not imported a second time."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--rollout.agent-file {path}: no such file")
    key = _file_key(file)
    if key in _checked:  # imported by the check at the run's start, unchanged since: that module, once
        return _checked.pop(key)
    spec = importlib.util.spec_from_file_location(f"cleanrlhf_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except SyntaxError as e:
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        code = f": {e.text.strip()!r}" if e.text and e.text.strip() else ""
        raise ValueError(f"--rollout.agent-file {path}, {where}: {e.msg}{code}") from e
    except Exception as e:  # an import, a name or a call at the top of the file failed
        lines = [
            f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == file.resolve()
        ]
        where = f", line {lines[-1]}" if lines else ""
        raise ValueError(f"--rollout.agent-file {path}{where}: importing it raised {type(e).__name__}: {e}") from e
    fn = getattr(module, "agent", None)
    if fn is None:
        raise AttributeError(f"--rollout.agent-file {path}: defines no `agent`; write `async def agent(client, "
                             "example) -> float`")  # fmt: skip
    if not inspect.iscoroutinefunction(fn):
        code = getattr(inspect.unwrap(fn), "__code__", None)
        here = code is not None and Path(code.co_filename).resolve() == file.resolve()
        where = f", line {code.co_firstlineno}" if here else ""
        raise AttributeError(f"--rollout.agent-file {path}{where}: `agent` is not an `async def` function (its calls "
                             "of the client must be awaited); write `async def agent(client, example) -> float`")  # fmt: skip
    return fn


_checked: dict[tuple, Callable] = {}  # agent files imported by `check_agent_file` -> `agent`, for `load_agent`


def _file_key(file: Path) -> tuple:
    stat = file.stat()
    return str(file.resolve()), stat.st_mtime_ns, stat.st_size


def check_agent_file(path: str, keep: bool = True) -> None:
    """Import the agent file (`load_agent`) before the run loads anything (DeepSpeed, Ray, vLLM): a syntax error, an
    import that fails or an `agent` that is not `async def` stops the run at once, naming the file and the line.
    `keep`: the executor made later in this process uses this import (the file is not run twice)."""
    fn = load_agent(path)
    if keep:
        _checked[_file_key(Path(path).expanduser())] = fn


def _unawaited(file: Path) -> list[tuple[int, str]]:
    """(line, code) of the calls in an agent file whose value is a coroutine and that are used as they are (a
    statement, assigned or returned; not under `await`, nor handed to another call such as `asyncio.gather`): a
    method of the client (the first parameter of `agent`, or a name `client`) or an `async def` of the file. For
    the message of an episode that failed on a coroutine (an `await` left out): a hint, not a rule."""
    import ast

    try:
        source = file.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, ValueError, SyntaxError):
        return []
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)}
    clients = {"client"} | {n.args.args[0].arg for n in ast.walk(tree)
                            if isinstance(n, ast.AsyncFunctionDef) and n.name == "agent" and n.args.args}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        statement = isinstance(node, ast.Expr | ast.Assign | ast.AnnAssign | ast.Return)
        if not statement or not isinstance(node.value, ast.Call):
            continue
        func = root = node.value.func
        while isinstance(root, ast.Attribute):
            root = root.value
        on_client = isinstance(func, ast.Attribute) and isinstance(root, ast.Name) and root.id in clients
        if on_client and func.attr in ("with_options", "copy"):  # the client's synchronous methods
            on_client = False
        if on_client or (isinstance(func, ast.Name) and func.id in own):
            code = (ast.get_source_segment(source, node) or "").splitlines()
            found.append((node.lineno, code[0] + (" ..." if len(code) > 1 else "") if code else ""))
    return sorted(found)


_EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("cleanrlhf_agent_episode", default=None)


class _Steps:
    """Awaits a coroutine a step at a time, and throws `CancelledError` into it at its next step once `gone()` says
    its episode left this loop. Why: a task's next step may already be queued on a loop that is blocked (its awaited
    result came in the same loop pass as the blocking agent's); when the loop runs again, that step runs before any
    cancel posted meanwhile (`call_soon_threadsafe` queues behind it) and would resume an agent whose episode was
    restarted elsewhere, or timed out. Only the first step after that is turned into the cancellation: what the
    agent's `finally` awaits then runs as under `Task.cancel`."""

    def __init__(self, coro, gone: Callable[[], bool]):
        self.coro, self.gone = coro, gone

    def __await__(self):
        coro, value, error, thrown = self.coro, None, None, False
        while True:
            if not thrown and self.gone():
                error, thrown = asyncio.CancelledError("the episode left this agent loop"), True
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as end:
                return end.value
            try:
                value, error = (yield step), None
            except BaseException as e:  # what the task threw in (its cancel): handed to the coroutine as it is
                value, error = None, e


ISOLATE_AFTER_BLOCKS = 2  # agents that blocked the shared loop this often get a loop each from then on
HTTP_CLIENT_EPISODES = 64  # episodes one kept HTTP pool serves before it is closed and a new one made


class _Restart(Exception):
    """An episode's loop was taken by another episode's agent blocking it: run the episode again on a loop of its
    own (its server record so far is dropped; its seeds give it the same samples)."""


# -- a blocked agent loop: how it is seen and how its thread is ended -------------------------------------------------
class LoopWatch:
    """The watch over an agent loop, kept from another thread (`_AgentLoop.watch`): is one task's synchronous code
    holding the loop (`held_by`), at which line of the agent file (`blocked_at`); and the last resort once its agent
    timed out: ending that code (`abandon`).

    Why: an agent is `async def`, but nothing stops it from making a synchronous call (`time.sleep`, `requests.get`,
    a CPU loop) that holds its event loop. Nothing else on that loop runs meanwhile: not the other episodes' agents
    on the shared loop, not `asyncio.wait_for`'s timeout, not a task's cancellation. So the loop is watched, and its
    code ended, from outside: from the executor's loop, in the trainer's thread.

    How:
    - `held_by(block_s)`, called every `block_s / 4` s by the executor's `_watch` while episodes run on the shared
      loop: it asks the loop to run a no-op callback (`call_soon_threadsafe`, which wakes it) once the last one has
      run, and reads the task the loop is inside now (`asyncio.current_task(loop)`, from this thread). A free loop
      runs the callback within milliseconds. When the callback has waited over `block_s` and the same task was
      current at every look for over `block_s`, that task holds the loop: it is returned (the executor then leaves
      the loop to its episode, `_leave_shared_loop_to`). A loop slowed down by many tasks' short steps (a hundred
      agents starting at once) answers late too, but another task is current from one look to the next.
    - `blocked_at(file)`: the line of `file` the loop's thread runs now (`sys._current_frames()`), for the warning
      and the timeout message.
    - `abandon()`: raises `AgentAbandoned` inside the loop's thread (CPython's `PyThreadState_SetAsyncExc`, through
      ctypes). `_AgentLoop.retire` has it called a second after cancelling the tasks of a loop whose agent timed
      out, if the thread still runs: the cancel could not run, because the loop is held.

    Limits:
    - Seeing is not stopping: the blocking code runs on; the other episodes move to another loop, and the blocking
      episode ends at `--rollout.agent-timeout-s`. Only the shared loop is watched: a loop of one episode holds up
      nobody else, and its timeout is kept by the executor's loop all the same.
    - A hold shorter than `block_s` (computing between awaits) is never seen, however often it happens; each one
      holds up the other episodes on the loop. A task seen at every look of a loop busy with many tasks would be
      taken for blocking: the episodes restarted for it sample the same tokens again (their seeds), so that costs
      time, not results. The task read is a snapshot: the loop may have moved on when it is used.
    - `abandon` ends Python code only: the exception is raised when the thread next runs Python bytecode. A CPU
      loop ends at once, a blocking call into C (`time.sleep`, a socket read) only when it returns; one that never
      returns keeps its (daemon) thread for good. Agent code that catches `BaseException` (or has a bare `except:`)
      can swallow it. It may land anywhere in the thread's Python code, asyncio's included, so a loop that got it
      is never used again (`_AgentLoop._serve` ends it either way)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self.loop, self.thread = loop, thread
        self.asked: float | None = None  # when the unanswered question to the loop was posted
        self.holder: asyncio.Task | None = None  # the task current at every look since `since`
        self.since = time.monotonic()

    def reset(self) -> None:
        """Count afresh: the next look sets the holder (each run of episodes starts its watch so)."""
        self.holder, self.since = None, time.monotonic()

    def held_by(self, block_s: float) -> asyncio.Task | None:
        """The task that has held the loop for over `block_s` (no callback run, the same task current at every
        look), or None. Called from the executor's loop every `block_s / 4` s; each call asks the loop again once the
        last question was answered."""
        task = asyncio.current_task(self.loop)
        waited = self._answering()
        now = time.monotonic()
        if task is None or task is not self.holder:
            self.holder, self.since = task, now
            return None
        return task if waited > block_s and now - self.since > block_s else None

    def _answering(self) -> float:
        """Seconds since the loop was asked to run a callback and has not (0 when it has: it is asked again)."""
        if self.asked is None:
            self.asked = time.monotonic()  # before posting: the loop may answer at once
            try:
                self.loop.call_soon_threadsafe(self._answer)
            except RuntimeError:  # closed: nothing runs on it any more
                self.asked = None
            return 0.0
        return time.monotonic() - self.asked

    def _answer(self) -> None:
        self.asked = None

    def blocked_at(self, file: Path) -> str | None:
        """`line N (function)` of `file` where the thread runs now: the agent holds its loop there (a coroutine that
        awaits is not on the thread's stack); None when it is not running the file's code."""
        frame = sys._current_frames().get(self.thread.ident)
        while frame is not None:
            if Path(frame.f_code.co_filename).resolve() == file:
                return f"line {frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return None

    def abandon(self) -> None:
        """Raise `AgentAbandoned` in the loop's thread if it still runs (what that ends: the class docstring)."""
        if self.thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident),
                                                       ctypes.py_object(AgentAbandoned))  # fmt: skip


class _AgentLoop:
    """A daemon thread running an event loop for agents: all the executor's episodes while no agent has blocked it
    (the shared loop), or one episode's at a time (after an agent blocked the shared loop: a loop per episode).

    One loop for all episodes is the fast way: 16 agents on 16 loops in 16 threads cost ~2 ms of CPU more per call
    than on one (each thread's every select() drops and retakes the GIL against the others). But `asyncio.wait_for`
    cannot end an agent that blocks the loop it runs on (a synchronous `time.sleep` or a CPU loop inside `async def
    agent`: nothing else on that loop runs until it yields), so the executor's own loop keeps the time and watches
    the shared one (`watch`, a `LoopWatch`): a loop that has not run a callback for `block_s` while an agent's task
    holds it is given to that agent, and the other episodes on it start again elsewhere. A loop whose agent timed out
    is retired, never reused: its tasks are cancelled, the loop stops when they end, and if the thread still runs a
    second later (the loop is blocked, so the cancel cannot run) `AgentAbandoned` is raised inside it
    (`LoopWatch.abandon`). An episode that left a loop (restarted elsewhere, timed out, its loop retired) runs none of
    its agent's code there again, even a step that was queued before the loop was blocked (`_Steps`)."""

    def __init__(self, shared: bool = False):
        self.shared = shared
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(self._new_task)
        self.owner: dict[asyncio.Task, str] = {}  # every live task an agent started (its main task too) -> episode
        self.futures: dict[str, asyncio.Future] = {}  # episode -> the executor loop's future of its outcome
        self.clients: list = []  # (httpx.AsyncClient, episodes served) kept for the next episodes on this loop
        self.uses: dict = {}  # the pools in use: episodes each served before
        # episodes that left this loop (restarted elsewhere, timed out), and whether the loop was retired: none of
        # their agents' code runs here again (`_Steps`)
        self.gone: set[str] = set()
        self.retired = False
        name = "agent-loop-shared" if shared else f"agent-loop-{id(self):x}"
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.watch = LoopWatch(self.loop, self.thread)  # is an agent's synchronous code holding it; ending that code
        self.thread.start()

    _of_thread: dict[int, _AgentLoop] = {}

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        _AgentLoop._of_thread[threading.get_ident()] = self
        try:
            self.loop.run_forever()
        except BaseException:  # AgentAbandoned raised outside the agent's task: the loop is done either way
            pass
        finally:
            _AgentLoop._of_thread.pop(threading.get_ident(), None)
            self.loop.close()

    def _new_task(self, loop, coro, context=None):
        """Every task on this loop, tagged with the episode whose agent started it (so that it ends with the
        episode, and a task blocking the loop names its episode)."""
        episode = context.get(_EPISODE) if context is not None else _EPISODE.get()
        if episode is not None:  # a task the agent started: it ends with its episode (`_Steps`)
            coro = self._guarded(coro, episode)
        task = asyncio.Task(coro, loop=loop, context=context)
        if episode is not None:
            self.owner[task] = episode
            task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task) -> None:
        self.owner.pop(task, None)

    async def _guarded(self, coro, episode: str):
        """`coro` run so that none of it runs on this loop once `episode` left it (`_Steps`)."""
        return await _Steps(coro, lambda: self.retired or episode in self.gone)

    def start(self, main: Callable, episode: str) -> asyncio.Future:
        """Run the coroutine `main()` on this loop as `episode`; returns a future of the calling (executor's) loop
        that gets its result or exception."""
        executor_loop = asyncio.get_running_loop()
        done: asyncio.Future = executor_loop.create_future()
        self.futures[episode] = done

        async def body():
            me = asyncio.current_task()
            self.owner[me] = episode
            _EPISODE.set(episode)  # the tasks the agent starts inherit it
            try:
                return await self._guarded(main(), episode)
            finally:  # tasks the agent left running end with it, as `asyncio.run` would end them
                self.owner.pop(me, None)
                for task in [t for t, e in list(self.owner.items()) if e == episode]:
                    task.cancel()
                self.gone.discard(episode)  # its tasks are cancelled now: a queued step of theirs runs no code

        def settle(f: concurrent.futures.Future) -> None:  # in this thread: hand the outcome to the executor's loop
            def put() -> None:
                if self.futures.get(episode) is done:
                    del self.futures[episode]
                if done.done():  # timed out, cancelled or restarted meanwhile
                    return
                if f.cancelled():  # only a retired loop's task is cancelled, and nobody waits for that one
                    done.set_exception(RuntimeError("the agent's task was cancelled"))
                elif f.exception() is not None:
                    done.set_exception(f.exception())
                else:
                    done.set_result(f.result())

            try:
                executor_loop.call_soon_threadsafe(put)
            except RuntimeError:  # the executor's loop is closed: this episode timed out long ago, nobody waits
                pass

        asyncio.run_coroutine_threadsafe(body(), self.loop).add_done_callback(settle)
        return done

    # -- when an agent blocks the loop (seen by `watch`) or times out ----------------------------------------------
    def blocking_episode(self) -> str | None:
        """The episode whose agent's task is running on this loop now (from another thread: the task a blocked loop
        is stuck in), or None when the loop is not inside an agent's task."""
        task = asyncio.current_task(self.loop)
        return None if task is None else self.owner.get(task)

    def give_to(self, episode: str) -> list[str]:
        """Leave this loop to `episode` alone: every other episode on it gets `_Restart` on the executor's side now,
        and its tasks here are cancelled once the loop runs again. Returns the episodes restarted. Called from the
        executor's loop."""
        others = [e for e in list(self.futures) if e != episode]
        self.gone.update(others)  # before the executor starts them again: their steps queued here do not run them
        for e in others:
            future = self.futures.pop(e)
            if not future.done():
                future.set_exception(_Restart())

        def cancel() -> None:
            for task, e in list(self.owner.items()):
                if e != episode:
                    task.cancel()

        self.loop.call_soon_threadsafe(cancel)
        return others

    def cancel_episode(self, episode: str) -> None:
        """End one episode's tasks (timed out while it awaits: the loop itself runs) and leave the others alone."""
        self.futures.pop(episode, None)
        self.gone.add(episode)

        def cancel() -> None:
            for task, e in list(self.owner.items()):
                if e == episode:
                    task.cancel()

        try:
            self.loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # already closed
            pass

    def retire(self, grace_s: float = 1.0) -> None:
        """Cancel every task on the loop and stop it once they have ended; raise `AgentAbandoned` in the thread if it
        still runs after `grace_s` (`LoopWatch.abandon`): that ends Python code (a CPU loop) at once and a blocking
        call (`time.sleep`) when it returns; either way the episode is already over and its server URL answers 404."""
        self.retired = True

        def cancel() -> None:  # on this loop, when it gets to run
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            left = [len(pending)]

            def ended(_) -> None:
                left[0] -= 1
                if left[0] == 0:
                    self.loop.stop()

            if not pending:
                self.loop.stop()
            for task in pending:
                task.add_done_callback(ended)
                task.cancel()

        try:
            self.loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # already closed
            return
        timer = threading.Timer(grace_s, self.watch.abandon)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        """End an idle loop's thread (its kept HTTP pools closed first)."""

        async def close() -> None:
            while self.clients:
                await self.clients.pop()[0].aclose()
            self.loop.stop()

        try:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(close()))
        except RuntimeError:
            pass

    # -- HTTP pools kept between the episodes on this loop (used on its thread only) -----------------------------
    @staticmethod
    def current() -> _AgentLoop | None:
        return _AgentLoop._of_thread.get(threading.get_ident())

    def http_client(self):
        """A kept HTTP pool for the next episode, or None."""
        if self.clients:
            http, uses = self.clients.pop()
            self.uses[http] = uses
            return http
        return None

    def keep_http_client(self, http) -> bool:
        """Keep the pool of an episode that returned for the next one (False: close it). A pool is kept for at most
        `HTTP_CLIENT_EPISODES` episodes, so that connections an agent left busy (a stream it never read to its end)
        cannot pile up in it."""
        uses = self.uses.pop(http, 0) + 1
        if http.is_closed or uses >= HTTP_CLIENT_EPISODES:
            return False
        self.clients.append((http, uses))
        return True


class OpenAIAgentExecutor:
    """`run(batch, n, seed, step)` -> `Rollout`, as the other executors, with each episode an `agent(client, example)`
    coroutine talking to an OpenAI-compatible server over the engines (see the module docstring)."""

    def __init__(self, engines, tokenizer, agent_file: str, model_name: str, max_new_tokens: int, max_context: int,
                 temperature: float = 1.0, top_p: float = 1.0, concurrency: int = 128,
                 timeout_s: float = 300.0, tool_parser: str | Callable = "hermes",
                 max_request_bytes: int = MAX_REQUEST_BYTES):  # fmt: skip
        self.agent_file, self.agent = agent_file, load_agent(agent_file)
        self._agent_path = Path(agent_file).expanduser().resolve()
        self.tokenizer, self.temperature = tokenizer, temperature
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.server = OpenAIServer(engines, tokenizer, model_name, max_new_tokens, max_context, top_p, tool_parser,
                                   max_request_bytes)  # fmt: skip
        self.server.start()
        self._ssl = ssl.create_default_context()  # made once: httpx builds one per client otherwise (~17 ms each here)
        # an agent holding its loop longer than this is blocking it (a synchronous call), not computing between awaits
        self.block_s = min(0.5, timeout_s / 4)
        self._shared: _AgentLoop | None = None  # every episode's loop, until an agent blocks it
        self.blocks = 0  # times an agent blocked the shared loop
        self.isolated = False  # agents blocked it ISOLATE_AFTER_BLOCKS times: each episode gets a loop of its own
        self._idle: list[_AgentLoop] = []  # one-episode loops free for the next episode

    def close(self) -> None:
        self.server.close()
        loops = [*self._idle, *([self._shared] if self._shared is not None else [])]
        self._shared, self._idle = None, []
        for worker in loops:
            worker.stop()
        for worker in loops:  # their kept HTTP pools closed, their threads ended
            worker.thread.join(timeout=5)

    def run(self, batch: list[dict], n: int, seed: int | list[int] | None, step: int,
            temperature: float | None = None) -> Rollout:  # fmt: skip
        """n episodes per row of `batch` (prompt-major); episode j of row i samples with seed `seed + i·n + j` (int
        `seed`) or `seed[i] + j` (one per row), its k-th call with that + 7919·k; `temperature` overrides the
        rollout's (0: greedy, for evaluation)."""
        temperature = self.temperature if temperature is None else temperature
        rows = [e for e in batch for _ in range(n)]
        seeds = [None if seed is None else (seed[i // n] + i % n if isinstance(seed, list) else seed + i)
                 for i in range(len(rows))]  # fmt: skip
        # a request the engine failed on was answered 500: its episode fails (`raised`), the others go on; an engine
        # that fails them all ends the run in `_report` (all episodes failed)
        results = asyncio.run(self._run_all(rows, seeds, temperature))
        episodes, rewards, errors = [], [], []
        calls = dropped = bad = tool_calls = parse_errors = 0
        parse_error = None
        for i, (example, (reward, error, record)) in enumerate(zip(rows, results)):
            bad += record.bad_requests
            calls += len(record.calls)
            tool_calls += record.tool_calls
            parse_errors += record.tool_parse_errors
            parse_error = parse_error or record.tool_parse_error
            if error is None and not record.calls:
                unawaited = _unawaited(self._agent_path)  # a call of the client without `await` sends nothing
                error = ("no_calls", "the agent made no model call: there is nothing to train on"
                         + (self._hint() if unawaited else ""))  # fmt: skip
            if error is None:
                prompt_ids, token_ids, logprobs, mask, n_dropped = build_trajectory(record.calls)
                last = record.calls[-1]
                episodes.append(Episode(example, prompt_ids, token_ids, logprobs, mask, last.finish_reason == "length",
                                        last.finish_reason, routed_experts=trajectory_routing(record.calls)))  # fmt: skip
                rewards.append(reward)
                dropped += n_dropped
                continue
            errors.append((i, *error))
            # DECISION: reward 0, one masked token: counted in the group baseline, never trained on
            episodes.append(Episode(example, list(example["prompt_ids"]), [self.tokenizer.eos_token_id], [0.0], [0],
                                    False, f"agent_{error[0]}"))  # fmt: skip
            rewards.append(0.0)
        if errors:
            self._report(errors, rows, step)
        if parse_errors:
            where = "the eval" if step < 0 else f"step {step}"
            log.warning(f"[agents] {self.agent_file}: {parse_errors} answers of {where} wrote tool calls that do not "
                        f"parse (returned as text); the first: {parse_error}")  # fmt: skip
        kinds = Counter(kind for _, kind, _ in errors)
        r = torch.tensor(rewards, dtype=torch.float32)
        per = max(len(rows), 1)
        logs = {"rollout/agent_errors": float(len(errors)), "rollout/agent_timeouts": float(kinds["timeout"]),
                "rollout/agent_bad_requests": float(bad), "rollout/agent_calls_mean": calls / per,
                "rollout/agent_dropped_calls": float(dropped), "rollout/agent_tool_calls_mean": tool_calls / per,
                "rollout/tool_parse_errors_mean": parse_errors / per}  # fmt: skip
        return Rollout(episodes, r, r.clamp(0, 1), logs)

    def _report(self, errors: list[tuple[int, str, str]], rows: list[dict], step: int) -> None:
        i, kind, message = errors[0]
        where = "the eval" if step < 0 else f"step {step}"
        first = f"episode {i} (prompt {rows[i].get('prompt', '')[:80]!r}): {kind}: {message}"
        if len(errors) == len(rows):
            raise AgentError(f"--rollout.agent-file {self.agent_file}: all {len(rows)} episodes of {where} failed; "
                             f"the first: {first}")  # fmt: skip
        counts = ", ".join(f"{k} {c}" for k, c in sorted(Counter(k for _, k, _ in errors).items()))
        log.warning(f"[agents] {self.agent_file}: {len(errors)} of {len(rows)} episodes of {where} failed ({counts}; "
                    f"reward 0, not trained on); the first: {first}")  # fmt: skip

    async def _run_all(self, rows: list[dict], seeds: list[int | None], temperature: float) -> list:
        gate = asyncio.Semaphore(self.concurrency)
        watch = None if self.isolated else asyncio.create_task(self._watch())
        try:
            return await asyncio.gather(*[self._episode(gate, e, s, temperature) for e, s in zip(rows, seeds)])
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch(self) -> None:
        """While episodes run on the shared loop: every `block_s / 4` seconds its `LoopWatch` looks whether one
        agent's task holds it (`held_by`). When one does, the loop is left to that episode and the others on it start
        again elsewhere (a warning says where)."""
        if self._shared is not None:
            self._shared.watch.reset()
        while not self.isolated:
            shared = self._shared
            task = None if shared is None else shared.watch.held_by(self.block_s)
            if task is not None and task in shared.owner:
                self._leave_shared_loop_to(shared.owner[task])
                continue  # watch the next shared loop, if there is one
            await asyncio.sleep(self.block_s / 4)

    def _leave_shared_loop_to(self, episode: str) -> None:
        """The agent of `episode` blocks the shared loop: the loop is its own now and the other episodes on it start
        again, on a new shared loop the first time (a block may be a one-off: a first import, a cache being built), on
        loops of their own after that, as is every later episode then."""
        shared, self._shared = self._shared, None
        self.blocks += 1
        self.isolated = self.blocks >= ISOLATE_AFTER_BLOCKS
        where = shared.watch.blocked_at(self._agent_path)
        restarted = shared.give_to(episode)
        then = ("from now on each episode runs on a loop and thread of its own, which costs more CPU per call"
                if self.isolated else "the next time one does, each episode gets a loop and thread of its own")  # fmt: skip
        log.warning(f"[agents] {self.agent_file}: an agent held the agents' event loop for over {self.block_s:g} s"
                    f"{f' at {where}' if where else ''} (a synchronous call inside `async def agent`?); {len(restarted)} "
                    f"episodes that shared the loop start again on {'their own' if self.isolated else 'a new one'}; "
                    f"{then}")  # fmt: skip

    async def _episode(self, gate: asyncio.Semaphore, example: dict, seed: int | None, temperature: float):
        """(reward, error (kind, message) or None, the server's record) of one episode."""
        async with gate:
            while True:
                eid = self.server.open_episode(temperature, seed)
                try:
                    reward, error = await self._play(eid, example)
                except _Restart:  # its loop was left to a blocking agent: again from the start, on a loop of its own
                    self.server.close_episode(eid)
                    continue
                except BaseException:
                    self.server.close_episode(eid)
                    raise
                return reward, error, self.server.close_episode(eid)

    async def _agent_main(self, eid: str, example: dict):
        """The agent's coroutine as its thread runs it, with a client of its own."""
        import httpx
        import openai

        # One HTTP connection pool per running episode: httpcore's pool checks every connection on each request, which
        # cost ~20 ms a request with one pool shared by 64 episodes here. A pool whose episode returned goes to the
        # next episode on this loop, its connection still open (~0.3 ms of CPU less per episode than a new pool and
        # connection); one whose agent raised or was cancelled is closed. trust_env=False: no proxy for 127.0.0.1.
        # max_retries=0: a retried request would be a second generation.
        worker = _AgentLoop.current()
        http = worker.http_client() if worker is not None else None
        if http is None:
            http = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, verify=self._ssl)
        returned = False
        try:
            client = openai.AsyncOpenAI(base_url=self.server.episode_url(eid), api_key="cleanrlhf", http_client=http,
                                        max_retries=0)  # fmt: skip
            value = await self.agent(client, example)
            returned = True
            return value
        finally:
            if not (returned and worker is not None and worker.keep_http_client(http)):
                await http.aclose()

    def _loop(self) -> _AgentLoop:
        """The loop for the next episode: the shared one, or after an agent blocked it, an idle one-episode loop or a
        new one."""
        if not self.isolated:
            if self._shared is None:
                self._shared = _AgentLoop(shared=True)
            return self._shared
        while self._idle:
            worker = self._idle.pop()
            if worker.thread.is_alive():  # not an agent that stopped its own loop
                return worker
        return _AgentLoop()

    def _release(self, worker: _AgentLoop) -> None:
        """An episode ended normally: its one-episode loop is free again; the shared loop stays; a shared loop that
        was left to a blocking agent (which then returned in time) ends."""
        if not worker.shared:
            self._idle.append(worker)
        elif worker is not self._shared:
            worker.retire()

    async def _play(self, eid: str, example: dict) -> tuple[float, tuple[str, str] | None]:
        """Run the agent on one example on an agent loop: (reward, None), or (0.0, (kind, message)) when it failed.
        Raises `_Restart` when its loop was left to another episode's blocking agent."""
        import openai

        worker = self._loop()
        try:
            value = await asyncio.wait_for(worker.start(partial(self._agent_main, eid, dict(example)), eid),
                                           self.timeout_s)  # fmt: skip
        except _Restart:
            raise
        except TimeoutError:
            message = f"did not return within {self.timeout_s:g} s (--rollout.agent-timeout-s)"
            if worker is self._shared and worker.blocking_episode() != eid:
                worker.cancel_episode(eid)  # it awaited too long; the loop runs, and the other episodes on it go on
                return 0.0, ("timeout", message)
            if worker is self._shared:  # it blocks the shared loop (and the watch has not seen it yet)
                self._leave_shared_loop_to(eid)
            blocked = worker.watch.blocked_at(self._agent_path)
            worker.retire()
            if blocked:
                message += (f"; it was blocking its event loop at {self.agent_file} {blocked}: a synchronous call "
                            "inside `async def agent` (use `await asyncio.sleep`, `await asyncio.to_thread(f, ...)` "
                            "or an async client)")  # fmt: skip
            return 0.0, ("timeout", message)
        except openai.APIStatusError as e:
            self._release(worker)
            return 0.0, ("bad_request" if 400 <= e.status_code < 500 else "raised", f"{type(e).__name__}: {e}")
        except Exception as e:  # the agent's own bug or an unreachable tool: this episode fails, the run goes on
            self._release(worker)
            return 0.0, ("raised", f"{type(e).__name__}: {e}{self._where(e)}")
        self._release(worker)
        if inspect.iscoroutine(value):  # `return client....create(...)` or `return helper(...)` without `await`
            name = value.cr_code.co_qualname if hasattr(value.cr_code, "co_qualname") else value.cr_code.co_name
            value.close()  # never run: no "was never awaited" warning for it
            return 0.0, ("bad_reward", f"returned a coroutine of `{name}` (called without `await`){self._hint()}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return 0.0, ("bad_reward", f"returned {value!r}; the agent must return a finite number (the reward)")
        return float(value), None

    def _where(self, e: BaseException) -> str:
        """Where in the agent file an exception was raised (its innermost line there), and the `await`s it may lack
        when the error is about a coroutine (`'coroutine' object has no attribute 'choices'`)."""
        here = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == self._agent_path]
        where = f" (at {self.agent_file} line {here[-1].lineno}: `{here[-1].line}`)" if here else ""
        return where + (self._hint() if "coroutine" in str(e) else "")

    def _hint(self) -> str:
        """The agent file's calls that look like a left-out `await` (`_unawaited`), for an episode's message."""
        lines = _unawaited(self._agent_path)
        if not lines:
            return "; a value of an async call used without `await`?"
        listed = "; ".join(f"line {n}: `{code}`" for n, code in lines[:3])
        return f"; not awaited in {self.agent_file}: {listed} (write `await` before the call)"
