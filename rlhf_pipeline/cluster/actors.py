"""The Ray actors of ``run --ray``: a run's control actor (:class:`RunControl`), its collectors, its
learner ranks and, with ``eval.every_steps``, its evaluator.

Each actor runs the same code as a process of ``run``; weights travel through Ray's object store
(:class:`ObjectStoreWeightsPoller`, falling back to ``weights/``) and stop requests through
:class:`RunControl`. Design: docs/architecture.md#ray.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import ray

from rlhf_pipeline.coordination.weights import WeightsPoller, latest_version, load_published
from rlhf_pipeline.models.lora import PolicyAdapter
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.stopping import StopFlag

#: the namespace of every run's named actors, so a second driver finds a run already running
NAMESPACE = "rlhf_pipeline"
#: how often an actor asks the control actor whether the run should stop, in seconds
STOP_POLL_S = 0.25


@ray.remote(num_cpus=0)
class RunControl:
    """The driver's actor for one run: stop requests, the newest weights, who runs where."""

    def __init__(self) -> None:
        self._stop = False
        self._weights: tuple[int, list] | None = None  # (version, [ref]): a list, so Ray passes the ref on
        self._pids: dict[str, list[int]] = {}
        self.weights_served = 0

    def request_stop(self) -> None:
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop

    def publish_weights(self, version: int, boxed_ref: list, restarted: bool = False) -> None:
        """``restarted``: the first publish of a learner that started again from its checkpoint; its
        version replaces the held one even if older (a killed learner's version past the checkpoint,
        which the restarted one publishes again as it retrains: ``learn/learner.py``)."""
        if self._weights is None or version > self._weights[0] or restarted:
            self._weights = (version, boxed_ref)

    def newest_weights(self, after: int) -> tuple[int, list] | None:
        """``(version, [ref])`` when a version newer than ``after`` was published."""
        if self._weights is None or self._weights[0] <= after:
            return None
        self.weights_served += 1
        return self._weights

    def served(self) -> int:
        return self.weights_served

    def register(self, name: str, pid: int) -> None:
        """An actor (``collector 1``, ``learner rank 0``) started, or started again, in process ``pid``."""
        self._pids.setdefault(name, []).append(pid)

    def processes(self) -> dict[str, list[int]]:
        """Every process each actor ran in, oldest first (more than one: Ray restarted it)."""
        return self._pids


@dataclass(frozen=True)
class ActorJob:
    """What every actor of a run needs to rebuild the pipeline the driver built."""

    pipeline_path: str  # absolute: workers may start in another directory (or machine)
    overrides: tuple[str, ...]  # --set items, --steps and --device included
    run_root: str
    control_name: str  # the run's RunControl actor, by name: plain values restart an actor safely

    @property
    def control(self) -> Any:
        return ray.get_actor(self.control_name, namespace=NAMESPACE)

    def build(self):
        from rlhf_pipeline.runs.processes import build_pipeline, set_threads, with_buffer_url

        paths = RunPaths.at(self.run_root)  # a directory, or a run at a URL
        module = load_pipeline_module(self.pipeline_path)
        pipeline = build_pipeline(module, make_settings(module, list(self.overrides)), paths)
        set_threads(pipeline)
        return pipeline, with_buffer_url(paths, pipeline)


class ObjectStoreWeightsPoller(WeightsPoller):
    """Collector side: ``poll()`` returns the newest weights once, from Ray's object store;
    ``poll_version(v)`` returns version ``v`` once it is published.

    ``weights.WeightsPoller`` with Ray's object store in front of the run's ``weights/``: what it
    hands over is what the learner published (whole weights, or a LoRA run's adapter, given its base
    when the engine has none yet, as the file poller gives it); ``collect_main`` uses either. With
    ``poll_version`` a paced round uses the version pacing names for it, not whichever is newest
    when the round starts (``coordination/pacing.py``): a run on Ray trains as the same run under
    ``run`` does, and so does a learner restarted on another node.
    """

    def __init__(self, run_dir: Any, control: Any, current_version: int = -1) -> None:
        super().__init__(run_dir, current_version)  # a directory or the run's store (a run at a URL)
        self.control = control

    def poll(self):
        newest = ray.get(self.control.newest_weights.remote(self.current_version))
        if newest is None:
            return None
        return self._take(*newest)

    def poll_version(self, version: int):
        """``version`` once it is published and newer than the current one, else None; the newest
        when ``version`` is gone (pruned)."""
        if version <= self.current_version:
            return None
        newest = ray.get(self.control.newest_weights.remote(self.current_version))
        if newest is None or newest[0] < version:
            return None  # not published yet
        if newest[0] == version:
            return self._take(*newest)
        # the learner has moved past it: that version's file (every version is written to one)
        try:
            state, loaded = load_published(self.store, version)
        except FileNotFoundError:  # pruned, or taken back by a restarted learner (then: not yet)
            return None if self._taken_back(version) else self._take(*newest)
        self.current_version = loaded
        return self._with_base(state, loaded), loaded

    def _taken_back(self, version: int) -> bool:
        """Whether ``version`` is newer than every published file: a learner restarted from an
        earlier checkpoint took it back and publishes it again as it retrains (``learn/learner.py``)."""
        newest = latest_version(self.store)
        return newest is None or version > newest

    def _take(self, version: int, boxed_ref: list):
        (ref,) = boxed_ref
        try:
            state = ray.get(ref, timeout=120)
        except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError):
            # its owner, a learner process, died; the learner writes every version to a file too
            try:
                state, version = load_published(self.store, version)
            except FileNotFoundError:
                if self._taken_back(version):  # the learner that died published it past its checkpoint
                    return None
                state, version = load_published(self.store)  # pruned since: a newer version is on disk
        self.current_version = version
        return self._with_base(state, version), version


