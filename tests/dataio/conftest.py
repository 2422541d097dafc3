"""Shared data for the dataio tests: real buffers written by a real collector, and a real tiny run.

Built once per session (they cost seconds): ``collected_buffers`` holds a memmap and a Zarr
store of rows sampled by a tiny model through the full write path (group advantage,
reference log-probs, KL reward), so every optional field is real; ``tiny_run`` is a run
directory of the default pipeline (collector and learner run in this process for a few
rounds and steps), with weights, checkpoints and metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dataio_setup import DEFAULT_PIPELINE, GROUP_SIZE, SMALL, WRITE_PATH_FIELDS


def collect_rows(path: Path, backend: str, rounds: int = 5, segment_rows: int = 32):
    """A store at ``path`` holding every optional field of the write path, written by a real collector (16 rows a round)."""
    from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
    from rlhf_pipeline.collect.toy_task import toy_prompts
    from rlhf_pipeline.models import tiny_model_and_tokenizer
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer
    from rlhf_pipeline.transforms import GroupAdvantage, KLReward, ReferenceLogProbs

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    reference, _ = tiny_model_and_tokenizer(seed=1)
    store = create_store(path, backend, schema=StoreSchema(optional=WRITE_PATH_FIELDS), segment_rows=segment_rows)
    buffer = make_replay_buffer(store, transforms=[GroupAdvantage(GROUP_SIZE),
                                                   ReferenceLogProbs(reference), KLReward(0.05)])
    collector = Collector(model, tokenizer, PromptSource(toy_prompts(64, seed=0), required_fields=("answer",)),
                          # the untrained model rarely answers right; its answers' lengths vary
                          SingleTurn({"length": lambda prompts, completions, **_: [float(len(c)) for c in completions]}),
                          buffer.extend,
                          CollectorConfig(tasks_per_round=4, group_size=GROUP_SIZE,
                                          sampling=SamplingConfig(max_new_tokens=5)))
    for version in range(rounds):
        collector.set_policy_state(model.state_dict(), version)  # several versions, as a live run would store
        collector.collect()
    store.close()
    return path


@pytest.fixture(scope="session")
def collected_buffers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("collected")
    return {backend: collect_rows(root / backend, backend) for backend in ("memmap", "zarr")}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A default-pipeline run: 4 collector rounds, 3 learner steps, weights v0..v3, checkpoints at 2 and 3."""
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline, collect_main, learn_main
    from rlhf_pipeline.runs.run_directory import prepare_run

    module = load_pipeline_module(DEFAULT_PIPELINE)
    # a short warm start gives rewards some spread, so the learner's steps change the weights
    settings = make_settings(module, [*SMALL, "steps=3", "warm_start_steps=30"])
    paths = RunPaths(tmp_path_factory.mktemp("runs") / "tiny")
    pipeline = build_pipeline(module, settings, paths)
    prepare_run(pipeline, paths)
    collect_main(pipeline, paths, rounds=4)
    learn_main(pipeline, paths)
    return paths.root
