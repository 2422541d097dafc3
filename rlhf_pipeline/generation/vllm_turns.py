"""Requests added to the owned vLLM engine's running batch one by one (``turns.py``): the client of the
server's ``turns`` operation (``vllm_server.turns``).

Each request is sent the moment it is submitted, with one seed drawn from its own generator, and joins
vLLM's batch at the engine's next step; a reader thread takes the server's replies and hands each
finished request's group to its ``done``. The server says it is alive every ``progress_every_s``,
also while it waits for requests (the environments are working), so ``generation.hung_after_s``
measures silence, not a wait. If the engine's process dies, a new one (``VLLMEngine._restart``:
bounded, the weights the dead one held) is sent every request not answered yet, with the same seeds:
their groups are those the dead one would have given. An error reply fails every request in flight
and the submitter.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.generation.engine import EngineDied, EngineFailed, SampleRequest
from rlhf_pipeline.generation.turns import Done, TurnSubmitter
from rlhf_pipeline.generation.vllm_rounds import count_prompt_tokens, progress_every_s, to_group, wire_requests, wire_sampling

if TYPE_CHECKING:
    import torch

    from rlhf_pipeline.generation.sampling import SamplingConfig
    from rlhf_pipeline.generation.vllm_engine import VLLMEngine


class VLLMTurns(TurnSubmitter):
    """One session of the ``turns`` operation on ``engine``; :meth:`close` ends it."""

    def __init__(self, engine: VLLMEngine, sampling: SamplingConfig) -> None:
        super().__init__()
        self.engine, self.sampling = engine, sampling
        self._opening = {"stop_token_ids": engine.stop_token_ids, "sampling": wire_sampling(engine, sampling),
                         "progress_every_s": progress_every_s(engine.restarts.hung_after_s)}
        self._pending: dict[int, tuple[SampleRequest, dict[str, Any], Done]] = {}  # key -> request, as sent, done
        self._next_key = 0
        self._send_lock = threading.Lock()  # sends (submit, a restart's resend) one at a time
        self._failed: BaseException | None = None
        self._ending = False
        self._finished = threading.Event()
        try:
            engine.send("turns", **self._opening)
        except EngineDied as died:  # it died between rounds: a new one, as a round's first send does
            self._restart(died)
        self._reader = threading.Thread(target=self._read, name="vllm-turns", daemon=True)
        self._reader.start()

    def submit(self, request: SampleRequest, generator: torch.Generator, done: Done) -> None:
        (sent,) = wire_requests(self.engine, [request], self.sampling, generator)  # one seed, from its generator
        with self._send_lock:
            if self._failed is not None:
                raise self._failed
            key, self._next_key = self._next_key, self._next_key + 1
            sent["key"] = key
            self._pending[key] = (request, sent, done)
            self._started()
            try:
                self.engine.send("turns", add=[sent])  # a message inside the session: its op is not read
            except EngineDied:
                pass  # the reader sees the death too, restarts the engine and sends it again

    def close(self) -> None:
        with self._send_lock:
            self._ending = True
            if self._failed is None:
                try:
                    self.engine.send("turns", end=True)
                except EngineFailed:
                    pass
        self._finished.wait()
        self._reader.join()

    # ------------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        try:
            while True:
                try:
                    reply = self.engine.receive("sampling turns", hung_is_dead=True)
                except EngineDied as died:
                    self._restart(died)
                    continue
                if reply.get("done"):
                    self.engine.restarts.answered()
                    return
                if "progress" in reply:
                    continue
                answered = []
                for item in reply["finished"]:
                    request, sent, done = self._pending.pop(item["key"])
                    answered.append((sent, done, to_group(self.engine, 0, request, sent, item["group"])))
                count_prompt_tokens(self.engine, [sent for sent, _, _ in answered],
                                    [item.get("cached_tokens", 0) for item in reply["finished"]])
                self._ended(len(answered))
                for _, done, group in answered:
                    done(group, None)
        except BaseException as error:  # an error reply, or restarts given up: every request in flight fails
            with self._send_lock:
                self._failed = error
                pending, self._pending = list(self._pending.values()), {}
            self._ended(len(pending))
            for _, _, done in pending:
                done(None, error)
        finally:
            self._finished.set()

    def _restart(self, died: EngineDied) -> None:
        """A new engine process (the weights the dead one held), sent the session and every request not
        answered yet, with their seeds; EngineFailed when the restarts are spent."""
        with self._send_lock:
            self.engine._restart(died)
            self.engine.send("turns", **self._opening)
            if self._pending:
                self.engine.send("turns", add=[sent for _, sent, _ in self._pending.values()])
            if self._ending:
                self.engine.send("turns", end=True)