class ObjectStorePublisher:
    """Learner side (rank 0): after each step that published a version, puts what it published in
    the object store (whole weights, or a LoRA run's adapter with its canary)."""

    def __init__(self, learner: Any, control: Any) -> None:
        self.learner = learner
        self.control = control
        self.published = -1

    def __call__(self, step: int, sampled: Any, batch: Any, metrics: dict[str, float]) -> None:
        version = self.learner.progress.policy_version
        if version <= self.published or not self.learner.data_parallel.is_main:
            return
        state = self.learner.publication()
        if not isinstance(state, PolicyAdapter):  # live weights: a copy, as they are now
            state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        # this process's first: it replaces what a learner killed past its checkpoint had offered
        ray.get(self.control.publish_weights.remote(version, [ray.put(state)], self.published < 0))
        self.published = version


class _StopWatcher:
    """Turns the control actor's stop request into a byte on a pipe that ``StopFlag`` watches."""

    def __init__(self, control: Any) -> None:
        self.control = control
        read_end, self._write_end = os.pipe()
        StopFlag.launcher_fd = read_end
        threading.Thread(target=self._watch, daemon=True, name="ray-stop-watch").start()

    def _watch(self) -> None:
        event = threading.Event()
        while not event.wait(STOP_POLL_S):
            try:
                stop = ray.get(self.control.stop_requested.remote(), timeout=30)
            except ray.exceptions.RayError:  # the driver and its control actor are gone
                stop = True
            if stop:
                os.write(self._write_end, b"s")
                return


def collector_actor_name(index: int, one_of_several: bool) -> str:
    """Collector ``index``'s name: its output's prefix and its entry in ``RunControl.processes``."""
    return f"collector {index}" if one_of_several else "collector"


def learner_actor_name(rank: int, world_size: int) -> str:
    """Learner rank ``rank``'s name: its output's prefix and its entry in ``RunControl.processes``."""
    return "learner" if world_size == 1 else f"learner rank {rank}"


def _register(control: Any, name: str) -> None:
    ray.get(control.register.remote(name, os.getpid()))


@ray.remote
class CollectorActor:
    """Collector ``k``: writes ``buffer/shard-kkkk``, the only writer of that shard."""

    def __init__(self, job: ActorJob, collector_index: int, one_of_several: bool) -> None:
        self.job = job
        self.collector_index = collector_index
        self.one_of_several = one_of_several
        self.name = collector_actor_name(collector_index, one_of_several)

    def __repr__(self) -> str:  # Ray prefixes the actor's forwarded output with it
        return self.name

    def run(self) -> int:
        from rlhf_pipeline.runs.processes import collect_main

        control = self.job.control
        _register(control, self.name)
        _StopWatcher(control)
        pipeline, paths = self.job.build()
        poller = ObjectStoreWeightsPoller(paths.store, control)
        return collect_main(pipeline, paths, collector_index=self.collector_index, poller=poller,
                            one_of_several=self.one_of_several)


@ray.remote
class EvaluatorActor:
    """The evaluator beside training (``rlhf-pipeline eval RUN --follow``'s body): it reads published
    weights from the run's store and writes the eval stores, so it may run on any node; it takes a
    collector's resources and the run's device, where a vLLM of its own runs."""

    def __init__(self, job: ActorJob) -> None:
        self.job = job

    def __repr__(self) -> str:
        return "evaluator"

    def run(self) -> int:
        from rlhf_pipeline.runs.processes import eval_main

        control = self.job.control
        _register(control, "evaluator")
        _StopWatcher(control)
        pipeline, paths = self.job.build()
        return eval_main(pipeline, paths, engine_device=pipeline.settings.device)


@ray.remote
class LearnerActor:
    """Learner rank ``r`` of ``world_size``; rank 0 writes weights, checkpoints and metrics."""

    def __init__(self, job: ActorJob, rank: int, world_size: int) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.name = learner_actor_name(rank, world_size)

    def __repr__(self) -> str:
        return self.name

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the process group (``MASTER_ADDR`` / ``MASTER_PORT``)."""
        from rlhf_pipeline.processes import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def run(self, master_addr: str, master_port: int) -> int:
        from rlhf_pipeline.learn.distributed import DataParallel
        from rlhf_pipeline.runs.processes import learn_main

        control = self.job.control
        _register(control, self.name)
        _StopWatcher(control)
        # torch.distributed's env:// rendezvous; this worker process runs this rank only
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        # Ray shows each actor only the GPUs it reserved, so a rank's GPU is always cuda:0
        data_parallel = DataParallel(rank=self.rank, world_size=self.world_size, local_rank=0)
        pipeline, paths = self.job.build()

        def attach(learner: Any) -> None:
            learner.on_step = ObjectStorePublisher(learner, control)

        return learn_main(pipeline, paths, data_parallel=data_parallel, on_learner=attach)
