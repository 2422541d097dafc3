"""``run --ray [ADDRESS]`` and ``learn --ray [ADDRESS]``: the same run, its processes as Ray actors.

The driver prepares the run as ``run`` does, joins the cluster at ADDRESS (or starts a local one)
and starts a :class:`~rlhf_pipeline.cluster.actors.RunControl` actor, ``--collectors N`` collector
actors spread over the nodes, ``learner.world_size`` learner actors and, with ``eval.every_steps``, an
evaluator actor once they run (its failure, or no room for it, is said in one line and stops nothing).
Failures and stopping are handled as ``run`` handles its processes. User's guide: docs/ray.md; design:
docs/architecture.md#ray.

Why one file: which actor is made when, and which the end waits for, are one rule over the same room.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlhf_pipeline.pipeline import PipelineError, RunPaths
from rlhf_pipeline.run_settings import RaySettings
from rlhf_pipeline.runs.processes import build_pipeline, set_threads, with_buffer_url
from rlhf_pipeline.runs.run_directory import prepare_run, RunError
from rlhf_pipeline.runs.run import print_interrupted, print_summary
from rlhf_pipeline.runs import stopping
from rlhf_pipeline.runs.stopping import LauncherSignals

INSTALL_HINT = "pip install -e '.[ray]'"
LOG_FLUSH_S = 1.0
PROBE_S = 10.0  # a cluster's address that takes no connection this long is named as unreachable


def require_ray(command: str) -> None:
    """Fails in one line when ``--ray`` cannot work here."""
    if command not in ("run", "learn"):
        raise PipelineError(f"--ray is an option of run and learn, not of {command}")
    _import_ray()


def _import_ray() -> Any:
    # Ray folds lines that differ only in numbers into "[repeated 2x]": collector 1's progress
    # line would vanish behind collector 0's. Read when ray is imported; the user's choice wins
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():  # no colour codes in a log file (read when Ray prints)
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        import ray
    except ImportError as exc:
        raise RunError(f"--ray needs Ray, which is not installed here ({exc}): {INSTALL_HINT}") from None
    return ray


def ray_launcher(command: str, address: str) -> Callable[..., int]:
    """What ``run_command(on_ray=...)`` calls for ``--ray ADDRESS`` ("" starts a local cluster);
    fails in one line first when ``--ray`` cannot work here, before any slow work."""
    require_ray(command)
    named = address or os.environ.get("RAY_ADDRESS", "")
    if named and (unreachable := why_unreachable(named)) is not None:  # ray.init would retry it, then hang
        raise RunError(f"{'--ray' if address else 'RAY_ADDRESS'} {named}: no Ray cluster answers there ({unreachable}); "
                       f"start one with `ray start --head` on that machine, or give the address `ray status` prints "
                       f"there")
    return functools.partial(launch_on_ray, address=address)


def launch_on_ray(command: str, module: Any, settings: Any, paths: RunPaths, pipeline_path: str,
                  overrides: Sequence[str], collectors: int, *, address: str) -> int:
    """``run`` (collectors and learner) or ``learn`` (the learner ranks only) on a Ray cluster."""
    resources = settings.ray
    world_size = settings.learner.world_size
    pipeline = build_pipeline(module, settings, paths)
    paths = with_buffer_url(paths, pipeline)
    set_threads(pipeline)
    prepare_run(pipeline, paths, shards=range(collectors) if command == "run" else (0,))
    if command == "run":
        paths.clear_stop()  # left by a finished learner of an earlier start
    else:
        collectors = 0

    ray, started = _connect(address)
    try:
        from rlhf_pipeline.cluster.actors import ActorJob

        evaluate = command == "run" and settings.eval.enabled
        room = _check_room(ray, resources, collectors, world_size, evaluate, cluster_grows=not _started_here(ray))
        control = _start_control(ray, paths)
        job = ActorJob(pipeline_path=os.path.abspath(pipeline_path), overrides=tuple(overrides),
                       run_root=paths.location, control_name=control_actor_name(paths))
        _offer_initial_weights(ray, control, paths)
        run = _RayRun(ray, job, paths, resources, collectors, world_size, evaluate=evaluate, room=room)
        try:
            return run.watch()
        finally:
            run.release()
            ray.kill(control)
    finally:
        if started:
            ray.shutdown()


def _connect(address: str) -> tuple[Any, bool]:
    """``ray`` connected to ADDRESS, else as ``ray.init()`` connects it: to the cluster ``RAY_ADDRESS``
    names, else one ``ray start`` made on this machine, else a new local one. True when this call
    connected it."""
    ray = _import_ray()
    from rlhf_pipeline.cluster.actors import NAMESPACE

    if ray.is_initialized():  # this process is connected already (a notebook, a test)
        return ray, False
    named = address or os.environ.get("RAY_ADDRESS", "")
    if named:
        print(f"[run] joining the Ray cluster at {named}" + ("" if address else " (RAY_ADDRESS)"),
              file=sys.stderr, flush=True)
        ray.init(address=named, namespace=NAMESPACE)
    else:  # Ray's own line then says which it did ("Started a local Ray instance" or "Connecting to ...")
        print("[run] connecting to Ray: a cluster that `ray start` made on this machine, else a local one "
              "started for this run", file=sys.stderr, flush=True)
        ray.init(namespace=NAMESPACE, include_dashboard=False)
    return ray, True


def _started_here(ray: Any) -> bool:
    """Whether this process started the cluster (``ray.init()`` found none to join): a local one that no
    node joins. Ray says so only on its private node object; where that moved, the cluster is taken as
    one that may grow."""
    try:
        node = ray._private.worker._global_node
        return node is not None and bool(node.is_head())
    except AttributeError:
        return False


def why_unreachable(address: str, timeout_s: float = PROBE_S) -> str | None:
    """Why nothing takes a connection at a ``HOST:PORT`` (or ``ray://HOST:PORT``) address, else None;
    Ray's other addresses (``auto``, ``local``) are Ray's to resolve."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:  # refused, unreachable, no such host, or no answer within timeout_s
        return exc.strerror or str(exc) or type(exc).__name__


def _start_control(ray: Any, paths: RunPaths) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlhf_pipeline.cluster.actors import NAMESPACE, RunControl

    name = control_actor_name(paths)
    # on the driver's node: it lives and dies with the driver anyway, and a worker node lost
    # with its actors must not take the run's stop flag and newest weights with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    try:
        return RunControl.options(name=name, namespace=NAMESPACE, scheduling_strategy=here).remote()
    except ValueError:  # the name is taken: another driver runs this directory on this cluster
        raise RunError(f"{paths.location} is already running on this Ray cluster (actor {name!r}); stop that "
                       f"run first, or start a new one with --run-name NAME") from None


def _check_room(ray: Any, resources: RaySettings, collectors: int, world_size: int, evaluate: bool, *,
                cluster_grows: bool) -> tuple[bool, bool]:
    """Whether the cluster has room for the learner and collectors, and for every actor; when not, one
    line says so (Ray keeps an actor that does not fit waiting, without a word, until a node with room
    joins). A cluster this run started has no node to wait for: the learner and collectors not fitting
    there is refused (the evaluator not fitting only means it does not start)."""
    total, room_for_training, room_for_all = ray.cluster_resources(), True, True
    for kind, learner_asks, collector_asks in (("CPU", resources.learner_num_cpus, resources.collector_num_cpus),
                                               ("GPU", resources.learner_num_gpus, resources.collector_num_gpus)):
        training = world_size * learner_asks + collectors * collector_asks
        asks, has = training + evaluate * collector_asks, total.get(kind, 0.0)
        training_fits = training <= has + 1e-9
        if asks <= has + 1e-9:
            continue
        room_for_all, room_for_training = False, room_for_training and training_fits
        parts = [f"{'the learner' if world_size == 1 else f'{world_size} learner ranks'} {learner_asks:g}"
                 + (" each" if world_size > 1 else "")]
        if collectors:
            parts.append(f"{collectors} collector{'s' if collectors > 1 else ''} {collector_asks:g}"
                         + (" each" if collectors > 1 else ""))
        if evaluate:
            parts.append(f"the evaluator {collector_asks:g}")
        unit = kind.lower() + "s"
        asked = f"the run's actors ask Ray for {asks:g} {kind}s ({', '.join(parts)})"
        remedy = (f"give each less (--set ray.collector_num_{unit}=... / ray.learner_num_{unit}=...), start fewer "
                  f"collectors, or " + ("add a node" if cluster_grows else
                                        f"start a cluster with more (`ray start --head --num-{unit} N`, which --ray "
                                        f"then joins)"))
        if not cluster_grows and not training_fits:
            raise RunError(f"{asked}, and the local Ray cluster this run started has {has:g}: {remedy}")
        waits = ("the evaluator does not start" if not cluster_grows
                 else "those that do not fit wait until a node with room joins (the evaluator first)")
        print(f"[run] {asked} and the cluster has {has:g}: {waits}. To fit, {remedy}", file=sys.stderr, flush=True)
    return room_for_training, room_for_all


def control_actor_name(paths: RunPaths) -> str:
    """The name of a run's control actor in :data:`NAMESPACE` (tests and tools find it by it)."""
    return f"run:{paths.location}"


def _offer_initial_weights(ray: Any, control: Any, paths: RunPaths) -> None:
    """The newest published version (the initial policy, or a resumed run's), for collectors that
    start before the learner publishes; the driver owns it until a newer one replaces it. As
    published: a LoRA run's adapter stays an adapter (a collector's poller gives it its base)."""
    from rlhf_pipeline.coordination.weights import load_published

    state, version = load_published(paths.store)
    ray.get(control.publish_weights.remote(version, [ray.put(state)]))


class _RayRun:
    """The actors of one start of a run, and the driver's watch over them."""

    def __init__(self, ray: Any, job: Any, paths: RunPaths, resources: RaySettings, collectors: int,
                 world_size: int, *, evaluate: bool = False, room: tuple[bool, bool] = (True, True)) -> None:
        from rlhf_pipeline.cluster.actors import (CollectorActor, EvaluatorActor, LearnerActor, collector_actor_name,
                                                  learner_actor_name)

        self.ray, self.job, self.paths = ray, job, paths
        self.control = job.control
        self.room_for_training, self.room_for_all = room  # else the actors that do not fit wait (_check_room)
        restarts = resources.max_restarts
        # the `run` task in flight runs again in the restarted actor. Its retries are unbounded
        # (-1) while restarts are bounded: a node lost with an actor fails its calls as
        # "unavailable" for the seconds until Ray declares the node dead, and a bounded count of
        # retries would be spent there, before the actor is restarted on a live node
        retries = -1 if restarts else 0
        # one rank restarts alone; a rank of several cannot rejoin its group's collectives
        learner_restarts, learner_retries = (restarts, retries) if world_size == 1 else (0, 0)
        self.learners = [
            LearnerActor.options(num_cpus=resources.learner_num_cpus, num_gpus=resources.learner_num_gpus,
                                 max_restarts=learner_restarts, max_task_retries=learner_retries)
            .remote(job, rank, world_size)
            for rank in range(world_size)
        ]
        # on a cluster without room for every collector beside the learner, rank 0 is placed before any collector
        # is made: a collector waits then, not the learner (the run would wait for ever). With room for all,
        # they start side by side (placing the learner first cost a run's start 5 s on 2 cores)
        master = None if self.room_for_training else ray.get(self.learners[0].rendezvous.remote())
        self.collectors = {
            k: CollectorActor.options(num_cpus=resources.collector_num_cpus, num_gpus=resources.collector_num_gpus,
                                      scheduling_strategy="SPREAD", max_restarts=restarts,
                                      max_task_retries=retries).remote(job, k, collectors > 1)
            for k in range(collectors)
        }
        master = master or ray.get(self.learners[0].rendezvous.remote())
        self.collector_names = {k: collector_actor_name(k, collectors > 1) for k in self.collectors}
        self.learner_names = [learner_actor_name(r, world_size) for r in range(world_size)]
        # beside the collectors, with a collector's resources; restarted as they are, it resumes from its
        # stores' writer state. Made once every training actor runs (_start_the_evaluator): on a cluster
        # without room for all, the evaluator is the one that waits, never a collector or the learner
        self.make_evaluator = (lambda: EvaluatorActor.options(
            num_cpus=resources.collector_num_cpus, num_gpus=resources.collector_num_gpus,
            max_restarts=restarts, max_task_retries=retries).remote(job)) if evaluate else None
        self.evaluator = self.evaluator_task = None
        self.evaluator_said = False
        self.collector_tasks = {k: actor.run.remote() for k, actor in self.collectors.items()}
        self.learner_tasks = [actor.run.remote(*master) for actor in self.learners]
        self.signals: LauncherSignals | None = None

    def _start_the_evaluator(self) -> None:
        """Makes the evaluator actor once every collector and learner has started."""
        if self.make_evaluator is None or self.evaluator is not None:
            return
        started = self.ray.get(self.control.processes.remote())
        if all(name in started for name in [*self.collector_names.values(), *self.learner_names]):
            self.evaluator = self.make_evaluator()
            self.evaluator_task = self.evaluator.run.remote()

    def _waiting_for_room(self) -> list[str]:
        """The collectors and the evaluator that never started, on a cluster too small for them: they wait
        for room. Where there is room, one not started yet may be starting its process."""
        waiting = [*(self.collector_names.values() if not self.room_for_training else ()),
                   *(["evaluator"] if self.make_evaluator is not None and not self.room_for_all else [])]
        if not waiting:
            return []
        started = self.ray.get(self.control.processes.remote())
        return [name for name in waiting if name not in started]

    # ------------------------------------------------------------------ watching
    def watch(self) -> int:
        n = len(self.collectors)
        print(f"[run] run directory {self.paths.location} on Ray: {len(self.learners)} learner actor(s)"
              + (f", {n} collector actor(s)" if n else ""), file=sys.stderr, flush=True)
        self.signals = LauncherSignals()
        try:
            return self._watch()
        finally:
            self.signals.restore()

    def _watch(self) -> int:
        ray, signals = self.ray, self.signals
        learner_codes: list[int] | None = None
        while not signals.received:
            watched = [*self.learner_tasks, *self.collector_tasks.values()]
            ready, _ = ray.wait(watched, num_returns=len(watched), timeout=0.2)
            self._start_the_evaluator()
            self._say_if_the_evaluator_ended(training_done=False)
            if not ready or signals.received:  # (a Ctrl-C that reached the actors too ends them now)
                continue
            failure = self._first_failure(ready)
            if failure is not None:
                self._stop_all()
                raise RunError(f"{failure}; the others were asked to stop (the learner saves a checkpoint). "
                               f"Rerun the same command to resume")
            if all(t in ready for t in self.learner_tasks):
                learner_codes = [ray.get(t) for t in self.learner_tasks]
                break
        if signals.received:
            self._stop_all()
            signum = signals.received[0]
            print_interrupted(self.paths, signum)
            return 128 + signum
        if any(code != 0 for code in learner_codes):  # stopped early without a signal here (SIGTERM to a worker)
            self._stop_all()
            raise RunError(f"the learner stopped before its last step (exit code {max(learner_codes)}); "
                           f"rerun the same command to resume")
        # the learner wrote STOP: every collector ends after its round, the evaluator after the versions left;
        # an actor that never had room is not waited for
        never = self._waiting_for_room()
        if any(name != "evaluator" for name in never):
            print(f"[run] {', '.join(n for n in never if n != 'evaluator')} never started: the Ray cluster had no "
                  f"room (see above)", file=sys.stderr, flush=True)
        self._wait([task for k, task in self.collector_tasks.items() if self.collector_names[k] not in never],
                   stopping.COLLECTOR_FINISH_S)
        if "evaluator" in never:
            print(f"[run] the evaluator never started: the Ray cluster had no room for it beside the collectors and "
                  f"the learner (see above); `rlhf-pipeline eval {self.paths.location}` evaluates the run's kept "
                  f"versions", file=sys.stderr, flush=True)
        elif self.evaluator_task is not None:
            self._wait([self.evaluator_task], stopping.EVALUATOR_FINISH_S)
            self._say_if_the_evaluator_ended(training_done=True)
        time.sleep(LOG_FLUSH_S)  # Ray forwards what actors print from their log files, a little later
        print_summary(self.paths)
        return 0

    def _say_if_the_evaluator_ended(self, *, training_done: bool) -> None:
        """Once, when the evaluator failed or died: training goes on (or has ended) without it."""
        from rlhf_pipeline.runs.launch import evaluator_exited

        task = self.evaluator_task
        if task is None or self.evaluator_said or not self.ray.wait([task], timeout=0)[0]:
            return
        try:
            code = self.ray.get(task)
        except self.ray.exceptions.RayTaskError as exc:
            print(str(exc), file=sys.stderr, flush=True)
            code = 1
        except self.ray.exceptions.RayActorError as exc:
            print(f"[run] the evaluator's process died and was not restarted ({type(exc).__name__})",
                  file=sys.stderr, flush=True)
            code = -9
        if code != 0:
            print(evaluator_exited(code, self.paths.location, training_done=training_done), file=sys.stderr,
                  flush=True)
        self.evaluator_said = True

    def _first_failure(self, ready: list) -> str | None:
        """What failed among finished tasks: an exception, an actor dead for good, a collector that
        ended before the learner was done."""
        ray = self.ray
        names = {t: ("the learner" if len(self.learners) == 1 else f"learner rank {r}")
                 for r, t in enumerate(self.learner_tasks)}
        names.update({t: ("collector " + str(k)) for k, t in self.collector_tasks.items()})
        for task in ready:
            try:
                code = ray.get(task)
            except ray.exceptions.RayTaskError as exc:
                print(str(exc), file=sys.stderr, flush=True)
                return f"{names[task]} failed (its error is above)"
            except ray.exceptions.RayActorError as exc:
                return f"{names[task]}'s process died and was not restarted ({type(exc).__name__})"
            if task in self.collector_tasks.values() and not self.paths.stop_requested():
                return f"{names[task]} ended early (exit code {code})"
        return None

    def _stop_all(self) -> None:
        """Asks every actor to stop cleanly and waits; a second signal meanwhile kills them. The learner
        stops at a step, with a checkpoint, however long; a collector or the evaluator still running past
        its allowance (stuck in a round) is killed by :meth:`release`, as ``run`` without Ray kills it."""
        self.ray.get(self.control.request_stop.remote())
        evaluator = [self.evaluator_task] if self.evaluator_task is not None else []
        for tasks, allowance_s in ((self.learner_tasks, None),
                                   (list(self.collector_tasks.values()), stopping.COLLECTOR_FINISH_S),
                                   (evaluator, stopping.EVALUATOR_FINISH_S)):
            if not self._wait(tasks, allowance_s):
                break
        time.sleep(LOG_FLUSH_S)

    def _wait(self, tasks: list, timeout: float | None) -> bool:
        """Waits for ``tasks`` to end; past ``timeout`` the actors left are :meth:`release`'s to kill. False
        when a second signal came meanwhile: everything is killed now."""
        ray, deadline = self.ray, None if timeout is None else time.monotonic() + timeout
        pending = list(tasks)
        while pending:
            if self.signals is not None and len(self.signals.received) >= 2:
                print("[run] stopping now: killing the learner and collectors", file=sys.stderr, flush=True)
                return False
            if deadline is not None and time.monotonic() > deadline:
                print(f"[run] {len(pending)} actor(s) did not stop within {timeout:g} s; killing them",
                      file=sys.stderr, flush=True)
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
        return True

    def release(self) -> None:
        """Ends every actor (a finished one holds its reserved CPUs until then)."""
        evaluator = [self.evaluator] if self.evaluator is not None else []
        for actor in [*self.learners, *self.collectors.values(), *evaluator]:
            self.ray.kill(actor, no_restart=True)
